"""Activation recompute: ``te.checkpoint`` around every layer of the FSDP2
stack, stock vs drop-in (and a bf16 baseline), memory and step time.

    torchrun --nproc_per_node=2 -m benchmarks.recompute [--quick]

``--modes`` picks TE's non-reentrant checkpoint (``use_reentrant=False``,
the usual composition with FSDP2) and/or its default reentrant one. The
figures are fsdp2_memory's: peak and after-step memory over the baseline,
the per-layer forward increment (outputs kept across ``te.checkpoint``),
the backward measures, quantizations per step (recompute passes included)
and the median step time with its spread.

``--policy NAME`` pins a policy on the drop-ins by its ``explain`` name,
e.g. ``fsdp2_recompute_build_once``: the recompute pass builds the
columnwise copy once and saves it for backward instead of TE's rebuild, an
option off by default because it costs peak memory (docs/decisions.md, D3).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from . import _harness as h
from ._runner import Job, gpu_main
from ._stack import SIZES, ModelSpec, Steps, add_policy_argument, estimate_seconds, measure
from .fsdp2_memory import _group, comparison_rows

NAME = "recompute"
MODES = ("nonreentrant", "reentrant")
DEFAULTS = {
    "recipes": (list(h.RECIPES), list(h.RECIPES)),
    "sizes": (["leak", "realistic"], ["leak"]),
    "steps": (10, 3),
    "warmup": (3, 1),
    "probes": (2, 1),
    "modes": (list(MODES), ["nonreentrant"]),
}


def parser() -> argparse.ArgumentParser:
    p = h.make_parser(NAME, __doc__)
    p.add_argument("--modes", type=h.csv_choices(MODES), help="te.checkpoint modes: nonreentrant, reentrant")
    p.add_argument("--probes", type=h.positive_int, help="memory-probe steps per model, after warm-up")
    add_policy_argument(p, "The case names say so.")
    return p


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    return h.parse_args(parser(), argv, DEFAULTS)


def plan(args: argparse.Namespace, dist, world: int, total_gib: float) -> list[Job]:
    steps = Steps(warmup=args.warmup, probe=args.probes, timed=args.steps)
    specs: list[tuple[dict, ModelSpec]] = []
    i = 0
    for mode in args.modes:
        for name in args.sizes:
            size = SIZES[name]
            layers = args.layers or size.layers
            section = f"recompute-{mode}"
            specs.append(({"section": section, "case": f"{name} {layers}L bf16 {mode}", "mode": mode},
                          ModelSpec(size=size, layers=layers, checkpoint=mode)))
            for recipe in args.recipes:
                case = f"{name} {layers}L {recipe} {mode}" + (f" policy {args.policy}" if args.policy else "")
                meta = {"section": section, "case": case, "mode": mode}
                for managed in ((False, True) if i % 2 == 0 else (True, False)):
                    specs.append((meta, ModelSpec(size=size, layers=layers, recipe=recipe, managed=managed,
                                                  checkpoint=mode, policy=args.policy if managed else None)))
                i += 1
    return [Job(label=spec.label(), meta=meta, spec=spec, run=lambda spec=spec: measure(spec, steps, dist),
                estimate_s=estimate_seconds(spec, steps)) for meta, spec in specs]


def summarize(samples: list[dict], args: argparse.Namespace | None = None) -> dict:
    cases, bf16 = _group(samples)
    rows, timings = comparison_rows(cases, bf16, timed=lambda section: True)
    return {"rows": rows, "timings": timings}


def main(argv: Sequence[str] | None = None) -> int:
    return gpu_main(NAME, parse(argv), argv, plan, summarize)


if __name__ == "__main__":
    sys.exit(main())
