"""FSDP2 sharding detection: a real 2-rank gloo run on CPU, plus the checks
that need no process group."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from workspace_manager._context import Sharding
from workspace_manager._errors import ContextTypeError
from workspace_manager._fsdp2 import detect_fsdp2_sharding

from _torchrun import REPO, gloo_unavailable, run_torchrun

WORKER = Path(__file__).with_name("_fsdp2_worker.py")


@pytest.mark.distributed
def test_fsdp2_detection_under_torchrun(tmp_path: Path) -> None:
    reason = gloo_unavailable()
    if reason:
        pytest.skip(reason)
    result = tmp_path / "fsdp2_detect.json"
    proc = run_torchrun(WORKER.name, result)
    tail = proc.stdout[-6000:]
    assert result.exists(), f"the worker wrote no result (rc={proc.returncode}); output:\n{tail}"
    report = json.loads(result.read_text())
    rows = [row for part in report["ranks"] for row in part["rows"]]
    assert rows, f"the worker checked nothing; output:\n{tail}"
    for part in report["ranks"]:
        for skip in part["skipped"]:
            print(f"rank {part['rank']} skipped {skip['case']}: {skip['reason']}")
    for row in rows:
        assert row["passed"], (
            f"{row['case']}: leaf {row['leaf']} {row['phase']}: expected {row['expected']}, got {row['got']}"
        )
    assert proc.returncode == 0, f"torchrun exited {proc.returncode}; output:\n{tail}"


def test_model_without_fsdp2_is_none() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Sequential(nn.Linear(4, 2)))
    for name, leaf in model.named_modules():
        assert detect_fsdp2_sharding(leaf) is Sharding.NONE, name
        assert detect_fsdp2_sharding(leaf, root=model) is Sharding.NONE, name


@pytest.mark.parametrize("bad", [nn.Linear(2, 2).weight, "linear", None])
def test_non_module_is_a_type_error(bad: object) -> None:
    with pytest.raises(ContextTypeError, match="module must be a torch.nn.Module") as info:
        detect_fsdp2_sharding(bad)  # type: ignore[arg-type]
    assert isinstance(info.value, TypeError)
    assert type(bad).__name__ in str(info.value)


def test_non_module_root_is_a_type_error() -> None:
    with pytest.raises(ContextTypeError, match="root must be a torch.nn.Module"):
        detect_fsdp2_sharding(nn.Linear(2, 2), root=torch.zeros(1))  # type: ignore[arg-type]


def test_fsdp2_imported_by_its_older_path_is_seen() -> None:
    """``torch.distributed._composable.fsdp`` (FSDP2's path before torch 2.6,
    still importable) re-exports ``torch.distributed.fsdp``'s, so importing
    it alone imports the one package the detection looks for."""
    code = ("import sys; from torch.distributed._composable.fsdp import fully_shard; "
            "from workspace_manager._fsdp2 import _FSDP2_PACKAGE, _fsdp2_api; "
            "print(_FSDP2_PACKAGE in sys.modules, _fsdp2_api() is not None)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "True"]
