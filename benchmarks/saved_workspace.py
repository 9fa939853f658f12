"""Unsharded training: memory held from forward to backward, peak and step
time, drop-in and LeanWorkspacePolicy against stock TE and bf16 (D11).

    python -m benchmarks.saved_workspace [--quick] [--out DIR]

Unsharded training saves each weight's workspace for backward. Stock TE keeps
it with rowwise and columnwise data (2 bytes per parameter under per-tensor
FP8), though dgrad reads only the columnwise data; the drop-ins keep what the
plan's ``backward_usage`` names (docs/decisions.md, D11). A third model pins
``LeanWorkspacePolicy``: no copy is kept from forward to backward, and
backward quantizes each weight again (one extra quantization per weight per
step). A fourth, stock again, is the control of the step time.

Three stacks, bf16 weights, one GPU, no FSDP: 8 x Linear(4096, 4096) at 2048
tokens, 8 x TransformerLayer(2048, 8192, 16 heads) at seq 1024 and batch 2,
and 8 x TransformerLayer(4096, 16384, 32 heads) at seq 1024 and batch 2 (the
same tokens; about 25 GiB for its four models, so it fits an 80 GiB GPU easily).
Per stack, the bf16 row (no FP8) is the baseline, then each sm_90 recipe.
The four models of a row are built from one seed and alive together. Memory
steps, one model at a time: memory held at the end of forward (over the
step's start), the step's peak (over its start), and outputs and gradients
compared bit for bit with stock. Then timed steps, the models taking turns
step by step (forward and backward between two synchronizations; no
optimizer): the median per model. Target: the drop-in holds, at the end of
forward and at peak, at least 1 byte per parameter less than stock (D11).
The lean model has no target; the summary says plainly whether it holds
less than bf16 and what it costs in step time.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from . import _harness as h
from ._runner import save
from ._stack import seams_for

NAME = "saved_workspace"
MIB = 2**20
RECIPES = ("DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling")
VARIANTS = ("stock", "dropin", "lean", "stock_again")
#: The variants that are stock TE (also the bf16 row's models).
STOCK_LABELS = ("stock", "stock_again")


@dataclass(frozen=True)
class Stack:
    """A stack of identical layers and its input: (seq, hidden) for Linear
    (``seq`` tokens), (seq, batch, hidden) for TransformerLayer."""

    name: str
    layer: str  # "linear" or "transformer"
    hidden: int
    ffn: int = 0
    heads: int = 0
    seq: int = 1024
    batch: int = 2
    layers: int = 8


STACKS = {
    "linear": Stack("linear", "linear", 4096, seq=2048, batch=1),
    "transformer": Stack("transformer", "transformer", 2048, 8192, 16),
    "transformer_4096": Stack("transformer_4096", "transformer", 4096, 16384, 32),
}


def build(stack: Stack, variant: str) -> torch.nn.Module:
    import transformer_engine.pytorch as te

    import te_integration as ti

    torch.manual_seed(0)
    kw = dict(params_dtype=torch.bfloat16, device="cuda")
    if stack.layer == "linear":
        layers = [te.Linear(stack.hidden, stack.hidden, bias=False, **kw) for _ in range(stack.layers)]
    else:
        layers = [te.TransformerLayer(stack.hidden, stack.ffn, stack.heads, hidden_dropout=0.0,
                                      attention_dropout=0.0, **kw) for _ in range(stack.layers)]
    model = torch.nn.Sequential(*layers)
    if variant.startswith("stock"):
        return model
    from workspace_manager import LeanWorkspacePolicy

    return ti.convert_model(model, policy=LeanWorkspacePolicy() if variant == "lean" else None)


def inputs(stack: Stack, step: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(step)
    shape = (stack.seq, stack.hidden) if stack.layer == "linear" else (stack.seq, stack.batch, stack.hidden)
    return torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g)


def forward_backward(model, x: torch.Tensor, recipe) -> torch.Tensor:
    import transformer_engine.pytorch as te

    with te.autocast(enabled=recipe is not None, recipe=recipe):
        out = model(x)
    out.float().pow(2).mean().backward()
    return out


def memory_step(model, stack: Stack, recipe, n: int) -> dict:
    """One training step; memory over its start at the end of forward and
    at peak. The gradients stay on the parameters for the caller to compare."""
    import transformer_engine.pytorch as te

    x = inputs(stack, n)
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with te.autocast(enabled=recipe is not None, recipe=recipe):
        out = model(x)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - start
    out.float().pow(2).mean().backward()
    torch.cuda.synchronize()
    return {"held": held, "peak": torch.cuda.max_memory_allocated() - start, "out": out.detach()}


def _drop_grads(model) -> None:
    for p in model.parameters():
        p.grad = None


def compare_steps(models: dict, stack: Stack, recipe, steps: int) -> tuple[dict, dict]:
    """``steps`` memory steps per model, model by model within a step;
    (memory of each model's last step, {variant: outputs and gradients
    equal to stock's at every step})."""
    same = {label: True for label in models if label != "stock"}
    last: dict[str, dict] = {}
    for n in range(steps):
        ref = memory_step(models["stock"], stack, recipe, n)
        ref_grads = [p.grad.detach().clone() for p in models["stock"].parameters()]
        _drop_grads(models["stock"])
        last["stock"] = ref
        for label in same:
            run = memory_step(models[label], stack, recipe, n)
            grads = [p.grad for p in models[label].parameters()]
            same[label] &= torch.equal(ref["out"], run["out"]) and all(map(torch.equal, ref_grads, grads))
            _drop_grads(models[label])
            last[label] = run
        del ref_grads
    return {label: {k: r[k] for k in ("held", "peak")} for label, r in last.items()}, same


def timed_steps(models: dict, stack: Stack, recipe, warmup: int, timed: int) -> dict[str, list[float]]:
    """The models take turns, one forward and backward each, so drift hits
    them alike (the first of a round changes from round to round); each step
    between two synchronizations (input made before)."""
    times: dict[str, list[float]] = {label: [] for label in models}
    try:
        return _turns(models, stack, recipe, warmup, timed, times)
    finally:
        seams_for(True)


def _turns(models: dict, stack: Stack, recipe, warmup: int, timed: int, times: dict) -> dict[str, list[float]]:
    for n in range(warmup + timed):
        x = inputs(stack, 1_000 + n)
        labels = list(models)  # who goes first changes from round to round
        for label in labels[n % len(labels):] + labels[:n % len(labels)]:
            model = models[label]
            seams_for(label not in STOCK_LABELS)  # stock steps run TE's own code
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            forward_backward(model, x, recipe)
            torch.cuda.synchronize()
            if n >= warmup:
                times[label].append(time.perf_counter() - t0)
            _drop_grads(model)
    return times


def measure(stack: Stack, recipe_name: str | None, args: argparse.Namespace) -> dict:
    from transformer_engine.common import recipe as recipes

    recipe = getattr(recipes, recipe_name)() if recipe_name else None
    models = {label: build(stack, label) for label in VARIANTS}
    try:
        params = sum(p.numel() for p in models["stock"].parameters())
        memory, same = compare_steps(models, stack, recipe, args.steps)
        times = timed_steps(models, stack, recipe, args.warmup, args.timed)
    finally:
        del models
        gc.collect()
        torch.cuda.empty_cache()
    row = {"stack": stack.name, "recipe": recipe_name or "bf16", "params": params, "identical": same["dropin"],
           "lean_identical": same["lean"], "control_identical": same["stock_again"], "step_times_s": times}
    for label in VARIANTS:
        row[f"{label}_held_mib"] = memory[label]["held"] / MIB
        row[f"{label}_peak_mib"] = memory[label]["peak"] / MIB
        row[f"{label}_step_ms"] = 1e3 * statistics.median(times[label])
    return row


# -- summary (pure) -----------------------------------------------------------------
def verdict(row: dict) -> str:
    """D11's target for the drop-in: at least 1 byte per parameter less than
    stock, held at the end of forward and at peak."""
    if row["recipe"] == "bf16":
        return "baseline"
    need = row["params"] / MIB  # 1 byte per parameter, in MiB
    ok = (row["stock_held_mib"] - row["dropin_held_mib"] >= need * 0.99
          and row["stock_peak_mib"] - row["dropin_peak_mib"] >= need * 0.99)
    return "met" if ok else f"MISSED (target: {need:.0f} MiB less)"


def _ratio(row: dict, label: str) -> float:
    return row[f"{label}_step_ms"] / row["stock_step_ms"]


def lean_sentence(row: dict, bf16: dict | None) -> str:
    """Plainly: does the lean model hold less than bf16 training, and at what step time."""
    where = f"{row['stack']} {row['recipe']}"
    cost = (f"step time lean/stock {_ratio(row, 'lean'):.3f}, drop-in/stock {_ratio(row, 'dropin'):.3f} "
            f"(control stock again/stock {_ratio(row, 'stock_again'):.3f})")
    if bf16 is None:
        return f"{where}: no bf16 row to compare with; {cost}."
    less = row["lean_held_mib"] < bf16["stock_held_mib"]
    held = (f"lean holds {row['lean_held_mib']:.1f} MiB from forward to backward against bf16's "
            f"{bf16['stock_held_mib']:.1f} (stock {row['stock_held_mib']:.1f})")
    unsafe = ""
    if row["recipe"] == "DelayedScaling":
        unsafe = " (lean plans delayed scaling as plain: requantizing is not exact)"
    return f"{where}: {'LESS' if less else 'NOT less'} than bf16{unsafe}: {held}; {cost}."


def summary(rows: list[dict]) -> str:
    lines = [f"{'stack':16} {'recipe':20} {'held stock':>10} {'held ours':>9} {'held lean':>9} {'peak stock':>10} "
             f"{'peak ours':>9} {'peak lean':>9} {'ms stock':>8} {'ms ours':>8} {'ms lean':>8} {'ms ctrl':>8} "
             f"{'B/param':>7}  identical(ours,lean)  target"]
    for r in rows:
        saving = (r["stock_held_mib"] - r["dropin_held_mib"]) * MIB / r["params"]
        same = f"{'yes' if r['identical'] else 'NO'},{'yes' if r['lean_identical'] else 'NO'}"
        lines.append(f"{r['stack']:16} {r['recipe']:20} {r['stock_held_mib']:10.1f} {r['dropin_held_mib']:9.1f} "
                     f"{r['lean_held_mib']:9.1f} {r['stock_peak_mib']:10.1f} {r['dropin_peak_mib']:9.1f} "
                     f"{r['lean_peak_mib']:9.1f} {r['stock_step_ms']:8.2f} {r['dropin_step_ms']:8.2f} "
                     f"{r['lean_step_ms']:8.2f} {r['stock_again_step_ms']:8.2f} {saving:7.3f}  {same:20}  "
                     f"{verdict(r)}")
    baselines = {r["stack"]: r for r in rows if r["recipe"] == "bf16"}
    sentences = [lean_sentence(r, baselines.get(r["stack"])) for r in rows if r["recipe"] != "bf16"]
    return "\n".join(lines + ([""] + sentences if sentences else []))


def target_rows(rows: list[dict]) -> list[dict]:
    """D11's targets per stack and recipe, as result rows: outputs and
    gradients identical to stock's (drop-in and lean), and the drop-in
    holding at least 1 byte per parameter less than stock, at the end of
    forward and at peak."""
    out = []
    for r in (r for r in rows if r["recipe"] != "bf16"):
        case, need = f"{r['stack']} {r['recipe']}", 0.99 * r["params"] / MIB
        out += [h.check_row(case, "outputs and gradients identical to stock: drop-in", r["identical"], "every step"),
                h.check_row(case, "outputs and gradients identical to stock: lean", r["lean_identical"], "every step")]
        for what in ("held", "peak"):
            stock = r[f"stock_{what}_mib"]
            out.append(h.bound_row(case, f"{what} from the end of forward, drop-in" if what == "held" else
                                   "peak over the step's start, drop-in", "MiB", r[f"dropin_{what}_mib"],
                                   stock - need, f"<= stock - 1 B/param ({stock - need:.1f})", stock=stock,
                                   note=f"lean {r[f'lean_{what}_mib']:.1f}"))
    return out


def parser() -> argparse.ArgumentParser:
    p = h.base_parser(NAME, __doc__)
    p.add_argument("--steps", type=int, default=3, help="memory and comparison steps per model (default 3)")
    p.add_argument("--timed", type=int, default=None, help="timed steps per model (default 20, --quick 5)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per model before the timed ones")
    p.add_argument("--stacks", default=None, help=f"comma-separated, from {', '.join(STACKS)} (default: all; "
                   "--quick: transformer)")
    return p


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser()
    args = h.parse_args(p, argv, {})
    args.stacks = (args.stacks or ("transformer" if args.quick else ",".join(STACKS))).split(",")
    args.timed = args.timed if args.timed is not None else (5 if args.quick else 20)
    unknown = [s for s in args.stacks if s not in STACKS]
    if unknown:
        p.error(f"unknown stack(s) {', '.join(unknown)}; choose from {', '.join(STACKS)}")
    if args.steps < 1 or args.timed < 1 or args.warmup < 0:
        p.error("--steps and --timed must be >= 1, --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if not torch.cuda.is_available():
        print("saved_workspace needs a CUDA GPU and TransformerEngine 2.20.x; nothing measured.")
        return 2
    from transformer_engine.pytorch import quantization as q

    result, start = h.new_result(NAME, h.config_of(args)), time.perf_counter()
    rows = []
    for name in args.stacks:
        for recipe_name in (None, *RECIPES):
            check = q.check_fp8_block_scaling_support if recipe_name == "Float8BlockScaling" else q.check_fp8_support
            if recipe_name and not check()[0]:
                result["skipped"].append({"what": f"{name} {recipe_name}", "why": check()[1]})
                continue
            rows.append(measure(STACKS[name], recipe_name, args))
            if not args.quiet:
                print(summary(rows[-1:]).splitlines()[1], flush=True)
    result.update(samples=rows, rows=target_rows(rows), text=summary(rows), wall_s=round(time.perf_counter() - start, 1))
    save(result, args.out, args.tag)
    print(result["text"])
    ok = all(r["identical"] and r["lean_identical"] and verdict(r) in ("met", "baseline") for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
