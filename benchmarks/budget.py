"""The FSDP2 speed option: forward's weight copies kept for backward within a
byte budget, against stock TE, paired step by step.

    torchrun --nproc_per_node=2 -m benchmarks.budget [--quick]

(``--nproc_per_node=1`` on one GPU.) Under FSDP2 every layer's backward
quantizes the weight it gathers again. ``te_integration.apply_workspace_budget``
pins ``KeepForBackwardWorkspacePolicy`` on the last layers, which keep
forward's columnwise copy (one byte per parameter) until their backward
instead. Per sm_90 recipe, six models of one stack are built from one seed
and trained in turn, one step each, on the same data: stock TE, the drop-ins
with budgets of 0, 25, 50 and 100% of one full FP8 copy of the weights
(0% is the drop-ins' default plan), and stock again (the control: its ratio
to stock is the noise floor). Per model: the median step time (the slowest
rank's) and the peak allocated during a step over what was allocated at its
start (the largest over the timed steps). The summary gives every ratio to
stock and to the 0% budget, the kept bytes, whether the losses are
identical, and one sentence per recipe on where the option pays off.
``python -m benchmarks.plot`` draws step time against peak memory, one line
per recipe, in one figure.

The stack: TransformerLayer(2048, 8192, 16 heads) x 4 (``--layers``), seq
1024 (``--seq``), batch 2 per rank, bf16 parameters, ``fully_shard`` on
every layer and at the root with ``reshard_after_forward=True``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Sequence

from . import _harness as h
from ._runner import Job, gpu_main
from ._stack import ModelSpec, Size, Steps, estimate_seconds

NAME = "budget"
DEFAULTS = {
    "recipes": (list(h.RECIPES), list(h.RECIPES)),
    "steps": (40, 8),
    "warmup": (5, 2),
    "layers": (4, 2),
    "seq": (1024, 512),
    "budgets": ([0, 25, 50, 100], [0, 100]),
}
STACK = Size("budget", hidden=2048, ffn=8192, heads=16, seq=1024, batch=2, layers=4)


def _percent_list(text: str) -> list[int]:
    """An argparse type: comma-separated whole percentages from 0 to 100."""
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        values = []
    if not values or any(not 0 <= v <= 100 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated percentages from 0 to 100; received {text!r}")
    return sorted(set(values))


def parser() -> argparse.ArgumentParser:
    p = h.make_parser(NAME, __doc__)
    p.add_argument("--seq", type=h.positive_int, help="sequence length (default 1024, --quick 512)")
    p.add_argument("--budgets", type=_percent_list,
                   help="budgets in percent of one full FP8 copy of the weights (default 0,25,50,100)")
    return p


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    args = h.parse_args(parser(), argv, DEFAULTS)
    if args.sizes is not None:
        parser().error("--sizes does not apply: the stack is fixed (see --layers and --seq)")
    return args


def variants(budgets: Sequence[int]) -> list[str]:
    """The models of a case, in the order they take turns: stock, each
    budget, stock again."""
    return ["stock", *[budget_label(b) for b in budgets], "stock_again"]


def budget_label(percent: int) -> str:
    return f"keep_{percent}"


def case_specs(args: argparse.Namespace, recipe: str) -> dict[str, tuple[ModelSpec, float | None]]:
    """{variant: (spec, budget as a fraction of one full FP8 copy, None for stock)}."""
    size = dataclasses.replace(STACK, seq=args.seq, layers=args.layers)
    out: dict[str, tuple[ModelSpec, float | None]] = {}
    for label in variants(args.budgets):
        stock = label.startswith("stock")
        spec = ModelSpec(size=size, layers=args.layers, recipe=recipe, managed=not stock)
        out[label] = (spec, None if stock else int(label.removeprefix("keep_")) / 100)
    return out


def plan(args: argparse.Namespace, dist, world: int, total_gib: float) -> list[Job]:
    steps = Steps(warmup=args.warmup, probe=0, timed=args.steps)
    jobs = []
    for recipe in args.recipes:
        specs = case_specs(args, recipe)
        case = f"{args.layers}L seq {args.seq} {recipe}"
        jobs.append(Job(label=f"[budget] {case}", meta={"case": case, "recipe": recipe}, spec=specs["stock"][0],
                        run=lambda specs=specs: paired_budgets(specs, steps, dist),
                        estimate_s=sum(estimate_seconds(spec, steps) for spec, _ in specs.values())))
    return jobs


# -- on the GPU ---------------------------------------------------------------------
def build_with_budget(spec: ModelSpec, fraction: float | None):
    """The stack of ``spec``; for a drop-in one, the keep policy pinned
    within ``fraction`` of one full FP8 copy of its weights. Returns the
    model and the budget report (None for stock)."""
    from . import _stack

    model = _stack.build(spec)
    if fraction is None:
        return model, None
    import te_integration as ti

    full = ti.apply_workspace_budget(model, 0).candidate_bytes
    return model, ti.apply_workspace_budget(model, int(fraction * full))


def paired_budgets(specs: dict, steps: Steps, dist) -> dict:
    """Build every model of ``specs`` and train them in turn, one step each
    (as ``_stack.paired_times`` does), timing each step and reading its peak
    over its start."""
    from . import _stack

    _stack.release_memory()
    built = {label: build_with_budget(spec, fraction) for label, (spec, fraction) in specs.items()}
    opts = {label: _stack.optimizer_for(model) for label, (model, _) in built.items()}
    # one recipe object per model, as _stack.paired_times makes them
    recipes = {label: _stack.make_recipe(spec.recipe) for label, (spec, _) in specs.items()}
    size = next(iter(specs.values()))[0].size
    times: dict[str, list[float]] = {label: [] for label in specs}
    peaks: dict[str, list[float]] = {label: [] for label in specs}
    losses: dict[str, list[float]] = {label: [] for label in specs}
    try:
        for step in range(steps.warmup + steps.timed):
            batches = _stack.make_batches(size, step)
            for label, (model, _) in built.items():
                seconds, peak, step_losses = _timed_step(model, opts[label], recipes[label], batches)
                if step >= steps.warmup:
                    times[label].append(seconds)
                    peaks[label].append(peak)
                losses[label] += [float(v) for v in step_losses]
        reports = {label: report for label, (_, report) in built.items() if report is not None}
        return {"step_time_s": {label: dist.max_over_ranks(t) for label, t in times.items()},
                # not "peak_mib": the runner's progress line reads that as one number
                "step_peak_mib": {label: max(dist.max_over_ranks(p)) / h.MIB for label, p in peaks.items()},
                "losses": losses,
                "kept_mib": {label: r.kept_bytes / h.MIB for label, r in reports.items()},
                "full_copy_mib": max((r.candidate_bytes for r in reports.values()), default=0) / h.MIB,
                "reports": {label: str(r) for label, r in reports.items()}}
    finally:
        del built, opts
        _stack.release_memory()


def _timed_step(model, opt, recipe, batches) -> tuple[float, int, list]:
    """One optimizer step between two synchronizations: seconds, the peak
    allocated over the step's start (bytes) and the losses."""
    import torch

    from . import _stack

    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    step_losses = _stack.run_step(model, opt, recipe, batches)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    return seconds, torch.cuda.max_memory_allocated() - start, step_losses


