"""FSDP2 memory and step time of TE's fusible ops (issue 28): stock te.ops
vs drop-in vs bf16, with the ``te.Linear`` stack for reference.

    torchrun --nproc_per_node=<GPUs> -m benchmarks.ops_memory [--quick]

Models (``testbed.ops_model``), every block and the root ``fully_shard``-ed,
``--tokens`` tokens per step: ``ops_stack``, ``--layers`` blocks of
``te.ops.Linear(hidden, hidden, bias=False, dtype=bf16)``; ``ops_mlp``, blocks
of a ``te.ops.Sequential`` MLP (LayerNorm, Linear + bias, GELU, Linear +
bias, ffn = 4 x hidden); ``linear_stack``, the ops stack built from
``te.Linear``, stock. Per recipe and weight kind one job measures, one after
the other, a second stock model as the step-time control, stock, drop-in
and, once per model, bf16 (``testbed.ops_measure``): the per-block forward
rise, the memory a block's own forward keeps (FSDP2's all-gather left
out: it frees what a quantized parameter kept from the step before), peak
over what was allocated before the model, memory held after the step,
losses, step times. Targets: the drop-in ops stack's per-block rise, and
its kept memory, at most the te.Linear stack's; peak and memory after the
step at most stock's; losses identical to stock's (DelayedScaling:
reported, docs/decisions.md "te.ops"); median step time within 1% of stock's.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from . import _harness as h
from ._runner import Job, gpu_main, print_plan

NAME = "ops_memory"
MODELS = ("ops_stack", "ops_mlp")
DEFAULTS = {
    "recipes": (list(h.RECIPES), list(h.RECIPES)),
    "inits": (list(h.INITS), ["bf16"]),
    "steps": (12, 3),
    "warmup": (3, 1),
    "layers": (8, 2),
}
HIDDEN, TOKENS = 2048, 4096
MIB = 2**20


def parser() -> argparse.ArgumentParser:
    p = h.base_parser(NAME, __doc__)
    p.add_argument("--recipes", type=h.csv_choices(h.RECIPES), help=f"comma-separated, from {', '.join(h.RECIPES)}")
    p.add_argument("--inits", type=h.csv_choices(h.INITS), help="bf16 (bf16 params), qinit (quantized_model_init)")
    p.add_argument("--steps", type=h.positive_int, help="timed steps per model, after warm-up")
    p.add_argument("--warmup", type=int, help="untimed warm-up steps per model")
    p.add_argument("--layers", type=h.positive_int, help="blocks of the ops stack (the MLP has half as many)")
    p.add_argument("--time-budget", type=float, default=None, metavar="SECONDS")
    p.add_argument("--dry-run", action="store_true", help="print the planned configurations and exit")
    return p


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    args = h.parse_args(parser(), argv, DEFAULTS)
    args.prime = False  # each job warms its own models up
    return args


def _builder(model: str, layers: int):
    from testbed.ops_model import build_linear_stack, build_ops_mlp, build_ops_stack

    if model == "ops_stack":
        return lambda **kw: build_ops_stack(HIDDEN, layers, **kw)
    if model == "ops_mlp":
        return lambda **kw: build_ops_mlp(HIDDEN, 4 * HIDDEN, max(1, layers // 2), **kw)
    return lambda **kw: build_linear_stack(HIDDEN, layers, **kw)


def measure_variant(model: str, layers: int, variant: str, recipe_name: str, init: str, args) -> dict:
    """One model's figures (``variant``: stock, control, dropin, bf16)."""
    from testbed.model import allocated, release_memory
    from testbed.ops_measure import measure_ops
    from testbed.recipes import make_recipe

    recipe = None if variant == "bf16" else make_recipe(recipe_name)
    release_memory()
    baseline = allocated()
    built = _builder(model, layers)(managed=variant == "dropin", recipe=recipe,
                                    quantized_init=init == "qinit" and recipe is not None)
    got = measure_ops(built, recipe, steps=args.warmup + args.steps, warmup=args.warmup, tokens=TOKENS,
                      hidden=HIDDEN, baseline=baseline)
    del built
    release_memory()
    return {"rise_mib": got["rise_per_block"] / MIB, "kept_mib": got["kept_per_block"] / MIB,
            "after_step_mib": got["held_after_step"] / MIB, "peak_mib": got["peak"] / MIB,
            "losses": got["losses"], "step_time_s": got["step_times"]}


