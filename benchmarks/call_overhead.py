"""Host time a drop-in adds per module call (forward plus backward), against stock TE.

    python -m benchmarks.call_overhead [--calls 200] [--blocks 15] [--out DIR]

Tiny shapes make each call host-bound, so the difference between a drop-in
and a stock module of the same shape is the binding's Python. For each
module kind and sm_90 recipe, three modules (stock, drop-in, stock again)
run blocks of ``--calls`` forward+backward calls in turn, with CUDA
synchronisation only at block ends; drift hits all three alike. Stock blocks
run with the binding's seams taken out (``te_integration.uninstall_seams``,
outside the timed region), so stock is TE's own code. Reported per
call: the median over blocks of (drop-in - stock) and, as the noise floor,
(stock again - stock). Target: at most 5 us added per call.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from ._stack import seams_for

TARGET_US = 5.0
RECIPES = ("DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling")
KINDS = ("Linear", "LayerNormLinear", "LayerNormMLP")
ORDER = ("stock", "dropin", "stock_again")


def build(kind: str, managed: bool, hidden: int) -> torch.nn.Module:
    import transformer_engine.pytorch as te

    import te_integration as ti

    torch.manual_seed(0)
    cls = getattr(ti if managed else te, kind)
    args = (hidden, 2 * hidden) if kind == "LayerNormMLP" else (hidden, hidden)
    return cls(*args, params_dtype=torch.bfloat16).cuda()


def time_block(module, inp, recipe, calls: int) -> float:
    """Seconds per call over ``calls`` forward+backward calls."""
    import transformer_engine.pytorch as te

    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        with te.autocast(enabled=True, recipe=recipe):
            out = module(inp)
        out.backward(torch.ones_like(out))
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls


def measure(kind: str, recipe_name: str, args: argparse.Namespace) -> dict:
    from transformer_engine.common import recipe as recipes

    recipe = getattr(recipes, recipe_name)()
    modules = {label: build(kind, label == "dropin", args.hidden) for label in ORDER}
    inp = torch.randn(args.tokens, args.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for module in modules.values():  # warm-up: TE's first calls set up its state
        time_block(module, inp, recipe, 20)
    per_call = {label: [] for label in ORDER}
    for block in range(args.blocks):
        # Rotate who goes first: a position in the round must not favour anyone.
        for label in ORDER[block % 3:] + ORDER[:block % 3]:
            seams_for(label == "dropin")
            per_call[label].append(time_block(modules[label], inp, recipe, args.calls))
    added = [1e6 * (d - s) for d, s in zip(per_call["dropin"], per_call["stock"])]
    control = [1e6 * (a - s) for a, s in zip(per_call["stock_again"], per_call["stock"])]
    return {
        "kind": kind, "recipe": recipe_name,
        "stock_us": 1e6 * statistics.median(per_call["stock"]),
        "added_us": statistics.median(added), "added_us_range": [min(added), max(added)],
        "control_us": statistics.median(control), "control_us_range": [min(control), max(control)],
    }


def profile(kind: str, recipe_name: str, args: argparse.Namespace) -> str:
    """Where the host time of ``--calls`` drop-in and stock calls goes: the
    top entries of a cProfile, by own time."""
    import cProfile
    import io
    import pstats

    from transformer_engine.common import recipe as recipes

    recipe = getattr(recipes, recipe_name)()
    inp = torch.randn(args.tokens, args.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = []
    for label in ("dropin", "stock"):
        module = build(kind, label == "dropin", args.hidden)
        seams_for(label == "dropin")
        time_block(module, inp, recipe, 20)
        prof = cProfile.Profile()
        prof.runcall(time_block, module, inp, recipe, args.calls)
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
    lines = [f"{'module':16} {'recipe':22} {'stock us/call':>13} {'added us':>9} {'control us':>11}  target <= {TARGET_US}"]
    for r in rows:
        verdict = "met" if r["added_us"] <= TARGET_US else f"MISSED by {r['added_us'] - TARGET_US:.1f} us"
        lines.append(f"{r['kind']:16} {r['recipe']:22} {r['stock_us']:13.1f} {r['added_us']:9.2f} "
                     f"{r['control_us']:11.2f}  {verdict}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=200, help="calls per block (default 200)")
    p.add_argument("--blocks", type=int, default=15, help="blocks per module (default 15)")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--recipes", default=",".join(RECIPES))
    p.add_argument("--profile", default=None, metavar="KIND:RECIPE",
                   help="also profile one case (e.g. Linear:Float8CurrentScaling) into profile.txt")
    p.add_argument("--out", type=Path, default=None, help="folder for call_overhead.json and summary.txt")
    args = p.parse_args(argv)
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
                                                                 "rows": rows, "skipped": skipped}, indent=1))
        (args.out / "summary.txt").write_text(text + "\n")
        if args.profile:
            (args.out / "profile.txt").write_text(profile(*args.profile.split(":"), args))
    return 0 if all(r["added_us"] <= TARGET_US for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