# -- summary (pure) -----------------------------------------------------------------
def _median_ms(seconds: Sequence[float]) -> float:
    return 1e3 * h.spread(seconds)["median"]


def control_range(sample: dict) -> tuple[float, float]:
    """The control's spread: the interquartile range of stock again / stock,
    step by step (the models take turns, so step i of each saw the same drift)."""
    t = sample["step_time_s"]
    ratios = [b / a for a, b in zip(t["stock"], t["stock_again"]) if a > 0]
    return (h.quantile(ratios, 0.25), h.quantile(ratios, 0.75)) if ratios else (1.0, 1.0)


def case_rows(sample: dict) -> list[dict]:
    """The losses check, then per budget and the control: step time and
    step peak against stock (each a case of its own, so that each metric
    is one figure)."""
    case, t, peak = sample["case"], sample["step_time_s"], sample["step_peak_mib"]
    losses = sample["losses"]
    same = all(v == losses["stock"] for v in losses.values())
    rows = [h.check_row(case, "losses identical (stock, every budget, stock again)", same,
                        f"{len(losses['stock'])} steps" + ("" if same else ": they differ"))]
    for label in [k for k in t if k != "stock"]:
        kept = sample.get("kept_mib", {}).get(label)
        name = f"{case}, {label.replace('_', ' ')}" + ("%" if kept is not None else "")
        note = (f"keep policy pinned on {kept:.1f} of {sample.get('full_copy_mib', 0.0):.1f} MiB of weights"
                if kept is not None else "control: the noise floor")
        time_row = h.time_row(name, t["stock"], t[label], limit=None)
        time_row["note"] = note
        rows.append(time_row)
        rows.append(h.ratio_row(name, "step peak over its start", "MiB", peak["stock"], peak[label], limit=None,
                                note=note))
    return rows


