"""Launching a CPU (gloo) worker under torchrun from a test."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def gloo_unavailable() -> str | None:
    """Why a torchrun test cannot run here, or None."""
    import torch.distributed as dist

    if not dist.is_available():
        return "this torch build has no torch.distributed"
    if not dist.is_gloo_available():
        return "this torch build has no gloo backend"
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return "torch.distributed.fsdp.fully_shard (FSDP2) needs torch >= 2.6"
    return None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchrun(worker: Path, args: list[str], nproc: int = 2, timeout_s: int = 300) -> subprocess.CompletedProcess:
    """torchrun in its own session, so a hang kills its workers too."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--nnodes=1",
        "--master_addr=127.0.0.1", f"--master_port={_free_port()}", str(worker), *args,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"torchrun did not finish within {timeout_s} s; output:\n{out[-6000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, None)
