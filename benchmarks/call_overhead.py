"""Host time a drop-in adds per module call (forward plus backward), against stock TE.

    python -m benchmarks.call_overhead [--calls 200] [--blocks 15] [--out DIR]

Tiny shapes make each call host-bound, so the difference between a drop-in
and a stock module of the same shape is the binding's Python. For each
module kind and sm_90 recipe, three modules (stock, drop-in, stock again)
run blocks of ``--calls`` forward+backward calls in turn, with CUDA
synchronisation only at block ends; drift hits all three alike. Stock blocks
run with the binding's seams taken out (``te_integration.debug.uninstall_seams``,
outside the timed region), so stock is TE's own code. Reported per
call: the median over blocks of (drop-in - stock) and, as the noise floor,
(stock again - stock). Target: at most 5 us added per call.

``GroupedLinear:8`` and ``GroupedLinear:64`` are ``GroupedLinear`` with 8
and 64 experts, 16 tokens each (TE's sm_90 FP8 split alignment). The binding
plans once per call shape, not once per expert, so its added time must not
grow with the experts: the summary gives the 64-expert added time over the
8-expert one per recipe, and the check is that it grows by at most the
larger of 1 us and the two controls' spread.

Where a call takes milliseconds (GroupedLinear with many experts) the
controls' spread can be far above a few microseconds, so each row also
counts the Python-level calls (functions and builtins, cProfile) that the
drop-in adds per call: exact on any machine. The summary gives the counted
calls the 64-expert call adds over the 8-expert one, per extra expert; the
check is that there are none.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from ._profile import profile_step
from ._stack import seams_for

TARGET_US = 5.0
RECIPES = ("DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling")
KINDS = ("Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear:8", "GroupedLinear:64")
#: Tokens per expert of the GroupedLinear cases.
TOKENS_PER_EXPERT = 16
#: The 64-expert added time may exceed the 8-expert one by at most this much (or the controls' spread).
GROWTH_US = 1.0
ORDER = ("stock", "dropin", "stock_again")


def parse_kind(kind: str) -> tuple[str, int | None]:
    """``"GroupedLinear:64"`` -> ("GroupedLinear", 64); a dense kind -> (kind, None)."""
    name, _, experts = kind.partition(":")
    if name == "GroupedLinear":
        if not experts.isdigit() or int(experts) < 1:
            raise ValueError(f"{kind!r}: give GroupedLinear its experts, e.g. GroupedLinear:8")
        return name, int(experts)
    if experts or name not in KINDS:
        raise ValueError(f"unknown module kind {kind!r}; choose from {', '.join(KINDS)} (any GroupedLinear:N)")
    return name, None


def build(kind: str, managed: bool, hidden: int) -> torch.nn.Module:
    import transformer_engine.pytorch as te

    import te_integration as ti

    torch.manual_seed(0)
    name, experts = parse_kind(kind)
    cls = getattr(ti if managed else te, name)
    if experts is not None:
        return cls(experts, hidden, hidden, bias=False, params_dtype=torch.bfloat16).cuda()
    args = (hidden, 2 * hidden) if name == "LayerNormMLP" else (hidden, hidden)
    return cls(*args, params_dtype=torch.bfloat16).cuda()


def call_args(kind: str, args: argparse.Namespace) -> tuple:
    """What each call passes: the input, and for GroupedLinear the splits."""
    _, experts = parse_kind(kind)
    tokens = args.tokens if experts is None else experts * TOKENS_PER_EXPERT
    inp = torch.randn(tokens, args.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    return (inp,) if experts is None else (inp, [TOKENS_PER_EXPERT] * experts)


def time_block(module, inputs: tuple, recipe, calls: int) -> float:
    """Seconds per call over ``calls`` forward+backward calls."""
    import transformer_engine.pytorch as te

    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        with te.autocast(enabled=True, recipe=recipe):
            out = module(*inputs)
        out.backward(torch.ones_like(out))
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls


def measure(kind: str, recipe_name: str, args: argparse.Namespace) -> dict:
    from transformer_engine.common import recipe as recipes

    recipe = getattr(recipes, recipe_name)()
    modules = {label: build(kind, label == "dropin", args.hidden) for label in ORDER}
    inputs = call_args(kind, args)
    for module in modules.values():  # warm-up: TE's first calls set up its state
        time_block(module, inputs, recipe, 20)
    per_call = {label: [] for label in ORDER}
    for block in range(args.blocks):
        # Rotate who goes first: a position in the round must not favour anyone.
        for label in ORDER[block % 3:] + ORDER[:block % 3]:
            seams_for(label == "dropin")
            per_call[label].append(time_block(modules[label], inputs, recipe, args.calls))
    added = [1e6 * (d - s) for d, s in zip(per_call["dropin"], per_call["stock"])]
    control = [1e6 * (a - s) for a, s in zip(per_call["stock_again"], per_call["stock"])]
    return {
        "kind": kind, "recipe": recipe_name,
        "stock_us": 1e6 * statistics.median(per_call["stock"]),
        "added_us": statistics.median(added), "added_us_range": [min(added), max(added)],
        "control_us": statistics.median(control), "control_us_range": [min(control), max(control)],
        "added_calls": added_calls(modules, inputs, recipe),
    }


#: Calls counted per module for ``added_calls`` (a mean, so an occasional call of TE's own
#: bookkeeping does not decide it).
COUNTED_CALLS = 10


def added_calls(modules: dict, inputs: tuple, recipe) -> float:
    """Python-level calls per forward+backward call, drop-in minus stock."""
    per_call = {}
    for label in ("stock", "dropin"):
        seams_for(label == "dropin")
        counted = profile_step(lambda m=modules[label]: time_block(m, inputs, recipe, COUNTED_CALLS))["calls"]
        per_call[label] = sum(counted.values()) / COUNTED_CALLS
    return per_call["dropin"] - per_call["stock"]


def profile(kind: str, recipe_name: str, args: argparse.Namespace) -> str:
    """Where the host time of ``--calls`` drop-in and stock calls goes: the
    top entries of a cProfile, by own time."""
    import cProfile
    import io
    import pstats

    from transformer_engine.common import recipe as recipes

    recipe = getattr(recipes, recipe_name)()
    inputs = call_args(kind, args)
    out = []
    for label in ("dropin", "stock"):
        module = build(kind, label == "dropin", args.hidden)
        seams_for(label == "dropin")
        time_block(module, inputs, recipe, 20)
        prof = cProfile.Profile()
        prof.runcall(time_block, module, inputs, recipe, args.calls)
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
        out.append(f"== {label} {kind} {recipe_name}, {args.calls} calls\n{text.getvalue()}")
    return "\n".join(out)


def skip_reason(recipe_name: str) -> str | None:
    from transformer_engine.pytorch import quantization as q

    check = q.check_fp8_block_scaling_support if recipe_name == "Float8BlockScaling" else q.check_fp8_support
    ok, reason = check()
    return None if ok else reason


def summary(rows: list[dict]) -> str:
    lines = [f"{'module':16} {'recipe':22} {'stock us/call':>13} {'added us':>9} {'control us':>11} "
             f"{'added calls':>11}  target <= {TARGET_US}"]
    for r in rows:
        verdict = "met" if r["added_us"] <= TARGET_US else f"MISSED by {r['added_us'] - TARGET_US:.1f} us"
        calls = "-" if r.get("added_calls") is None else f"{r['added_calls']:+.1f}"
        lines.append(f"{r['kind']:16} {r['recipe']:22} {r['stock_us']:13.1f} {r['added_us']:9.2f} "
                     f"{r['control_us']:11.2f} {calls:>11}  {verdict}")
    checks = expert_growth(rows)
    if checks:
        lines += ["", "GroupedLinear: added host time per call against the number of experts (must not grow)"]
        lines += [describe_growth(c) for c in checks]
    counted = call_growth(rows)
    if counted:
        lines += ["", "GroupedLinear: Python-level calls the drop-in adds per call, counted (must not grow)"]
        lines += [describe_call_growth(c) for c in counted]
    return "\n".join(lines)


def call_growth(rows: list[dict]) -> list[dict]:
    """Per recipe with GroupedLinear counted at two or more expert counts:
    the calls the drop-in adds at the most experts and at the fewest, and
    what that makes per extra expert (the check: no more than 0.5, i.e. none
    but a stray call of TE's own)."""
    by_recipe: dict[str, dict[int, dict]] = {}
    for r in rows:
        _, experts = parse_kind(r["kind"])
        if experts is not None and r.get("added_calls") is not None:
            by_recipe.setdefault(r["recipe"], {})[experts] = r
    out = []
    for recipe, by_experts in by_recipe.items():
        if len(by_experts) < 2:
            continue
        few, many = min(by_experts), max(by_experts)
        a_few, a_many = by_experts[few]["added_calls"], by_experts[many]["added_calls"]
        per_expert = (a_many - a_few) / (many - few)
        out.append({"recipe": recipe, "experts": (few, many), "added_calls": (a_few, a_many),
                    "per_expert": per_expert, "ok": per_expert <= 0.5})
    return out


def describe_call_growth(c: dict) -> str:
    (few, many), (a_few, a_many) = c["experts"], c["added_calls"]
    verdict = "met" if c["ok"] else "MISSED: the drop-in adds calls per expert"
    return (f"{c['recipe']:22} added calls {few} experts {a_few:+.1f}, {many} experts {a_many:+.1f}: "
            f"{c['per_expert']:+.2f} per extra expert: {verdict}")


def expert_growth(rows: list[dict]) -> list[dict]:
    """Per recipe with GroupedLinear at two or more expert counts: the added
    time at the most experts against the fewest, their ratio, and whether it
    grew by at most ``max(GROWTH_US, |control| at both)``."""
    by_recipe: dict[str, dict[int, dict]] = {}
    for r in rows:
        name, experts = parse_kind(r["kind"])
        if experts is not None:
            by_recipe.setdefault(r["recipe"], {})[experts] = r
    checks = []
    for recipe, by_experts in by_recipe.items():
        if len(by_experts) < 2:
            continue
        few, many = by_experts[min(by_experts)], by_experts[max(by_experts)]
        allowed = max(GROWTH_US, abs(few["control_us"]) + abs(many["control_us"]))
        growth = many["added_us"] - few["added_us"]
        checks.append({"recipe": recipe, "experts": (min(by_experts), max(by_experts)),
                       "added_us": (few["added_us"], many["added_us"]), "growth_us": growth,
                       "ratio": many["added_us"] / few["added_us"] if few["added_us"] > 0 else None,
                       "allowed_us": allowed, "ok": growth <= allowed})
    return checks


def describe_growth(c: dict) -> str:
    (few, many), (a_few, a_many) = c["experts"], c["added_us"]
    ratio = "-" if c["ratio"] is None else f"{c['ratio']:.2f}"
    verdict = "met" if c["ok"] else "MISSED: the added time grows with the experts"
    return (f"{c['recipe']:22} added {many} experts {a_many:.2f} us / {few} experts {a_few:.2f} us = ratio {ratio} "
            f"(growth {c['growth_us']:+.2f} us, allowed {c['allowed_us']:.2f} us): {verdict}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=200, help="calls per block (default 200)")
    p.add_argument("--blocks", type=int, default=15, help="blocks per module (default 15)")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--kinds", default=",".join(KINDS), help="comma-separated module kinds; GroupedLinear:N is "
                   "GroupedLinear with N experts (default: %(default)s)")
    p.add_argument("--recipes", default=",".join(RECIPES))
    p.add_argument("--profile", default=None, metavar="KIND:RECIPE",
                   help="also profile one case (e.g. Linear:Float8CurrentScaling, "
                        "GroupedLinear:64:Float8CurrentScaling) into profile.txt")
    p.add_argument("--out", type=Path, default=None, help="folder for call_overhead.json and summary.txt")
    args = p.parse_args(argv)
    try:
        for kind in args.kinds.split(","):
            parse_kind(kind)
        if args.profile:
            parse_kind(args.profile.rsplit(":", 1)[0])
    except ValueError as err:
        p.error(str(err))
    if not torch.cuda.is_available():
        print("call_overhead needs a CUDA GPU and TransformerEngine 2.20.x; nothing measured.")
        return 2
    rows, skipped = [], []
    for recipe_name in args.recipes.split(","):
        reason = skip_reason(recipe_name)
        if reason:
            skipped.append({"recipe": recipe_name, "reason": reason})
            continue
        for kind in args.kinds.split(","):
            rows.append(measure(kind, recipe_name, args))
            print(summary(rows[-1:]).splitlines()[1], flush=True)
    text = summary(rows) + "".join(f"\nskipped {s['recipe']}: {s['reason']}" for s in skipped)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "call_overhead.json").write_text(json.dumps({"config": vars(args) | {"out": str(args.out)},
                                                                 "rows": rows, "skipped": skipped,
                                                                 "expert_growth": expert_growth(rows),
                                                                 "call_growth": call_growth(rows)}, indent=1))
        (args.out / "summary.txt").write_text(text + "\n")
        if args.profile:
            (args.out / "profile.txt").write_text(profile(*args.profile.rsplit(":", 1), args))
    met = (all(r["added_us"] <= TARGET_US for r in rows) and all(c["ok"] for c in expert_growth(rows))
           and all(c["ok"] for c in call_growth(rows)))
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
