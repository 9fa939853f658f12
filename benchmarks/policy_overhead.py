"""Policy overhead on CPU: what the drop-in modules pay per weight and call
to choose a policy and plan, in nanoseconds, against a no-op baseline.

    python -m benchmarks.policy_overhead [--quick]

Over a fixed set of contexts (every sm_90 and sm_100 recipe profile x
sharding x weight source x microbatch position x recompute pass), each case
is called ``--rounds`` times per context, ``--repeats`` times; the figure is
the median time per call over the repeats, with its spread:

- ``no-op``: a function that returns its argument (the loop and call cost);
- ``select_policy(ctx).plan(ctx)``;
- ``resolve_policy(ctx).plan(ctx)``: nothing pinned;
- the binding's path per weight: a plan memoized per call shape, found by
  one dictionary lookup with a tuple key (``ModuleWorkspaceState.levers``,
  less reading the call's values; a miss builds the context and calls
  ``plan_call``);
- ``attribution off``: the check each seam makes while workspace recording
  is off (against the no-op, it is what recording costs when not used).

Each forward of a ``te.TransformerLayer`` plans 4 weights (QKV, projection,
FC1, FC2); per step that is 4 x layers x microbatches calls (twice that
with recompute). Contexts with and without a recompute pass are timed
apart: a recompute policy also plans the plain call, so it costs more.
Needs neither CUDA nor TransformerEngine.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from . import _harness as h
from ._runner import save

NAME = "policy_overhead"
DEFAULTS = {"rounds": (10, 3), "repeats": (15, 5)}
WEIGHTS_PER_LAYER = 4
STEP_SHAPES = {"leak 8 layers": 8, "realistic 41 layers": 41}


def parser() -> argparse.ArgumentParser:
    p = h.base_parser(NAME, __doc__)
    p.add_argument("--rounds", type=h.positive_int, help="calls per context in one timed repeat")
    p.add_argument("--repeats", type=h.positive_int, help="timed repeats (the median is reported)")
    return p


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    return h.parse_args(parser(), argv, DEFAULTS)


def contexts() -> list:
    """Every context of the fixed set that plans without error."""
    from workspace_manager import (RECIPE_PROFILES, Microbatch, RecomputePass, Sharding, WeightSource,
                                   WorkspaceContext, WorkspaceManagerError, select_policy)

    out = []
    shardings = (Sharding.NONE, Sharding.FSDP2_RESHARD, Sharding.FSDP2_KEEP)
    for caps, sharding, weight, micro, rpass in itertools.product(
            RECIPE_PROFILES.values(), shardings, WeightSource, Microbatch, RecomputePass):
        ctx = WorkspaceContext(capabilities=caps, sharding=sharding, weight=weight, microbatch=micro, recompute=rpass)
        try:
            select_policy(ctx).plan(ctx)
        except WorkspaceManagerError:
            continue
        out.append(ctx)
    return out


def cases(ctxs: list) -> dict[str, tuple[Callable[[Any], Any], list]]:
    """name -> (function of one item, items)."""
    from workspace_manager import BackwardOverride, Microbatch, plan_call, resolve_policy, select_policy
    from workspace_manager.attribution import WorkspaceLedger

    def noop(item):
        return item

    # The binding's memo: the call's values as TE hands them over (a tuple
    # that hashes in C, as the binding's key does) -> its plan.
    first = {Microbatch.NONE: None, Microbatch.FIRST: True, Microbatch.LATER: False}
    shapes = [("weight", ctx.capabilities.name, ctx.is_quantized_param, ctx.grad_enabled, ctx.input_requires_grad,
               first[ctx.microbatch], None if ctx.backward_override is BackwardOverride.NONE
               else ctx.backward_override.value, ctx.recompute, ctx.recompute_scope, ctx.sharding) for ctx in ctxs]
    plans = dict(zip(shapes, (plan_call(ctx) for ctx in ctxs)))

    def binding_path(shape):
        # What ModuleWorkspaceState.levers runs per weight once the call's
        # shape was planned: one lookup by a tuple key.
        return plans[shape]

    ledger = WorkspaceLedger()  # recording off, as by default

    def attribution_off(item):
        # What each seam call adds while recording is off (issue 6).
        if ledger.enabled:
            raise AssertionError("recording is on")
        return item

    return {
        "no-op": (noop, ctxs),
        "select_policy(ctx).plan(ctx)": (lambda ctx: select_policy(ctx).plan(ctx), ctxs),
        "resolve_policy(ctx).plan(ctx)": (lambda ctx: resolve_policy(ctx).plan(ctx), ctxs),
        "binding path: plan memoized per call shape (a tuple key)": (binding_path, shapes),
        "attribution off: the seams' check per call": (attribution_off, ctxs),
    }


def per_call_ns(fn: Callable[[Any], Any], items: list, rounds: int, repeats: int) -> list[float]:
    """Nanoseconds per call, one figure per repeat (garbage collection off
    while timing; one untimed pass first)."""
    for item in items:
        fn(item)
    samples = []
    enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(repeats):
            t0 = time.perf_counter_ns()
            for _ in range(rounds):
                for item in items:
                    fn(item)
            samples.append((time.perf_counter_ns() - t0) / (rounds * len(items)))
    finally:
        if enabled:
            gc.enable()
    return samples


def context_sets(ctxs: list) -> dict[str, list]:
    """The contexts split by recompute pass: a recompute policy plans the
    plain call too, so its calls cost more."""
    from workspace_manager import RecomputePass

    return {"no recompute": [c for c in ctxs if c.recompute is RecomputePass.NONE],
            "recompute passes": [c for c in ctxs if c.recompute is not RecomputePass.NONE]}


def summarize(samples: list[dict]) -> dict:
    """A table per context set: median, IQR, min and max ns per call, less
    the no-op, and what that adds per training step."""
    rows = []
    for group in dict.fromkeys(s["contexts"] for s in samples):
        mine = [s for s in samples if s["contexts"] == group]
        base = next(h.spread(s["ns_per_call"])["median"] for s in mine if s["case"] == "no-op")
        factor = WEIGHTS_PER_LAYER * (2 if group == "recompute passes" else 1)
        for s in mine:
            st = h.spread(s["ns_per_call"])
            net = st["median"] - base if s["case"] != "no-op" else 0.0
            rows.append([s["case"], group, s["n_contexts"], f"{st['median']:.0f}", f"{st['q1']:.0f}-{st['q3']:.0f}",
                         f"{st['min']:.0f}", f"{st['max']:.0f}", f"{net:.0f}",
                         *[f"{net * factor * layers / 1e3:.1f}" for layers in STEP_SHAPES.values()]])
    columns = ["case", "contexts", "n", "median ns/call", "IQR ns", "min ns", "max ns", "minus no-op ns",
               *[f"us per step, {shape}" for shape in STEP_SHAPES]]
    return {"tables": [{"title": "Policy selection and planning per call (CPU)", "columns": columns, "rows": rows,
                        "note": f"Per step: (median - no-op) x {WEIGHTS_PER_LAYER} weights x layers, one "
                                "microbatch (x2 for recompute: the first pass and the recompute pass each plan)."}]}


def run(args: argparse.Namespace) -> dict:
    t0 = time.perf_counter()
    sets = context_sets(contexts())
    result = h.new_result(NAME, h.config_of(args, contexts={k: len(v) for k, v in sets.items()}))
    plan = [(group, name, fn, items) for group, ctxs in sets.items() for name, (fn, items) in cases(ctxs).items()]
    progress = h.Progress(len(plan), enabled=not args.quiet)
    for group, name, fn, items in plan:
        progress.start(f"{name} [{group}]")
        values = per_call_ns(fn, items, args.rounds, args.repeats)
        result["samples"].append({"case": name, "contexts": group, "n_contexts": len(items), "ns_per_call": values})
        progress.done(f"(median {h.spread(values)['median']:.0f} ns/call)")
    result.update(summarize(result["samples"]))
    result["wall_s"] = round(time.perf_counter() - t0, 2)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    save(run(args), args.out, args.tag)
    return 0


if __name__ == "__main__":
    sys.exit(main())
