"""Run a CPU (gloo) torchrun worker of this folder from a test and read its JSON report.

Every worker takes one argument, the path of its report, and writes it with
``_ranks.report`` (anything else it writes goes beside the report)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300


def gloo_unavailable() -> str | None:
    """Why a gloo torchrun test cannot run here, or None."""
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


def run_torchrun(worker: str, result: Path, nproc: int = 2, timeout_s: int = TIMEOUT_S) -> subprocess.CompletedProcess:
    """torchrun of ``tests/distributed/<worker>`` in its own session, so a
    hang kills its workers too; the worker writes its report to ``result``."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--nnodes=1",
        "--master_addr=127.0.0.1", f"--master_port={_free_port()}", str(Path(__file__).with_name(worker)), str(result),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"torchrun did not finish within {timeout_s} s; output:\n{out[-6000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, None)


def report_of(worker: str, result: Path, nproc: int = 2, timeout_s: int = TIMEOUT_S) -> dict:
    """The worker's report; skips where gloo cannot run, fails where the worker
    wrote none. The torchrun output is kept in the report as ``output``."""
    reason = gloo_unavailable()
    if reason:
        pytest.skip(reason)
    proc = run_torchrun(worker, result, nproc, timeout_s)
    assert result.exists(), f"the worker wrote no result (rc={proc.returncode}); output:\n{proc.stdout[-6000:]}"
    report = json.loads(result.read_text())
    report["output"] = proc.stdout[-6000:]
    report["returncode"] = proc.returncode
    return report
