"""Launching an FSDP2 benchmark or GPU test worker: torchrun, CUDA, TE and
NCCL, checked with errors that say what to do; the process group; and the
skeleton every torchrun worker of ``tests/gpu`` shares (:func:`run_worker`).
torch.distributed, CUDA and TE are imported inside the functions, so
importing this module needs none of them."""

from __future__ import annotations

import datetime
import json
import os
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["SAFE_ENV", "Dist", "guard", "launch_message", "require_launch", "run_worker"]

#: NVLink multicast (NVLS) stays off: the benchmarks do not need it, and on
#: hosts whose GPUs are shared or partitioned its setup can fail. Set only
#: where the caller has not set them, so a user can turn it back on.
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def launch_message(name: str, argv: Sequence[str], ranks: int, world: int) -> str:
    args = " ".join(argv)
    found = "it was started without torchrun" if world == 0 else f"it was started with {world} rank(s)"
    return (f"benchmarks.{name} runs FSDP2 on 1 or 2 GPUs (world size = the GPUs present), one process each, "
            f"but {found}. Launch it with:\n"
            f"  torchrun --nproc_per_node=2 -m benchmarks.{name} {args}".rstrip() + "\n"
            "(--nproc_per_node=1 on a machine with one GPU; "
            "it needs TE: pip install -e '.[te,test,bench]'; "
            "`python -m benchmarks.run_all` launches every benchmark)")


def require_launch(name: str, argv: Sequence[str], *, ranks: int = 1) -> None:
    """Exit with a message saying how to launch, unless this process is one
    of >= ``ranks`` torchrun ranks on a CUDA machine with TE importable (one
    rank is FSDP2 at world size 1: a mesh of one GPU)."""
    world = int(os.environ.get("WORLD_SIZE", "0") or 0) if "LOCAL_RANK" in os.environ else 0
    if world < ranks:
        raise SystemExit(launch_message(name, argv, ranks, world))
    import torch

    if not torch.cuda.is_available():
        raise SystemExit(f"benchmarks.{name} needs CUDA GPUs; torch {torch.__version__} sees none here.")
    local = int(os.environ["LOCAL_RANK"])
    if local >= torch.cuda.device_count():
        raise SystemExit(f"benchmarks.{name}: LOCAL_RANK {local} but only {torch.cuda.device_count()} GPU(s); "
                         f"use --nproc_per_node={torch.cuda.device_count()} or fewer")
    try:
        import te_integration  # noqa: F401
    except ImportError as err:
        raise SystemExit(f"benchmarks.{name} needs TransformerEngine 2.20 with te_integration: {err}\n"
                         "Install it with: pip install -e '.[te,test,bench]'") from None


class Dist:
    """This rank, and the few collectives the benchmarks need. ``timeout_s``
    None: torch's own default for NCCL collectives."""

    def __init__(self, timeout_s: float | None = 300.0) -> None:
        import torch
        import torch.distributed as dist

        for key, value in SAFE_ENV.items():
            os.environ.setdefault(key, value)
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
        dist.init_process_group("nccl", timeout=timeout)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self._dist, self._torch = dist, torch

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def any_true(self, flag: bool) -> bool:
        """True on every rank if it is True on any (budget decisions)."""
        t = self._torch.tensor([1.0 if flag else 0.0], device="cuda")
        self._dist.all_reduce(t, op=self._dist.ReduceOp.MAX)
        return bool(t.item() > 0)

    def max_over_ranks(self, values: Sequence[float]) -> list[float]:
        """Element-wise maximum over the ranks (a step lasts as long as its slowest rank)."""
        if not values:
            return []
        t = self._torch.tensor(list(values), dtype=self._torch.float64, device="cuda")
        self._dist.all_reduce(t, op=self._dist.ReduceOp.MAX)
        return [float(v) for v in t.tolist()]

    def barrier(self) -> None:
        self._dist.barrier()

    def close(self) -> None:
        if self._dist.is_initialized():
            self._dist.barrier()
            self._dist.destroy_process_group()


def guard(report: dict, where: str, fn: Callable[[], Any],
          catch: tuple[type[BaseException], ...] = (Exception,)) -> bool:
    """Run ``fn``; if it raises one of ``catch``, list the traceback under
    ``report["errors"]`` (labelled ``where``), free the GPU memory it left,
    and go on, so one failing case does not hide the others. True if it ran
    through."""
    try:
        fn()
    except catch:
        report["errors"].append({"where": where, "traceback": traceback.format_exc()})
        from ._model import release_memory

        release_memory()
        return False
    return True


def run_worker(out_path: str | os.PathLike, body: Callable[[dict], None], **fields: Any) -> int:
    """The skeleton of a torchrun worker of ``tests/gpu``: join the NCCL
    process group on this rank's GPU (torch's default timeout), start the
    report as ``fields`` plus an empty ``errors`` list, let ``body`` fill it
    (each case through :func:`guard`; whatever escapes ``body`` is listed
    too), write it as JSON to ``out_path`` on rank 0, wait for every rank
    and leave the group. Exit status 1 if the report lists an error."""
    dist = Dist(timeout_s=None)
    report = {**fields, "errors": []}
    try:
        guard(report, "worker", lambda: body(report))
        if dist.is_main:
            Path(out_path).write_text(json.dumps(report, indent=1))
    finally:
        dist.close()
    return 1 if report["errors"] else 0
