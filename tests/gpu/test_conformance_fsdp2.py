"""Conformance under FSDP2 (reshard and keep), at world size = GPUs
present (1 or 2): every managed call matches its plans and every output
and gradient equals a stock twin's. The worker is ``_conformance_fsdp2.py``.
Set ``TE_WM_CONFORMANCE_FSDP2_REPORT`` to a path to keep its report.
"""

from __future__ import annotations

import pytest

from _launch import TE_WORLD1_BLOCK_QINIT, two_rank_report

pytestmark = [pytest.mark.gpu, pytest.mark.distributed]


def _known_te_failure(report: dict, error: dict) -> bool:
    """Stock TE 2.20.2's own world-size-1 failure of Float8BlockScaling
    quantized parameters under FSDP2 (see ``_launch``)."""
    return (report.get("world_size") == 1 and "Float8BlockScaling/" in error["where"] and "/qinit/" in error["where"]
            and TE_WORLD1_BLOCK_QINIT in error["traceback"])


def test_fsdp2_calls_match_their_plans_and_stock(tmp_path):
    report = two_rank_report("_conformance_fsdp2.py", tmp_path, keep_env="TE_WM_CONFORMANCE_FSDP2_REPORT")
    assert report["dist_world_size"] == report["world_size"]
    errors = [e for e in report["errors"] if not _known_te_failure(report, e)]
    skipped = len(report["errors"]) - len(errors)
    if skipped:
        print(f"{skipped} case(s) hit stock TE's world-size-1 Float8BlockScaling quantized-init failure")
    assert not errors, "\n\n".join(f"{e['where']}\n{e['traceback']}" for e in errors)
    assert not report["problems"], "\n".join(report["problems"])
