"""What the te.ops FSDP2 GPU test and benchmark measure of one model
(``testbed.ops_model``): losses, the rise of allocated memory over each
block's forward, the peak, and step times.

The per-block rise is read by forward hooks on the blocks (each block is
called as a module): allocated memory after each block's forward minus
after the previous one's (the first block's against before the step),
averaged over the blocks and over the steps after warm-up. Under FSDP2
with ``reshard_after_forward=True`` it is what a block keeps for its
backward: activations, and the weight copies its plan saves; but also,
with a minus sign, what FSDP2's all-gather frees of the step before (a
transpose a quantized parameter kept since its last backward, which TE's
``Float8Tensor.fsdp_post_all_gather`` drops).

So ``kept_per_block`` is read as well: allocated memory after each block's
forward minus before it, the mark taken after FSDP2's all-gather (the
hooks run after FSDP2's, which it registers first). It is a block's own
forward, less the all-gathered weights FSDP2 frees when it reshards (the
same bytes for every variant of one weight kind). ``held_after_step`` is
allocated memory after the last optimizer step over ``baseline``: what
stays alive from step to step.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from .model import allocated, optimizer_for, random_pair, rank

__all__ = ["measure_ops", "ops_batch"]


def ops_batch(step: int, tokens: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Input and target of one step: different per rank and step, the same for every model."""
    return random_pair(5000 + 10 * step + rank(), (tokens, hidden))


def _hooks(model: torch.nn.Module, marks: list, starts: list) -> list:
    def pre(module, args):
        starts.append(allocated())

    def post(module, args, output):
        marks.append(allocated())

    return ([block.register_forward_pre_hook(pre) for block in model]
            + [block.register_forward_hook(post) for block in model])


def measure_ops(model: torch.nn.Module, recipe, *, steps: int, warmup: int, tokens: int, hidden: int,
                baseline: int) -> dict[str, Any]:
    """Train ``steps`` steps (MSE against a random target, TE's FusedAdam);
    losses of every step, and over the steps after ``warmup``: mean
    per-block forward rise and kept memory, peak over ``baseline``, step
    times (s); and what is held after the last step."""
    import transformer_engine.pytorch as te

    opt = optimizer_for(model)
    losses, rises, kept, peaks, times = [], [], [], [], []
    marks: list[int] = []
    starts: list[int] = []
    handles = _hooks(model, marks, starts)
    try:
        for step in range(steps):
            x, target = ops_batch(step, tokens, hidden)
            torch.cuda.reset_peak_memory_stats()
            marks.clear()
            starts.clear()
            start_mem = allocated()
            begin = time.perf_counter()
            with te.autocast(enabled=recipe is not None, recipe=recipe):
                out = model(x)
            loss = torch.nn.functional.mse_loss(out.float(), target.float())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - begin)
            losses.append(loss.item())
            if step >= warmup:
                points = [start_mem] + marks
                rises.append(sum(b - a for a, b in zip(points, points[1:])) / max(1, len(marks)))
                kept.append(sum(b - a for a, b in zip(starts, marks)) / max(1, len(marks)))
                peaks.append(torch.cuda.max_memory_allocated() - baseline)
            del x, target, out, loss
    finally:
        for h in handles:
            h.remove()
    return {"losses": losses, "rise_per_block": sum(rises) / max(1, len(rises)),
            "kept_per_block": sum(kept) / max(1, len(kept)), "held_after_step": allocated() - baseline,
            "peak": max(peaks) if peaks else None, "step_times": times[warmup:]}
