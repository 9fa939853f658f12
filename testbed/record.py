"""What every result file records about where it ran (Python, platform,
torch, CUDA, the GPUs, TE's version and the commit), and the JSON values it
is written with. The benchmarks and the harness that runs TE's own tests on
the drop-ins both write such records. Nothing here needs CUDA or
TransformerEngine: torch is imported inside :func:`capture_env`, and TE's
version is read without importing it."""

from __future__ import annotations

import dataclasses
import enum
import math
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["REPO_ROOT", "capture_env", "git_commit", "jsonable", "te_version"]

#: The repository root: where ``git`` is asked for the commit.
REPO_ROOT = Path(__file__).resolve().parents[1]


def git_commit() -> dict:
    """The commit and whether tracked files differ from it. ``TE_WM_COMMIT``,
    if set, wins: a copy of the working tree made for another machine may
    hold a ``.git`` that is not the checkout's (run 2026-11-30 read an older
    HEAD that way). Without it and without git: ``"unknown"``."""
    def git(*cmd: str) -> str | None:
        try:
            out = subprocess.run(["git", *cmd], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    given = os.environ.get("TE_WM_COMMIT")
    if given:
        return {"commit": given, "dirty": None, "source": "TE_WM_COMMIT"}
    commit = git("rev-parse", "HEAD")
    if commit is None:
        return {"commit": "unknown", "dirty": None, "source": "none"}
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": bool(status) if status is not None else None, "source": "git"}


def te_version() -> str | None:
    """TransformerEngine's version without importing it: from the imported
    module if a benchmark already did, else from the package metadata."""
    module = sys.modules.get("transformer_engine")
    if module is not None and getattr(module, "__version__", None):
        return str(module.__version__)
    from importlib import metadata

    for dist in ("transformer_engine", "transformer-engine", "transformer_engine_torch"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def capture_env() -> dict:
    """Python, platform, torch, CUDA, the GPUs, TE and the commit."""
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "world_size": int(os.environ.get("WORLD_SIZE", "1")),
        "torch": None, "cuda": None, "gpus": [], "gpu_memory_gib": [],
        "te": te_version(),
        **git_commit(),
    }
    try:
        import torch
    except ImportError:
        return env
    env["torch"] = torch.__version__
    env["cuda"] = torch.version.cuda
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            env["gpus"].append(props.name)
            env["gpu_memory_gib"].append(round(props.total_memory / 2**30, 1))
    return env


def jsonable(obj: Any) -> Any:
    """Plain JSON values: NaN and infinities become None; paths, enums and
    dataclasses become strings and dicts."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, enum.Enum):
        return obj.value
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return jsonable(dataclasses.asdict(obj))
    return obj
