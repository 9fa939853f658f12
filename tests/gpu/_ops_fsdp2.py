"""FSDP2 worker for te.ops (issue 28): ``torchrun --nproc_per_node=N tests/gpu/_ops_fsdp2.py OUT.json``.

For each sm_90 recipe TE supports here and bf16 / quantized_model_init
weights, two models (``testbed.ops_model``, small sizes): the stack of
``te.ops.Linear(bias=False)`` blocks and the ``te.ops.Sequential`` MLP
(LayerNorm, Linear + bias, GELU, Linear + bias), each block and the root
``fully_shard``-ed, stock and converted, trained the same steps
(``testbed.ops_measure``); also the ``te.Linear`` stack for reference.
Rank 0 writes, per case: losses, per-block forward rise and kept memory
(``testbed.ops_measure``), memory held after the step, peak, whether every
parameter gradient shard equals stock's, and each drop-in's plans; and the
cases stock TE itself fails here (``stock_failures``, with TE's error).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from testbed.dist import guard, run_worker  # noqa: E402
from testbed.model import allocated, release_memory  # noqa: E402
from testbed.ops_measure import measure_ops  # noqa: E402
from testbed.ops_model import build_linear_stack, build_ops_mlp, build_ops_stack  # noqa: E402
from testbed.recipes import make_recipe, supported_recipes  # noqa: E402

RECIPES = ("Float8CurrentScaling", "Float8BlockScaling", "DelayedScaling")
HIDDEN, FFN, LAYERS, TOKENS, STEPS, WARMUP = 256, 1024, 4, 512, 4, 1


def _grads(model) -> list:
    out = []
    for p in model.parameters():
        g = p.grad if p.grad is not None else None
        out.append(None if g is None else getattr(g, "_local_tensor", g).detach().clone())
    return out


def _run(builder, managed: bool, recipe, qinit: bool) -> dict:
    release_memory()
    baseline = allocated()
    model = builder(managed=managed, recipe=recipe, quantized_init=qinit)
    result = measure_ops(model, recipe, steps=STEPS, warmup=WARMUP, tokens=TOKENS, hidden=HIDDEN, baseline=baseline)
    # One more step's gradients, kept for the comparison (the optimizer step above cleared them).
    import transformer_engine.pytorch as te

    from testbed.ops_measure import ops_batch

    x, target = ops_batch(STEPS, TOKENS, HIDDEN)
    with te.autocast(enabled=recipe is not None, recipe=recipe):
        torch.nn.functional.mse_loss(model(x).float(), target.float()).backward()
    result["grads"] = _grads(model)
    if managed:
        import te_integration as ti

        ops = [m for m in model.modules() if isinstance(m, (ti.OpsBasicLinear, ti.OpsGroupedLinear))]
        result["plans"] = sorted({f"{ctx.sharding.value}: {plan.summary()}" for m in ops
                                  for ctx, plan in ti.last_plans(m).values()})
    del model
    return result


def _builders():
    return {
        "ops_stack": lambda **kw: build_ops_stack(HIDDEN, LAYERS, **kw),
        "ops_mlp": lambda **kw: build_ops_mlp(HIDDEN, FFN, LAYERS // 2, **kw),
    }


def _case(report: dict, recipe_name: str, qinit: bool) -> None:
    recipe = make_recipe(recipe_name)
    label = f"{recipe_name}/{'qinit' if qinit else 'bf16'}"
    for name, builder in _builders().items():
        try:
            stock = _run(builder, False, recipe, qinit)
        except Exception as err:  # noqa: BLE001  (stock TE's own failure: recorded, not ours to judge)
            report["stock_failures"][f"{label}/{name}"] = f"{type(err).__name__}: {str(err)[:400]}"
            release_memory()
            continue
        managed = _run(builder, True, recipe, qinit)
        same = len(stock["grads"]) == len(managed["grads"]) and all(
            (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
            for a, b in zip(stock["grads"], managed["grads"]))
        report["cases"][f"{label}/{name}"] = {
            "losses_stock": stock["losses"], "losses_managed": managed["losses"],
            "losses_identical": stock["losses"] == managed["losses"], "grads_identical": same,
            "rise_stock": stock["rise_per_block"], "rise_managed": managed["rise_per_block"],
            "kept_stock": stock["kept_per_block"], "kept_managed": managed["kept_per_block"],
            "after_step_stock": stock["held_after_step"], "after_step_managed": managed["held_after_step"],
            "peak_stock": stock["peak"], "peak_managed": managed["peak"], "plans": managed["plans"]}
    reference = _run(lambda **kw: build_linear_stack(HIDDEN, LAYERS, **kw), False, recipe, qinit)
    report["cases"][f"{label}/te_linear_stack"] = {"rise_stock": reference["rise_per_block"],
                                                   "kept_stock": reference["kept_per_block"],
                                                   "after_step_stock": reference["held_after_step"],
                                                   "peak_stock": reference["peak"]}


def run_cases(report: dict) -> None:
    import torch.distributed as dist

    report["dist_world_size"] = dist.get_world_size()
    for recipe in supported_recipes(RECIPES, report["unsupported"]):
        for qinit in (False, True):
            guard(report, f"{recipe}/{'qinit' if qinit else 'bf16'}", lambda: _case(report, recipe, qinit))


def main() -> int:
    return run_worker(sys.argv[1], run_cases, cases={}, unsupported={}, stock_failures={})


if __name__ == "__main__":
    sys.exit(main())
