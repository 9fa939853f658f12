"""Which drop-ins an optimizer step writes under FSDP2: a real 2-rank gloo
run on CPU with the stand-in TE (the worker: ``_step_map_worker.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from _torchrun import report_of


@pytest.mark.distributed
def test_each_models_step_writes_its_own_drop_ins_through_fsdp2s_records(tmp_path: Path) -> None:
    report = report_of("_step_map_worker.py", tmp_path / "step_map.json")
    rows = [row for part in report["ranks"] for row in part["rows"]]
    cases = {row["case"] for row in rows}
    assert {"reshard_after_forward=True", "reshard_after_forward=False", "a DTensor no FSDP2 record names"} <= cases
    assert any("set_reshard_after_backward(False)" in case for case in cases)
    assert report["world_size"] == 2 and len(report["ranks"]) == 2
    failed = [f"rank {part['rank']}: {row['case']}: {row['what']}: expected {row['expected']}, got {row['got']}"
              for part in report["ranks"] for row in part["rows"] if not row["passed"]]
    assert not failed, "\n".join(failed)
