"""Memory held from forward to backward without FSDP: drop-in against stock TE (D11).

    python -m benchmarks.saved_workspace [--out DIR] [--steps 3]

Unsharded training saves each weight's workspace for backward. Stock TE keeps
it with rowwise and columnwise data (2 bytes per parameter under per-tensor
FP8), though dgrad reads only the columnwise data; the drop-ins keep what the
plan's ``backward_usage`` names (docs/decisions.md, D11). Two stacks, each
built stock and drop-in from one seed, with bf16 weights and bf16 as the
baseline: 8 x Linear(4096, 4096) at 2048 tokens, and 8 x
TransformerLayer(2048, 8192, 16 heads) at seq 1024, batch 2. Per recipe:
memory held at the end of forward (over the step's start), the step's peak
(over its start), the saving per parameter, and outputs and gradients
compared bit for bit. A third model pins ``LeanWorkspacePolicy`` (no copy
kept from forward to backward, one extra quantization per weight per step);
its figures are reported next to bf16's, with no target. Targets: forward-held and peak at most stock minus
1 byte per parameter for per-tensor FP8 (Delayed, Current scaling) and
for Block scaling.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

MIB = 2**20
RECIPES = ("DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling")


VARIANTS = ("stock", "dropin", "lean")


def build(stack: str, variant: str) -> torch.nn.Module:
    import transformer_engine.pytorch as te

    import te_integration as ti

    torch.manual_seed(0)
    kw = dict(params_dtype=torch.bfloat16, device="cuda")
    if stack == "linear":
        layers = [te.Linear(4096, 4096, bias=False, **kw) for _ in range(8)]
    else:
        layers = [te.TransformerLayer(2048, 8192, 16, hidden_dropout=0.0, attention_dropout=0.0, **kw)
                  for _ in range(8)]
    model = torch.nn.Sequential(*layers)
    if variant == "stock":
        return model
    from workspace_manager import LeanWorkspacePolicy

    return ti.convert_model(model, policy=LeanWorkspacePolicy() if variant == "lean" else None)


def inputs(stack: str, step: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(step)
    shape = (2048, 4096) if stack == "linear" else (1024, 2, 2048)
    return torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g)


def step(model, stack: str, recipe, n: int) -> dict:
    """One training step; memory over its start at the end of forward and at peak."""
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
    peak = torch.cuda.max_memory_allocated() - start
    grads = [p.grad.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    return {"held": held, "peak": peak, "out": out.detach(), "grads": grads}


def measure(stack: str, recipe_name: str | None, steps: int) -> dict:
    from transformer_engine.common import recipe as recipes

    recipe = getattr(recipes, recipe_name)() if recipe_name else None
    runs = {}
    for label in VARIANTS:
        model = build(stack, label)
        results = [step(model, stack, recipe, n) for n in range(steps)]
        runs[label] = results
        del model
        torch.cuda.empty_cache()
    params = sum(p.numel() for p in build(stack, "stock").parameters())
    torch.cuda.empty_cache()
    same = {label: all(torch.equal(a["out"], b["out"]) and all(torch.equal(x, y) for x, y in zip(a["grads"], b["grads"]))
                       for a, b in zip(runs["stock"], runs[label])) for label in VARIANTS[1:]}
    last = {label: r[-1] for label, r in runs.items()}
    return {"stack": stack, "recipe": recipe_name or "bf16", "params": params, "identical": same["dropin"],
            "lean_identical": same["lean"],
            **{f"{label}_{k}_mib": last[label][k] / MIB for label in last for k in ("held", "peak")}}


def verdict(row: dict) -> str:
    if row["recipe"] == "bf16":
        return "baseline"
    need = row["params"] / MIB  # 1 byte per parameter, in MiB
    ok = (row["stock_held_mib"] - row["dropin_held_mib"] >= need * 0.99
          and row["stock_peak_mib"] - row["dropin_peak_mib"] >= need * 0.99)
    return "met" if ok else f"MISSED (target: {need:.0f} MiB less)"


def summary(rows: list[dict]) -> str:
    lines = [f"{'stack':11} {'recipe':20} {'held stock':>10} {'held ours':>9} {'held lean':>9} {'peak stock':>10} "
             f"{'peak ours':>9} {'peak lean':>9} {'B/param':>7}  identical(ours,lean)  target"]
    for r in rows:
        saving = (r["stock_held_mib"] - r["dropin_held_mib"]) * MIB / r["params"]
        same = f"{'yes' if r['identical'] else 'NO'},{'yes' if r['lean_identical'] else 'NO'}"
        lines.append(f"{r['stack']:11} {r['recipe']:20} {r['stock_held_mib']:10.1f} {r['dropin_held_mib']:9.1f} "
                     f"{r['lean_held_mib']:9.1f} {r['stock_peak_mib']:10.1f} {r['dropin_peak_mib']:9.1f} "
                     f"{r['lean_peak_mib']:9.1f} {saving:7.3f}  {same:20}  {verdict(r)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--stacks", default="linear,transformer")
    p.add_argument("--out", type=Path, default=None, help="folder for saved_workspace.json and summary.txt")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("saved_workspace needs a CUDA GPU and TransformerEngine 2.20.x; nothing measured.")
        return 2
    from transformer_engine.pytorch import quantization as q

    rows = []
    for stack in args.stacks.split(","):
        for recipe_name in (None, *RECIPES):
            check = q.check_fp8_block_scaling_support if recipe_name == "Float8BlockScaling" else q.check_fp8_support
            if recipe_name and not check()[0]:
                print(f"skipped {recipe_name}: {check()[1]}")
                continue
            rows.append(measure(stack, recipe_name, args.steps))
            print(summary(rows[-1:]).splitlines()[1], flush=True)
    text = summary(rows)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "saved_workspace.json").write_text(json.dumps({"config": vars(args) | {"out": str(args.out)},
                                                                   "rows": rows}, indent=1))
        (args.out / "summary.txt").write_text(text + "\n")
    return 0 if all(r["identical"] and verdict(r) in ("met", "baseline") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
