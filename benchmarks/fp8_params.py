"""TE's FP8-parameter training flow, stock against the drop-in: loss curves and step time.

    python3 -m benchmarks.fp8_params [--quick] [--recipes DelayedScaling,Float8CurrentScaling] [--steps N] [--profile]

TE's documented way to train FP8 parameters: ``te.quantized_model_init``
and ``te.optimizers.FusedAdam(master_weights=True)``. The model: 6 x
``te.Linear(1024, 1024)`` with GELU between, regressing a fixed random
teacher (3 x ``Linear(1024, 1024)`` with tanh, fp32) on fresh batches of
4096, lr 3e-4, one GPU. Four variants train from the same weights and
batches: stock TE, the reference (stock with TE's own ``_reset_caches()``
on every quantized parameter after each step: stock with the stale
transpose removed, ``testbed.freshness.reference_reset``), the drop-in
(``te_integration.convert_model``), and bf16 parameters without FP8.

Rows: the drop-in's loss curve equals the reference's bit for bit; final
losses; then step time, the drop-in against stock with a stock-again
control, the models stepping in turn; and the work of the drop-in's step
task alone (what the fix costs: TE's ``_reset_caches()`` and one FP8
transpose per weight per step, made here by ``testbed.freshness.reference_reset``
on the drop-in's weights), timed over 200 calls. ``series``: the loss per step, which
``python3 -m benchmarks.plot`` draws.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Sequence

from . import _harness as h
from ._runner import save

NAME = "fp8_params"
RECIPES = ("DelayedScaling", "Float8CurrentScaling")
WIDTH, LAYERS, BATCH, LR = 1024, 6, 4096, 3e-4
DEFAULTS = {"recipes": (list(RECIPES), list(RECIPES)), "steps": (300, 40), "timed": (100, 20)}


def parser() -> argparse.ArgumentParser:
    p = h.base_parser(NAME, __doc__)
    p.add_argument("--recipes", type=h.csv_choices(RECIPES), help=f"comma-separated, from {', '.join(RECIPES)}")
    p.add_argument("--steps", type=h.positive_int, help="training steps per variant (default 300)")
    p.add_argument("--timed", type=h.positive_int, help="timed steps per model, in turn (default 100)")
    p.add_argument("--profile", action="store_true",
                   help="also profile one step of stock and of the drop-in under cProfile (the functions whose "
                        "call counts differ)")
    return p


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    return h.parse_args(parser(), argv, DEFAULTS)


def build(variant: str, recipe):
    """The student: stock, drop-in or bf16, from seed 0 (``reference`` is stock)."""
    import torch
    import transformer_engine.pytorch as te

    import te_integration as ti

    qinit = variant != "bf16"
    init = te.quantized_model_init(enabled=True, recipe=recipe) if qinit else contextlib.nullcontext()
    torch.manual_seed(0)
    layers = []
    with init:
        for i in range(LAYERS):
            layers.append(te.Linear(WIDTH, WIDTH, params_dtype=torch.bfloat16, device="cuda"))
            if i < LAYERS - 1:
                layers.append(torch.nn.GELU())
    model = torch.nn.Sequential(*layers)
    return ti.convert_model(model) if variant == "dropin" else model


def teacher():
    import torch

    g = torch.Generator(device="cuda").manual_seed(123)
    weights = [torch.randn(WIDTH, WIDTH, device="cuda", generator=g) / WIDTH ** 0.5 for _ in range(3)]

    def target(x):
        for w in weights:
            x = torch.tanh(x @ w)
        return x

    return target


class Trainer:
    """One variant's model, optimizer and step."""

    def __init__(self, variant: str, recipe) -> None:
        import torch
        import transformer_engine.pytorch as te

        from testbed.freshness import reference_reset

        self.variant, self.recipe = variant, recipe
        self.model = build(variant, recipe)
        self.opt = te.optimizers.FusedAdam(list(self.model.parameters()), lr=LR, master_weights=True,
                                           master_weight_dtype=torch.float32)
        self.reset = reference_reset if variant == "reference" else None
        self.fp8 = variant != "bf16"

    def step(self, x, y) -> float:
        import transformer_engine.pytorch as te

        with te.autocast(enabled=self.fp8, recipe=self.recipe):
            out = self.model(x)
        loss = (out.float() - y).square().mean()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.reset is not None:
            self.reset(self.model)
        return loss


def batch(step: int, target):
    import torch

    g = torch.Generator(device="cuda").manual_seed(step)
    x = torch.randn(BATCH, WIDTH, device="cuda", generator=g)
    return x.bfloat16(), target(x)


def curves(recipe_name: str, steps: int) -> dict[str, list[float]]:
    """Loss per step of each variant (trained one after the other)."""
    from testbed.model import release_memory
    from testbed.recipes import make_recipe

    recipe, target, out = make_recipe(recipe_name), teacher(), {}
    for variant in ("stock", "reference", "dropin", "bf16"):
        trainer = Trainer(variant, recipe)
        out[variant] = [trainer.step(*batch(s, target)).item() for s in range(steps)]
        del trainer
        release_memory()
    return out


def step_times(recipe_name: str, timed: int) -> dict[str, list[float]]:
    """Seconds per step of stock, drop-in and stock again, stepping in turn."""
    import torch

    from testbed.recipes import make_recipe

    recipe, target = make_recipe(recipe_name), teacher()
    trainers = {v: Trainer(v if v != "again" else "stock", recipe) for v in ("stock", "dropin", "again")}
    times: dict[str, list[float]] = {v: [] for v in trainers}
    for s in range(timed + 5):
        x, y = batch(s, target)
        order = list(trainers) if s % 2 == 0 else list(reversed(trainers))
        for v in order:
            torch.cuda.synchronize()
            start = time.perf_counter()
            trainers[v].step(x, y)
            torch.cuda.synchronize()
            if s >= 5:  # warm-up
                times[v].append(time.perf_counter() - start)
    return times


