"""FSDP2 worker for the conformance check: ``torchrun --nproc_per_node=N
tests/gpu/_conformance_fsdp2.py OUT.json`` (N = 1 or 2).

For each sm_90 recipe TE supports here, each module, bf16 and
quantized_model_init weights, and both reshard modes, a drop-in and its
stock twin are each wrapped by ``fully_shard`` and trained through the
same calls, with and without microbatch positions (``_conformance_run``).
Rank 0 writes ``{"problems": [...], "errors": [...], "unsupported": {...}}``.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

from _conformance_run import Case, run_case
from conftest import recipe_skip_reason

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


def main() -> int:
    out_path = sys.argv[1]
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    report = {"problems": [], "errors": [], "unsupported": {}, "dist_world_size": dist.get_world_size()}
    for recipe in RECIPES_SM90:
        reason = recipe_skip_reason(recipe)
        if reason:
            report["unsupported"][recipe] = reason
            continue
        for case in _cases(recipe):
            for reshard in (True, False):
                label = f"{case.label} reshard_after_forward={reshard}"
                try:
                    report["problems"] += [f"{label}: {p}" for p in run_case(case, prepare=_sharder(reshard))]
                except Exception:  # recorded, so one failing case does not hide the others
                    report["errors"].append({"where": label, "traceback": traceback.format_exc()})
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(report, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
