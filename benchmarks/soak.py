"""Soak: 200 steps of the realistic model under FSDP2, stock vs drop-in;
allocated memory after every step must stay flat after warm-up (max minus
min under 1 MiB).

    torchrun --nproc_per_node=2 -m benchmarks.soak [--quick]

``--steps`` is the number of steps (every one timed); ``--quick`` runs 20
steps of the leak model. Per recipe: allocated after
each step (over what was allocated before the model was built), its range
and drift after warm-up, peak, step times, identical losses.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence

from . import _harness as h
from ._runner import Job, gpu_main
from ._stack import SIZES, ModelSpec, Steps, estimate_seconds
from .fsdp2_memory import losses_row, timing_entries

NAME = "soak"
DEFAULTS = {
    "recipes": (list(h.RECIPES), list(h.RECIPES)),
    "sizes": (["realistic"], ["leak"]),
    "steps": (200, 20),  # every soak step is timed
    "warmup": (10, 5),  # steps left out of the flatness check and the step-time median
    "inits": (["bf16"], ["bf16"]),
    "report_every": (25, 5),
}


def parser() -> argparse.ArgumentParser:
    p = h.make_parser(NAME, __doc__)
    p.add_argument("--inits", type=h.csv_choices(h.INITS), help="bf16 (bf16 params), qinit (quantized_model_init)")
    p.add_argument("--report-every", type=h.positive_int, help="print a progress line every N steps")
    return p


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    args = h.parse_args(parser(), argv, DEFAULTS)
    if args.warmup >= args.steps:
        parser().error(f"--warmup ({args.warmup}) must be smaller than --steps ({args.steps})")
    return args


def soak_run(spec: ModelSpec, n_steps: int, dist, say: Callable[[str], None], every: int) -> dict:
    """Train ``n_steps`` steps; allocated memory after each (synchronized)."""
    import torch

    from testbed.model import allocated, optimizer_for, release_memory
    from testbed.recipes import make_recipe

    from ._stack import build, make_batches, run_step

    release_memory()
    baseline = allocated()
    torch.cuda.reset_peak_memory_stats()
    model = build(spec)
    opt = optimizer_for(model)
    recipe = make_recipe(spec.recipe)
    after, times, losses = [], [], []
    try:
        for step in range(n_steps):
            batches = make_batches(spec.size, step)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step_losses = run_step(model, opt, recipe, batches)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            losses += [float(v) for v in step_losses]
            del batches, step_losses
            after.append((allocated() - baseline) / h.MIB)
            if (step + 1) % every == 0:
                say(f"    step {step + 1}/{n_steps}: {after[-1]:.3f} MiB over baseline, {1e3 * times[-1]:.1f} ms")
        return {"spec": spec.as_dict(), "variant": spec.variant, "allocated_after_step_mib": after,
                "step_time_s": dist.max_over_ranks(times), "losses": losses, "baseline_mib": baseline / h.MIB,
                "peak_mib": (torch.cuda.max_memory_allocated() - baseline) / h.MIB}
    finally:
        del model, opt
        release_memory()


def plan(args: argparse.Namespace, dist, world: int, total_gib: float) -> list[Job]:
    say = (lambda msg: print(msg, flush=True)) if dist is not None and dist.is_main and not args.quiet else (
        lambda msg: None)
    jobs, i = [], 0
    for name in args.sizes:
        size = SIZES[name]
        layers = args.layers or size.layers
        for recipe in args.recipes:
            for init in args.inits:
                meta = {"section": "soak", "case": f"{name} {layers}L {recipe} {h.INIT_LABELS[init]}"}
                for managed in ((False, True) if i % 2 == 0 else (True, False)):
                    spec = ModelSpec(size=size, layers=layers, recipe=recipe, managed=managed,
                                     quantized_init=init == "qinit")
                    jobs.append(Job(label=spec.label(), meta=meta, spec=spec,
                                    run=lambda spec=spec: soak_run(spec, args.steps, dist, say, args.report_every),
                                    estimate_s=estimate_seconds(spec, Steps(0, 0, args.steps))))
                i += 1
    return jobs


def flatness(sample: dict, warmup: int) -> dict:
    """Range (max - min) and least-squares drift of allocated-after-step after warm-up."""
    values = sample["allocated_after_step_mib"][warmup:]
    if not values:
        return {"range_mib": None, "drift_mib_per_100_steps": None, "mean_mib": None}
    drift = h.slope(list(range(len(values))), values)
    return {"range_mib": max(values) - min(values), "mean_mib": h.mean(values),
            "drift_mib_per_100_steps": None if drift is None else 100 * drift}


def case_rows(case: str, st: dict, dr: dict, warmup: int) -> list[dict]:
    fs, fd = flatness(st, warmup), flatness(dr, warmup)
    flat = h.bound_row(case, f"allocated after step: max - min after {warmup} warm-up steps", "MiB",
                       fd["range_mib"], h.SOAK_FLAT_MIB_MAX, f"< {h.SOAK_FLAT_MIB_MAX:.0f} MiB (stock and drop-in)",
                       strict=True, stock=fs["range_mib"],
                       note=f"drift per 100 steps: stock {h.fmt(fs['drift_mib_per_100_steps'])} MiB, "
                            f"drop-in {h.fmt(fd['drift_mib_per_100_steps'])} MiB")
    if fs["range_mib"] is not None and flat["ok"] is not None:
        flat["ok"] = flat["ok"] and fs["range_mib"] < h.SOAK_FLAT_MIB_MAX
    timed = slice(warmup, None)
    return [losses_row(case, st, dr), flat,
            h.ratio_row(case, "allocated after step over baseline (mean after warm-up)", "MiB", fs["mean_mib"],
                        fd["mean_mib"]),
            h.ratio_row(case, "peak allocated over baseline", "MiB", st["peak_mib"], dr["peak_mib"]),
            h.time_row(case, st["step_time_s"][timed], dr["step_time_s"][timed])]


def summarize(samples: list[dict], args: argparse.Namespace | None = None) -> dict:
    warmup = args.warmup if args is not None else DEFAULTS["warmup"][0]
    cases: dict[str, dict] = {}
    for s in samples:
        cases.setdefault(s["case"], {})[s["variant"]] = s
    rows, series, timings = [], [], []
    for case, variants in cases.items():
        lines = [{"label": h.VARIANT_LABELS[v], "x": list(range(1, len(s["allocated_after_step_mib"]) + 1)),
                  "y": s["allocated_after_step_mib"]} for v, s in variants.items()]
        series.append({"id": f"soak_{_slug(case)}", "title": f"allocated after each step: {case}",
                       "xlabel": "step", "ylabel": "MiB over baseline", "lines": lines, "mark_x": warmup + 0.5})
        if "stock" in variants and "dropin" in variants:
            rows += case_rows(case, variants["stock"], variants["dropin"], warmup)
            timings += timing_entries(case, {v: {"step_time_s": s["step_time_s"][warmup:]}
                                             for v, s in variants.items()})
    return {"rows": rows, "series": series, "timings": timings}


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in text).strip("_")


def main(argv: Sequence[str] | None = None) -> int:
    return gpu_main(NAME, parse(argv), argv, plan, summarize)


if __name__ == "__main__":
    sys.exit(main())