def step_task_seconds(recipe_name: str, calls: int = 200) -> tuple[float, int]:
    """Seconds the binding adds to an optimizer step of the drop-in model
    (its step hook: TE's ``_reset_caches`` and transpose kernel per
    quantized weight, synchronized), and how many per-tensor FP8 weights the
    model has: what D12 adds to a step. Timed through a ``torch.optim``
    optimizer that holds the model's parameters and updates none of them (no
    gradients), against the same over the stock model's parameters, whose
    steps the hook passes over."""
    import torch

    from testbed.recipes import make_recipe

    recipe, target = make_recipe(recipe_name), teacher()
    trainers = [Trainer(variant, recipe) for variant in ("dropin", "stock")]
    for s in range(3):
        for trainer in trainers:
            trainer.step(*batch(s, target))
    seconds = []
    for trainer in trainers:
        idle = torch.optim.SGD(list(trainer.model.parameters()), lr=0.0)
        idle.step()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            idle.step()
        torch.cuda.synchronize()
        seconds.append((time.perf_counter() - start) / calls)
    weights = sum(1 for p in trainers[0].model.parameters() if hasattr(p, "_transpose_invalid"))
    return seconds[0] - seconds[1], weights


def profile_tables(recipe_name: str) -> list[dict]:
    """One step of stock and of the drop-in under cProfile, after warm-up
    steps of both (the drop-in's step task included): where the drop-in's
    extra host time goes."""
    from testbed.recipes import make_recipe

    from ._profile import differences_table, profile_step

    recipe, target = make_recipe(recipe_name), teacher()
    trainers = {v: Trainer(v, recipe) for v in ("stock", "dropin")}
    for s in range(3):
        for trainer in trainers.values():
            trainer.step(*batch(s, target))
    x, y = batch(3, target)
    # The drop-in first, straight after its own warm-up step.
    got = {v: profile_step(lambda t=trainers[v]: t.step(x, y)) for v in ("dropin", "stock")}
    case = f"{recipe_name}, FP8 params + FusedAdam"
    return [differences_table(f"Where the host time goes: {case}, one step", got["stock"]["calls"],
                              got["dropin"]["calls"], what="Python-level calls")]


def rows_for(recipe_name: str, losses: dict, times: dict, task: tuple[float, int]) -> list[dict]:
    case = f"{recipe_name}, FP8 params + FusedAdam"
    final = {v: values[-1] for v, values in losses.items()}
    rows = [h.check_row(case, "drop-in loss curve equals the reference's", losses["dropin"] == losses["reference"],
                        f"{len(losses['dropin'])} steps, bit for bit", target="equal")]
    rows.append(h.ratio_row(case, "final loss", "", final["stock"], final["dropin"], limit=None, bf16=final["bf16"],
                            note=f"first {losses['stock'][0]:.4f}; reference {final['reference']:.4f}"))
    rows.append(h.time_row(case, times["stock"], times["dropin"]))
    rows.append(h.control_row(case, times["stock"], times["again"]))
    seconds, weights = task
    stock_ms = h.spread([1e3 * t for t in times["stock"]])["median"]
    rows.append(h.ratio_row(case, "step task: transposes remade at the step", "us", None, 1e6 * seconds, limit=None,
                            note=f"{weights} weights, {1e6 * seconds / max(weights, 1):.1f} us each; "
                                 f"{100 * 1e3 * seconds / stock_ms:.2f}% of stock's median step"))
    return rows


def series_for(recipe_name: str, losses: dict) -> dict:
    labels = {"stock": "stock TE", "reference": "reference (stock, caches reset after each step)",
              "dropin": "drop-in", "bf16": "bf16 parameters"}
    return {"id": f"loss_{recipe_name}", "title": f"{recipe_name}: FP8 parameters + FusedAdam, loss per step",
            "xlabel": "step", "ylabel": "MSE loss",
            "lines": [{"label": labels[v], "x": list(range(len(ys))), "y": ys} for v, ys in losses.items()]}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    import torch

    if not torch.cuda.is_available():
        print("fp8_params needs a CUDA GPU and TransformerEngine 2.20.x; nothing measured.")
        return 2
    result = h.new_result(NAME, h.config_of(args, width=WIDTH, layers=LAYERS, batch=BATCH, lr=LR))
    start = time.perf_counter()
    for recipe_name in args.recipes:
        losses = curves(recipe_name, args.steps)
        times = step_times(recipe_name, args.timed)
        result["rows"] += rows_for(recipe_name, losses, times, step_task_seconds(recipe_name))
        result["series"].append(series_for(recipe_name, losses))
        if args.profile:
            result["tables"] += profile_tables(recipe_name)
        result["samples"].append({"recipe": recipe_name, "losses": losses, "times_s": times})
        if not args.quiet:
            print(f"{recipe_name}: final loss stock {losses['stock'][-1]:.4f}, reference "
                  f"{losses['reference'][-1]:.4f}, drop-in {losses['dropin'][-1]:.4f}, bf16 {losses['bf16'][-1]:.4f}",
                  flush=True)
    result["wall_s"] = time.perf_counter() - start
    save(result, args.out, args.tag)
    return 0 if all(r["ok"] is not False for r in result["rows"] if r["metric"] != "median step time") else 1


if __name__ == "__main__":
    sys.exit(main())
