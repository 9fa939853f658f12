"""Launch a two-rank worker through torchrun and read the JSON report it writes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_rank_report(worker: str, out_dir: Path, *, keep_env: str, timeout: int = 1200) -> dict:
    """Run ``tests/gpu/<worker>`` on two ranks; skip without two GPUs; fail
    with the worker's output if it wrote no report. When the environment
    variable ``keep_env`` names a path, the report is copied there."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, found {torch.cuda.device_count()}")
    out = out_dir / "report.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           str(Path(__file__).with_name(worker)), str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=dict(os.environ))
    if not out.exists():
        pytest.fail(f"worker wrote no report (rc={result.returncode}):\n{result.stdout[-4000:]}\n{result.stderr[-8000:]}")
    data = json.loads(out.read_text())
    if os.environ.get(keep_env):
        Path(os.environ[keep_env]).write_text(json.dumps(data, indent=1))
    return data
