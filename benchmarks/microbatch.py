"""Microbatching under FSDP2 with ``reshard_after_forward=False``: 4 and 8
microbatches per step with ``is_first_microbatch``, stock vs drop-in with
the microbatch cache option pinned.

    torchrun --nproc_per_node=2 -m benchmarks.microbatch [--quick]

Stock TE requantizes every weight on every microbatch under FSDP2, and so do
the drop-ins by default. This benchmark measures the option that does not:
``FSDP2WorkspacePolicy(microbatch_cache=MicrobatchCache.EXACT_FORMATS)``
(``explain`` name ``fsdp2_microbatch_cache``, off by default:
docs/decisions.md, D4) keeps one workspace per weight for the step and
drops it at the optimizer step. Per configuration: weight quantizations per
step (counted at TE's ``quantize_weight``), median step time with its
spread, identical losses, cached workspaces left after the step, peak and
after-step memory. ``benchmarks.step_time --microbatches 4 --policy
fsdp2_microbatch_cache`` times the same in pairs, which is the figure to
read for step time.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from . import _harness as h
from ._runner import Job, gpu_main
from ._stack import SIZES, ModelSpec, Steps, estimate_seconds, measure
from .fsdp2_memory import losses_row, quantization_row, timing_entries

NAME = "microbatch"
#: The option measured here, pinned on the drop-in models.
POLICY = "fsdp2_microbatch_cache"
DEFAULTS = {
    "recipes": (list(h.RECIPES), list(h.RECIPES)),
    "sizes": (["leak", "realistic"], ["leak"]),
    "steps": (10, 3),
    "warmup": (2, 1),
    "probes": (1, 1),
    "microbatches": ([4, 8], [4, 8]),
}


def parser() -> argparse.ArgumentParser:
    p = h.make_parser(NAME, __doc__)
    p.add_argument("--microbatches", type=h.int_list, help="microbatch counts per step (default 4,8)")
    p.add_argument("--probes", type=h.positive_int, help="counting/memory-probe steps per model, after warm-up")
    return p


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    return h.parse_args(parser(), argv, DEFAULTS)


def plan(args: argparse.Namespace, dist, world: int, total_gib: float) -> list[Job]:
    jobs, i = [], 0
    for name in args.sizes:
        size = SIZES[name]
        layers = args.layers or size.layers
        for micro in args.microbatches:
            steps = Steps(warmup=args.warmup, probe=args.probes, timed=args.steps, micro=micro)
            for recipe in args.recipes:
                meta = {"section": "microbatch", "case": f"{name} {layers}L {recipe} x{micro} microbatches",
                        "microbatches": micro}
                for managed in ((False, True) if i % 2 == 0 else (True, False)):
                    spec = ModelSpec(size=size, layers=layers, recipe=recipe, managed=managed,
                                     reshard_after_forward=False, policy=POLICY if managed else None)
                    jobs.append(Job(label=f"{spec.label()} x{micro}", meta=meta, spec=spec,
                                    run=lambda spec=spec, steps=steps: measure(spec, steps, dist),
                                    estimate_s=estimate_seconds(spec, steps)))
                i += 1
    return jobs


def cache_note(dr: dict) -> str:
    """The size of what the drop-in keeps for the step: one FP8 workspace
    per weight (1 byte an element per usage, rowwise and columnwise)."""
    n = dr.get("weight_numel")
    if not n:
        return ""
    return (f"the drop-in keeps one FP8 workspace per weight through the step: {n / h.MIB:.1f} MiB rowwise, "
            f"{2 * n / h.MIB:.1f} MiB with columnwise data")


def case_rows(case: str, st: dict, dr: dict) -> list[dict]:
    cached = dr.get("cached_workspaces_after_step") or []
    note = cache_note(dr)
    return [
        losses_row(case, st, dr),
        quantization_row(case, st, dr, strict=True, limit=1.0),
        h.time_row(case, st["step_time_s"], dr["step_time_s"], limit=1.0, strict=True),
        h.check_row(case, "drop-in: no cached workspace left after the step", all(c == 0 for c in cached),
                    f"cached workspaces after each probed step: {cached}", target="0 after every step"),
        h.ratio_row(case, "peak allocated over baseline", "MiB", st["peak_mib"], dr["peak_mib"], note=note),
        h.ratio_row(case, "allocated after step over baseline", "MiB", st["after_step_mib"], dr["after_step_mib"]),
    ]


def summarize(samples: list[dict], args: argparse.Namespace | None = None) -> dict:
    cases: dict[str, dict] = {}
    for s in samples:
        cases.setdefault(s["case"], {})[s["variant"]] = s
    rows, timings, bars = [], [], []
    for case, variants in cases.items():
        if "stock" in variants and "dropin" in variants:
            rows += case_rows(case, variants["stock"], variants["dropin"])
            timings += timing_entries(case, variants)
    quant = [r for r in rows if r["metric"] == "weight quantizations per step"]
    if quant:
        bars.append({"id": "quantizations", "title": "weight quantizations per step (reshard_after_forward=False)",
                     "ylabel": "quantizations per step", "labels": [r["case"] for r in quant],
                     "groups": {"stock": [r["stock"] for r in quant], "drop-in": [r["dropin"] for r in quant]}})
    return {"rows": rows, "timings": timings, "bars": bars}


def main(argv: Sequence[str] | None = None) -> int:
    return gpu_main(NAME, parse(argv), argv, plan, summarize)


if __name__ == "__main__":
    sys.exit(main())
