"""The drop-ins' quantized FSDP2 all-gather (``te_integration.enable_quantized_gather``,
D13): real gloo runs at world sizes 2 and 4 with the stand-in TE (the worker,
``_gather_binding_worker.py``, says what each row checks)."""

from __future__ import annotations

from pathlib import Path

import pytest

from _torchrun import report_of


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_the_drop_ins_gather_quantized_shards_made_once_per_step(tmp_path: Path, world: int) -> None:
    report = report_of("_gather_binding_worker.py", tmp_path / "gather_binding.json", nproc=world)
    rows = [(part["rank"], row) for part in report["ranks"] for row in part["rows"]]
    assert report["world_size"] == world and len(report["ranks"]) == world
    cases = {row["case"] for _, row in rows}
    assert {"parity reshard=True mb=1", "parity reshard=True mb=4", "parity reshard=False mb=4",
            "parity reshard=True mb=2 block", "parity reshard=False mb=2 block",
            "parity reshard=True mb=2 grouped", "parity reshard=False mb=2 grouped",
            "report, stale, release", "without the step task", "fallback DelayedScaling",
            "fallback MXFP8BlockScaling", "fallback Float8BlockScaling", "after the first forward",
            "checkpoint into stock"} <= cases, sorted(cases)
    failed = [f"rank {rank}: {row['case']}: {row['what']}: expected {row['expected']}, got {row['got']}"
              for rank, row in rows if not row["passed"]]
    assert not failed, "\n".join(failed) + "\n" + report["output"]
    assert report["returncode"] == 0, report["output"]
