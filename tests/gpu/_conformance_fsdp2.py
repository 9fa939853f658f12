"""FSDP2 worker for the conformance check: ``torchrun --nproc_per_node=N
tests/gpu/_conformance_fsdp2.py OUT.json`` (N = 1 or 2).

For each sm_90 recipe TE supports here, each module, bf16 and
quantized_model_init weights, and both reshard modes, a drop-in and its
stock twin are each wrapped by ``fully_shard`` and trained through the
same calls, with and without microbatch positions (``_conformance_run``).
Rank 0 writes ``{"problems": [...], "errors": [...], "unsupported": {...}}``.
"""

from __future__ import annotations

import sys

import torch.distributed as dist

from _fsdp2_stack import RECIPES  # noqa: F401  (first: it puts the repository root on sys.path)
from _conformance_run import Case, run_case
from testbed.dist import guard, run_worker
from testbed.recipes import supported_recipes

RECIPES_SM90 = ("Float8CurrentScaling", "Float8BlockScaling", "DelayedScaling")
MODULES = ("Linear", "LayerNormLinear", "LayerNormMLP")


def _sharder(reshard: bool):
    from torch.distributed.fsdp import fully_shard

    return lambda module: fully_shard(module, reshard_after_forward=reshard)


def _cases(recipe: str):
    for kind in MODULES:
        for qinit in (False, True):
            for microbatches in ((None,), (True, False)):
                yield Case(recipe, kind, qinit, microbatches)


def run_cases(report: dict) -> None:
    report["dist_world_size"] = dist.get_world_size()
    for recipe in supported_recipes(RECIPES_SM90, report["unsupported"]):
        for case in _cases(recipe):
            for reshard in (True, False):
                label = f"{case.label} reshard_after_forward={reshard}"
                guard(report, label, lambda: report["problems"].extend(
                    f"{label}: {p}" for p in run_case(case, prepare=_sharder(reshard))))


def main() -> int:
    return run_worker(sys.argv[1], run_cases, problems=[], unsupported={})


if __name__ == "__main__":
    sys.exit(main())
