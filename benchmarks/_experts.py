"""The MoE expert stacks of ``benchmarks.moe_memory``: their shapes, the
variants measured, data, the memory probe of one step and the paired timing.

The model is ``testbed.experts.build_expert_stack``, the builder the GPU
tests use too: blocks of ``te.GroupedLinear(experts, hidden, hidden,
bias=False)``, bf16 params, the tokens split evenly over the experts, FSDP2
on every block and the root, or unsharded. The memory probe is
``_stack.Probe`` (forward hooks on every block, marks before and after the
first microbatch's forward and backward and after the step) plus the peak
of the step over its start; the step is ``_stack.run_step`` (MSE loss,
``is_first_microbatch`` True on the first microbatch and False after, when
there are several), the optimizer TE's FusedAdam. Memory figures are rank
0's. TE, CUDA and ``te_integration`` are imported inside the functions.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from testbed.model import (
    QuantizationCounter,
    allocated,
    cached_workspaces,
    optimizer_for,
    random_pair,
    rank,
    release_memory,
)
from testbed.recipes import make_recipe

from ._harness import MIB
from ._stack import Probe, Steps, record_workspaces, run_step, take_turns

#: bf16: no FP8; stock: te.GroupedLinear; dropin: te_integration.GroupedLinear with its
#: default policies; lean: stock converted with LeanWorkspacePolicy (unsharded only).
VARIANTS = ("bf16", "stock", "dropin", "lean")


@dataclass(frozen=True)
class ExpertShape:
    """``blocks`` x GroupedLinear(``experts``, ``hidden``, ``hidden``) at ``tokens`` tokens a microbatch."""

    name: str
    blocks: int
    experts: int
    hidden: int
    tokens: int

    @property
    def params(self) -> int:
        """Expert parameters of the whole stack (unsharded)."""
        return self.blocks * self.experts * self.hidden**2

    def describe(self) -> str:
        return (f"{self.blocks} x GroupedLinear({self.experts}, {self.hidden}, {self.hidden}), "
                f"{self.tokens} tokens ({self.tokens // self.experts} per expert)")


SHAPES = {
    # The stack: 33.5 M expert parameters per block.
    "e8": ExpertShape("e8", blocks=8, experts=8, hidden=2048, tokens=4096),
    # Many small experts: 67.1 M per block, 64 tokens per expert (a multiple of the
    # 16 that TE's sm_90 FP8 recipes align a split to); about 9 GiB a model with Adam.
    "e64": ExpertShape("e64", blocks=8, experts=64, hidden=1024, tokens=4096),
}


@dataclass(frozen=True)
class ExpertSpec:
    """One model to build and measure."""

    shape: ExpertShape
    variant: str = "bf16"
    recipe: str = "bf16"
    sharded: bool = True
    micro: int = 1
    single_weight: bool = False

    @property
    def managed(self) -> bool:
        return self.variant in ("dropin", "lean")

    def label(self) -> str:
        parts = [self.shape.name, f"{self.shape.blocks}B", "FSDP2" if self.sharded else "unsharded",
                 "" if self.variant == "bf16" else self.recipe, f"x{self.micro}" if self.micro > 1 else "",
                 "single-weight" if self.single_weight else "", self.variant]
        return " ".join(p for p in parts if p)

    def as_dict(self) -> dict:
        return {"shape": self.shape.name, "blocks": self.shape.blocks, "experts": self.shape.experts,
                "hidden": self.shape.hidden, "tokens": self.shape.tokens, "variant": self.variant,
                "recipe": self.recipe, "sharded": self.sharded, "micro": self.micro,
                "single_weight": self.single_weight, "params": self.shape.params}


def build(spec: ExpertSpec) -> torch.nn.Module:
    """The stack of ``spec``, from seed 0 (every variant starts from the same weights)."""
    from testbed.experts import build_expert_stack

    s = spec.shape
    model = build_expert_stack(s.blocks, s.experts, s.hidden, recipe=make_recipe(spec.recipe),
                               managed=spec.variant == "dropin", single_grouped_weight=spec.single_weight,
                               sharded=spec.sharded)
    if spec.variant != "lean":
        return model
    import te_integration as ti
    from workspace_manager import LeanWorkspacePolicy

    return ti.convert_model(model, policy=LeanWorkspacePolicy())


def make_batches(shape: ExpertShape, step: int, micro: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Inputs and targets (tokens, hidden) of one step: different per rank,
    step and microbatch; the same for every model."""
    return [random_pair(2_000 + 1_000 * step + 10 * m + rank(), (shape.tokens, shape.hidden)) for m in range(micro)]


def estimate_seconds(spec: ExpertSpec, n_steps: int, models: int = 1) -> float:
    """A rough duration, for the ETA and the time budget: building, then per
    step and microbatch the larger of a launch-bound floor (20 us a GEMM,
    three GEMMs an expert) and the GEMMs at ~400 TFLOP/s, plus the
    optimizer (memory-bound)."""
    s = spec.shape
    gemm_s = max(3 * s.blocks * s.experts * 2e-5, 6 * s.tokens * s.params / s.experts / 4e14)
    build_s = 0.5 + s.params / 1e9
    return models * (build_s + n_steps * (spec.micro * gemm_s + s.params * 16 / 3e12))


