"""The measuring half of ``benchmarks.moe_step`` (it runs on the GPU): the
timed rounds with their profiled step, and one model's memory probe.

The step is ``_stack.run_step`` (``is_first_microbatch`` True on the first
microbatch and False after); stock models step with the seams taken out
(``_stack.seams_for``), so stock runs TE's own code. TE, CUDA and
``te_integration`` are imported inside the functions.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

import torch

from testbed.model import allocated, optimizer_for, random_pair, rank, release_memory
from testbed.recipes import make_recipe

from ._harness import MIB
from ._profile import profile_step
from ._stack import Steps, run_step, seams_for, take_turns

if TYPE_CHECKING:
    from .moe_step import Case

__all__ = ["ORDER", "build", "batches", "timed", "memory", "kernel_profile"]

#: The models of a timed case, in their first round's order; the second stock is the control.
ORDER = ("stock", "dropin", "stock_again")

#: Host calls that launch work on the GPU, as torch.profiler names them.
_LAUNCH_PREFIXES = ("cudaLaunch", "cuLaunch")


def build(case: "Case", variant: str) -> torch.nn.Module:
    """The stack of ``case`` as ``variant`` (bf16, stock, dropin), from seed 0."""
    from testbed.moe_mlp import build_moe_mlp_stack

    fp8 = variant != "bf16"
    return build_moe_mlp_stack(case.layers, case.experts, case.hidden, case.ffn,
                               recipe=make_recipe(case.recipe) if fp8 else None, managed=variant == "dropin",
                               quantized_params=fp8 and case.params == "quantized")


def batches(case: "Case", step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Inputs and targets of one step, the same for every model."""
    return [random_pair(5_000 + 1_000 * step + 10 * m + rank(), (case.tokens, case.hidden)) for m in range(case.micro)]


def timed(case: "Case", args: argparse.Namespace, dist) -> dict:
    """Stock, drop-in and stock again in turn (``_stack.take_turns``), then
    the profiled steps of stock and the drop-in."""
    release_memory()
    models = {label: build(case, "dropin" if label == "dropin" else "stock") for label in ORDER}
    opts = {label: optimizer_for(model) for label, model in models.items()}
    recipe = make_recipe(case.recipe)
    recipes = {label: recipe for label in ORDER}
    managed = {label: label == "dropin" for label in ORDER}
    try:
        result = {}
        if "timing" in args.sections:
            result = take_turns(models, opts, recipes, managed, lambda step: batches(case, step),
                                Steps(warmup=args.warmup, probe=0, timed=args.steps, micro=case.micro), dist)
        if "profile" in args.sections:
            data = batches(case, 10_000)
            result["profile"] = {label: _profile(models[label], opts[label], recipe, data, managed[label])
                                 for label in ("stock", "dropin")}
        return result
    finally:
        seams_for(True)
        del models, opts
        release_memory()


def _profile(model, opt, recipe, data, managed: bool) -> dict:
    seams_for(managed)
    step = lambda: run_step(model, opt, recipe, data)  # noqa: E731
    step()  # the same state for both profilers: one step after the timed rounds
    kernels = kernel_profile(step)
    host = profile_step(step)
    return {**kernels, "python_calls": sum(host["calls"].values()), "calls_by": host["calls"],
            "own_by": host["own_by"]}


def kernel_profile(fn) -> dict:
    """Run ``fn`` once under torch.profiler and count its GPU work
    (:func:`count_kernels`)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return count_kernels(prof.events())


def count_kernels(events) -> dict:
    """From a profile's events: ``kernels`` (CUDA kernels, not copies,
    fills or annotated ranges), ``by_kernel`` (count per kernel name),
    ``busy_by`` (summed time per kernel name, ms), ``launch_calls`` (host
    calls that launch GPU work) and ``busy_ms`` (the kernels' summed time).

    A ``record_function`` range (FSDP's ``FSDP::pre_forward``, the
    optimizer's step) is mirrored on the GPU's timeline as an event of the
    same name spanning the kernels inside it: counted, it would add its
    whole span to the busy time. Such events are marked as user annotations,
    and their names are the host ranges' names; either leaves one out."""
    events = list(events)
    cuda = torch.autograd.DeviceType.CUDA
    ranges = {e.name for e in events if e.device_type != cuda and getattr(e, "is_user_annotation", False)}
    by_kernel: dict[str, int] = {}
    busy_by: dict[str, float] = {}
    launches = 0
    for event in events:
        if event.device_type == cuda:
            if (event.name.startswith(("Memcpy", "Memset")) or event.name in ranges
                    or getattr(event, "is_user_annotation", False)):
                continue
            by_kernel[event.name] = by_kernel.get(event.name, 0) + 1
            busy_by[event.name] = busy_by.get(event.name, 0.0) + event.time_range.elapsed_us() / 1e3
        elif event.name.startswith(_LAUNCH_PREFIXES):
            launches += 1
    return {"kernels": sum(by_kernel.values()), "by_kernel": by_kernel, "busy_by": busy_by,
            "launch_calls": launches, "busy_ms": sum(busy_by.values())}


class _Marks:
    """What ``run_step`` marks on its first microbatch: allocated memory at
    each mark; the peak is taken over the step's start."""

    recording = False

    def __init__(self) -> None:
        self.points: dict[str, int] = {}

    def mark(self, name: str) -> None:
        self.points[name] = allocated()
        if name == "pre_fwd":
            torch.cuda.reset_peak_memory_stats()


def memory(case: "Case", variant: str, warmup: int) -> dict:
    """One model alone: ``warmup`` steps, then one marked step."""
    release_memory()
    baseline = allocated()
    model = build(case, variant)
    opt = optimizer_for(model)
    recipe = make_recipe(case.recipe) if variant != "bf16" else None
    seams_for(variant == "dropin")
    try:
        losses = []
        for step in range(warmup):
            losses += [float(v) for v in run_step(model, opt, recipe, batches(case, step))]
        marks = _Marks()
        losses += [float(v) for v in run_step(model, opt, recipe, batches(case, warmup), marks)]
        p = marks.points
        return {"held_mib": (p["post_fwd"] - p["pre_fwd"]) / MIB,
                "after_step_mib": (p["after_step"] - baseline) / MIB,
                "peak_mib": (torch.cuda.max_memory_allocated() - p["pre_fwd"]) / MIB,
                "recipe_state_mib": _recipe_state_bytes(model) / MIB, "losses": losses}
    finally:
        seams_for(True)
        del model, opt
        release_memory()


def _recipe_state_bytes(model: torch.nn.Module) -> int:
    from ._experts import quantizer_state_bytes

    return quantizer_state_bytes(model)
