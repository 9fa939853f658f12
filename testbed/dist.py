"""The NCCL process group of one torchrun rank (:class:`Dist`), the
environment it runs under (:data:`SAFE_ENV`), and the skeleton every
torchrun worker of ``tests/gpu`` shares (:func:`run_worker`, :func:`guard`);
the GPU benchmarks use the same group and guard. torch.distributed, CUDA and
TE are imported inside the functions, so importing this module needs none
of them."""

from __future__ import annotations

import datetime
import json
import os
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["SAFE_ENV", "Dist", "guard", "run_worker"]

#: NVLink multicast (NVLS) stays off: neither the benchmarks nor the tests need it, and on
#: hosts whose GPUs are shared or partitioned its setup can fail. Set only
#: where the caller has not set them, so a user can turn it back on.
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


class Dist:
    """This rank, and the few collectives the benchmarks and workers need. ``timeout_s``
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
        from .model import release_memory

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