class StepProbe(Probe):
    """:class:`_stack.Probe`, with the peak of the step taken over its start
    (the mark before the first forward, after ``zero_grad``)."""

    def mark(self, name: str) -> None:
        super().mark(name)
        if name == "pre_fwd":
            torch.cuda.reset_peak_memory_stats()

    def peak_over_start(self) -> int:
        return torch.cuda.max_memory_allocated() - self.points["pre_fwd"]


def probe_step(model, opt, recipe, batches, baseline: int) -> tuple[dict, list[float]]:
    """One probed step: the figures of :meth:`Probe.figures` in MiB per
    block, the peak over the start, quantizations and cached workspaces."""
    probe = StepProbe(model)
    try:
        with QuantizationCounter() as counter, record_workspaces(model):
            losses = run_step(model, opt, recipe, batches, probe)
        peak = probe.peak_over_start()
    finally:
        probe.close()
    fig = probe.figures(baseline)
    rise = fig["fwd_kib_per_layer"]
    return {"fwd_rise_mib_per_block": None if rise is None else rise / 1024, "held_mib": fig["fwd_total_mib"],
            "peak_over_start_mib": peak / MIB, "after_bwd_mib": fig["kept_after_bwd_mib"],
            "after_step_mib": fig["after_step_mib"], "workspace_after_fwd_mib": fig["workspace_after_fwd_mib"],
            "leftover_workspaces": fig["leftover_workspaces"], "quantizations": counter.count,
            "cached_workspaces": cached_workspaces(model)}, [float(v) for v in losses]


def quantizer_state_bytes(model: torch.nn.Module) -> int:
    """Bytes of the TE modules' recipe state (``fp8_meta``: scales, amax
    histories), each storage once. It lives from the first FP8 forward on,
    so memory over the build baseline holds it; bf16 models have none."""
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        meta = getattr(module, "fp8_meta", None)
        for state in (meta.values() if isinstance(meta, dict) else ()):
            for value in (vars(state).values() if hasattr(state, "__dict__") else ()):
                if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() not in seen:
                    seen.add(value.untyped_storage().data_ptr())
                    total += value.untyped_storage().nbytes()
    return total


def measure(spec: ExpertSpec, steps: Steps) -> dict:
    """Build ``spec``, train ``steps.warmup`` steps, then probe
    ``steps.probe`` steps; the probes' mean figures, each probe, the losses
    of every step. Memory after the step is over what was allocated before
    the model was built; the other figures are over the step's start."""
    release_memory()
    baseline = allocated()
    t0 = time.perf_counter()
    model = build(spec)
    opt = optimizer_for(model)
    build_s = time.perf_counter() - t0
    recipe = make_recipe(spec.recipe)
    losses: list[float] = []
    probes: list[dict] = []
    try:
        for step in range(steps.warmup + steps.probe):
            batches = make_batches(spec.shape, step, spec.micro)
            if step < steps.warmup:
                losses += [float(v) for v in run_step(model, opt, recipe, batches)]
                continue
            figures, step_losses = probe_step(model, opt, recipe, batches, baseline)
            probes.append(figures)
            losses += step_losses
        return {**mean_figures(probes), "quantizations_per_step": [p["quantizations"] for p in probes],
                "quantizer_state_mib": quantizer_state_bytes(model) / MIB,
                "probes": probes, "losses": losses, "spec": spec.as_dict(),
                "build_s": build_s, "baseline_mib": baseline / MIB}
    finally:
        del model, opt
        release_memory()


def mean_figures(probes: list[dict]) -> dict[str, Any]:
    """The mean of each figure over the probes (None where none has it)."""
    out: dict[str, Any] = {}
    for key in {k for p in probes for k in p}:
        values = [p[key] for p in probes if isinstance(p.get(key), (int, float))]
        out[key] = sum(values) / len(values) if values else None
    return out


def paired(specs: dict[str, ExpertSpec], steps: Steps, dist) -> dict:
    """Build the models of ``specs`` ({label: spec}, alive together) and
    train them in turn step by step (``_stack.take_turns``)."""
    release_memory()
    models = {label: build(spec) for label, spec in specs.items()}
    opts = {label: optimizer_for(model) for label, model in models.items()}
    recipes = {label: make_recipe(spec.recipe) for label, spec in specs.items()}
    first = next(iter(specs.values()))
    try:
        result = take_turns(models, opts, recipes, {label: spec.managed for label, spec in specs.items()},
                            lambda step: make_batches(first.shape, step, first.micro), steps, dist)
        result["specs"] = {label: spec.as_dict() for label, spec in specs.items()}
        return result
    finally:
        del models, opts
        release_memory()