def plan(args: argparse.Namespace, dist, world: int, total_gib: float) -> list[Job]:
    jobs = []
    # The te.Linear reference right after the ops stack it is compared with,
    # so that a time budget cut leaves the MLP out rather than the reference.
    for model in (MODELS[0], "linear_stack", *MODELS[1:]):
        variants = ("stock",) if model == "linear_stack" else ("control", "stock", "dropin")
        for recipe in args.recipes:
            for init in args.inits:
                meta = {"model": model, "recipe": recipe, "init": init, "layers": args.layers, "world": world}

                def run(model=model, recipe=recipe, init=init, variants=variants):
                    return {v: measure_variant(model, args.layers, v, recipe, init, args) for v in variants}

                jobs.append(Job(f"{model} {recipe} {init}", meta, run, estimate_s=20.0 * len(variants)))
        if model != "linear_stack":
            meta = {"model": model, "recipe": "bf16", "init": "bf16", "layers": args.layers, "world": world}
            jobs.append(Job(f"{model} bf16", meta,
                            lambda model=model: {"bf16": measure_variant(model, args.layers, "bf16", "", "bf16",
                                                                         args)}, estimate_s=20.0))
    return jobs


def _rows(s: dict, reference: dict | None, bf16: dict | None) -> list[dict]:
    case = f"{s['model']} {s['layers']}L {s['recipe']} {h.INIT_LABELS[s['init']]}"
    st, dr, ctl = s["stock"], s["dropin"], s["control"]
    same = st["losses"] == dr["losses"]
    delayed = s["recipe"] == "DelayedScaling"
    rows = [h.check_row(case, "losses identical to stock", same or delayed,
                        "bit for bit" if same else f"stock {st['losses']} drop-in {dr['losses']}"
                        + (" (DelayedScaling: requantized with backward's scale, as te.Linear)" if delayed else ""))]
    rows.append(h.ratio_row(case, "forward rise per block", "MiB", st["rise_mib"], dr["rise_mib"], limit=None,
                            bf16=(bf16 or {}).get("rise_mib")))
    if reference is not None:
        ref = reference["rise_mib"]
        rows.append(h.bound_row(case, "forward rise per block vs te.Linear stack", "MiB", dr["rise_mib"],
                                ref, f"<= te.Linear stack's ({ref:.2f})", stock=st["rise_mib"]))
        if "kept_mib" in reference:
            ref = reference["kept_mib"]
            rows.append(h.bound_row(case, "kept per block, FSDP2's all-gather left out, vs te.Linear stack", "MiB",
                                    dr["kept_mib"], ref, f"<= te.Linear stack's ({ref:.2f})", stock=st["kept_mib"]))
    rows.append(h.ratio_row(case, "peak allocated over baseline", "MiB", st["peak_mib"], dr["peak_mib"],
                            bf16=(bf16 or {}).get("peak_mib")))
    if "after_step_mib" in st:
        rows.append(h.ratio_row(case, "held after the step over baseline", "MiB", st["after_step_mib"],
                                dr["after_step_mib"], limit=1.0, bf16=(bf16 or {}).get("after_step_mib")))
    rows.append(h.time_row(case, st["step_time_s"], dr["step_time_s"]))
    control = h.time_row(case + " (control: stock vs stock)", ctl["step_time_s"], st["step_time_s"])
    control["target"], control["ok"] = "", None  # the noise floor, reported
    return rows + [control]


def summarize(samples: list[dict], args: argparse.Namespace | None = None) -> dict:
    refs = {(s["recipe"], s["init"]): s["stock"] for s in samples if s["model"] == "linear_stack"}
    bf16 = {s["model"]: s["bf16"] for s in samples if "bf16" in s}
    rows, timings = [], []
    for s in samples:
        if "dropin" not in s:
            continue
        ref = refs.get((s["recipe"], s["init"])) if s["model"] == "ops_stack" else None
        rows += _rows(s, ref, bf16.get(s["model"]))
        case = f"{s['model']} {s['recipe']} {s['init']}"
        timings += [{"case": case, "variant": v, "samples_ms": [1e3 * t for t in s[v]["step_time_s"]]}
                    for v in ("control", "stock", "dropin")]
    return {"rows": rows, "timings": timings}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    if args.dry_run:
        return print_plan(plan, args)
    return gpu_main(NAME, args, argv, plan, summarize)


if __name__ == "__main__":
    sys.exit(main())