def _budgets_of(sample: dict) -> list[str]:
    return [k for k in sample["step_time_s"] if k.startswith("keep_")]


def verdict(sample: dict) -> str:
    """One plain sentence on where the option pays off for this recipe: the
    budget with the fastest step against the 0% budget (the drop-ins'
    default), read against the control's spread."""
    recipe, t, peak = sample["recipe"], sample["step_time_s"], sample["step_peak_mib"]
    budgets = _budgets_of(sample)
    if "keep_0" not in budgets or len(budgets) < 2:
        return f"{recipe}: no comparison (the 0% budget and another one are needed)."
    base = _median_ms(t["keep_0"])
    best = min(budgets[1:], key=lambda b: _median_ms(t[b]))
    change = _median_ms(t[best]) / base - 1  # negative: faster than the default
    lo, hi = control_range(sample)
    noise = max(1 - lo, hi - 1)
    extra = peak[best] - peak["keep_0"]
    pct = best.removeprefix("keep_")
    against = f"{change:+.1%} in step time against the default (0%), control ±{noise:.1%}, {extra:+.0f} MiB of peak"
    if recipe == "DelayedScaling":
        return (f"{recipe}: no change expected. The keep policy plans delayed scaling as FSDP2 does (requantizing "
                f"is not exact), so every budget runs the default plan; the best budget ({pct}%) measured {against}.")
    if -change > noise:
        return f"{recipe}: pays off. A {pct}% budget gives {against}."
    return f"{recipe}: does not pay off here. The best budget ({pct}%) gives {against}: within the noise."


def payoff_table(samples: list[dict]) -> dict:
    rows = []
    for s in samples:
        t, peak, stock_ms = s["step_time_s"], s["step_peak_mib"], _median_ms(s["step_time_s"]["stock"])
        lo, hi = control_range(s)
        for label in _budgets_of(s):
            rows.append([s["recipe"], label.removeprefix("keep_") + "%", s.get("kept_mib", {}).get(label),
                         _median_ms(t[label]), h.fmt_ratio(_median_ms(t[label]) / stock_ms),
                         h.fmt_ratio(_median_ms(t[label]) / _median_ms(t["keep_0"])) if "keep_0" in t else "-",
                         peak[label], h.fmt_ratio(peak[label] / peak["stock"]) if peak["stock"] else "-",
                         f"{lo:.3f}-{hi:.3f}"])
    return {"title": "Where the budget pays off", "columns": [
        "recipe", "budget", "pinned on MiB", "step ms", "time / stock", "time / 0%", "peak MiB", "peak / stock",
        "control (stock again / stock, IQR per step)"], "rows": rows,
        "note": "\n".join(f"- {verdict(s)}" for s in samples)}


def time_vs_peak(samples: list[dict]) -> dict:
    """One figure: median step time against step peak, a line per recipe
    through its budgets (0% to 100%, left to right as the kept bytes grow),
    and stock as a point of its own."""
    lines = []
    for s in samples:
        budgets = _budgets_of(s)
        span = f"{budgets[0].removeprefix('keep_')}-{budgets[-1].removeprefix('keep_')}%" if budgets else ""
        peak, t = s["step_peak_mib"], s["step_time_s"]
        lines.append({"label": f"{s['recipe']} budgets {span}", "x": [peak[b] for b in budgets],
                      "y": [_median_ms(t[b]) for b in budgets]})
        lines.append({"label": f"{s['recipe']} stock", "x": [peak["stock"]], "y": [_median_ms(t["stock"])]})
    return {"id": "time_vs_peak", "title": "step time against step peak, per recipe",
            "xlabel": "step peak over its start (MiB)", "ylabel": "median step time (ms)", "lines": lines}


def summarize(samples: list[dict], args: argparse.Namespace | None = None) -> dict:
    rows, timings = [], []
    for s in samples:
        rows += case_rows(s)
        timings += [{"case": s["case"], "variant": label.replace("_", " "),
                     "samples_ms": [1e3 * v for v in s["step_time_s"][label]]} for label in s["step_time_s"]]
    return {"rows": rows, "timings": timings, "tables": [payoff_table(samples)] if samples else [],
            "series": [time_vs_peak(samples)] if samples else []}


def main(argv: Sequence[str] | None = None) -> int:
    return gpu_main(NAME, parse(argv), argv, plan, summarize)


if __name__ == "__main__":
    sys.exit(main())
