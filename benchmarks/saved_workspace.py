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
less than bf16 and what it costs in step time. It ends with a breakdown of
what the second layer keeps for backward, tensor by tensor, from a
saved-tensor hook: the lean model against bf16, and Block against current
scaling (``_saved_tensors``).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from . import _saved_tensors
from ._stack import seams_for

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
    them alike; each step between two synchronizations (input made before)."""
    times: dict[str, list[float]] = {label: [] for label in models}
    try:
        return _turns(models, stack, recipe, warmup, timed, times)
    finally:
        seams_for(True)


def _turns(models: dict, stack: Stack, recipe, warmup: int, timed: int, times: dict) -> dict[str, list[float]]:
    for n in range(warmup + timed):
        x = inputs(stack, 1_000 + n)
        for label, model in models.items():
            seams_for(label not in STOCK_LABELS)  # stock steps run TE's own code
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            forward_backward(model, x, recipe)
            torch.cuda.synchronize()
            if n >= warmup:
                times[label].append(time.perf_counter() - t0)
            _drop_grads(model)
    return times


def layer_saved(model, stack: Stack, recipe) -> _saved_tensors.Table:
    """What the second layer keeps for backward in one step, tensor by
    tensor: the first one's input needs no gradient, so a Linear there
    computes no dgrad and keeps less than the others. A TransformerLayer
    stack runs at batch 1 here, so that no activation has a weight's shape
    (seq x batch tokens equal the hidden size in the 2048 stack)."""
    small = replace(stack, batch=1) if stack.layer == "transformer" else stack
    x = inputs(small, 0)
    try:
        return _saved_tensors.record_saved(model[1], lambda: forward_backward(model, x, recipe))
    finally:
        _drop_grads(model)


def breakdown(models: dict, stack: Stack, recipe) -> dict:
    """{variant: the second layer's table}, or {"error": ...}: the breakdown explains
    the memory figures and must not cost them."""
    try:
        return {label: layer_saved(models[label], stack, recipe)
                for label in (("stock",) if recipe is None else ("stock", "dropin", "lean"))}
    except Exception as err:  # noqa: BLE001  (reported in the summary)
        print(f"breakdown not measured for {stack.name}: {type(err).__name__}: {err}", flush=True)
        return {"error": f"{type(err).__name__}: {err}"}


def measure(stack: Stack, recipe_name: str | None, args: argparse.Namespace) -> dict:
    from transformer_engine.common import recipe as recipes

    recipe = getattr(recipes, recipe_name)() if recipe_name else None
    models = {label: build(stack, label) for label in VARIANTS}
    try:
        params = sum(p.numel() for p in models["stock"].parameters())
        memory, same = compare_steps(models, stack, recipe, args.steps)
        saved = breakdown(models, stack, recipe)
        times = timed_steps(models, stack, recipe, args.warmup, args.timed)
    finally:
        del models
        gc.collect()
        torch.cuda.empty_cache()
    row = {"stack": stack.name, "recipe": recipe_name or "bf16", "params": params, "identical": same["dropin"],
           "lean_identical": same["lean"], "control_identical": same["stock_again"], "step_times_s": times,
           "layer_saved": saved}
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


def breakdown_lines(rows: list[dict]) -> list[str]:
    """Where the lean model's second layer keeps more than bf16 training's,
    and how Block scaling's differs from current scaling's, tensor by tensor."""
    found = {(r["stack"], r["recipe"]): r["layer_saved"] for r in rows if "layer_saved" in r}
    if not found:
        return []
    lines = ["", "What the second layer keeps for backward in one step, from a saved-tensor hook (the TransformerLayer "
             "stacks at batch 1; parameters left out):"]
    lines += [f"{stack} {recipe}: not measured, {tables['error']}" for (stack, recipe), tables in found.items()
              if "error" in tables]
    saved = {key: tables for key, tables in found.items() if "error" not in tables}
    for (stack, recipe), tables in saved.items():
        base = saved.get((stack, "bf16"))
        if recipe != "bf16" and base is not None:
            lines += _saved_tensors.describe("lean", tables["lean"], "bf16", base["stock"], limit=6,
                                             heading=f"{stack} {recipe}, ")
    for stack in dict.fromkeys(r["stack"] for r in rows):
        block, current = saved.get((stack, "Float8BlockScaling")), saved.get((stack, "Float8CurrentScaling"))
        for label in ("stock", "lean") if block and current else ():
            lines += _saved_tensors.describe(f"Block scaling {label}", block[label], f"current scaling {label}",
                                             current[label], limit=8, heading=f"{stack}, ")
    return lines


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
    return "\n".join(lines + ([""] + sentences if sentences else []) + breakdown_lines(rows))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.saved_workspace", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the 2048 transformer stack only, 5 timed steps")
    p.add_argument("--steps", type=int, default=3, help="memory and comparison steps per model (default 3)")
    p.add_argument("--timed", type=int, default=None, help="timed steps per model (default 20, --quick 5)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per model before the timed ones")
    p.add_argument("--stacks", default=None, help=f"comma-separated, from {', '.join(STACKS)} (default: all; "
                   "--quick: transformer)")
    p.add_argument("--out", type=Path, default=None, help="folder for saved_workspace.json and summary.txt")
    return p


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser()
    args = p.parse_args(argv)
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

    rows = []
    for name in args.stacks:
        for recipe_name in (None, *RECIPES):
            check = q.check_fp8_block_scaling_support if recipe_name == "Float8BlockScaling" else q.check_fp8_support
            if recipe_name and not check()[0]:
                print(f"skipped {recipe_name}: {check()[1]}")
                continue
            rows.append(measure(STACKS[name], recipe_name, args))
            print(summary(rows[-1:]).splitlines()[1], flush=True)
    text = summary(rows)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        (args.out / "saved_workspace.json").write_text(json.dumps({"config": config, "rows": rows}, indent=1))
        (args.out / "summary.txt").write_text(text + "\n")
    ok = all(r["identical"] and r["lean_identical"] and verdict(r) in ("met", "baseline") for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
