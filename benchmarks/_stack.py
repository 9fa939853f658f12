"""The sizes, data and measurement loops of the GPU benchmarks.

The dense model is ``testbed.model.build_stack``, the builder the GPU tests
use too: a stack of ``te.TransformerLayer`` under FSDP2, built stock or from
the drop-ins, with bf16 params or under ``te.quantized_model_init``,
optionally with ``te.checkpoint`` around every layer. Here it gets its sizes,
depths, microbatches and recompute mode (``ModelSpec``) and random data that
is the same for stock and drop-in. The loops serve every model of
``testbed``: :func:`measure` (the dense stack: memory probes, then timed
steps), :func:`probe_model` (any model: memory probes of whole steps),
:func:`paired` (models alive together, trained in turn step by step, with a
profiled step after). Memory figures are rank 0's and relative to what was
allocated before the model was built (TE keeps global state from models
built earlier). Step times are the slowest rank's, between two
``torch.cuda.synchronize``.

TE, CUDA and ``te_integration`` are imported inside the functions.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F

from testbed.model import (
    QuantizationCounter,
    allocated,
    build_stack,
    cached_workspaces,
    optimizer_for,
    random_pair,
    rank,
    release_memory,
)
from testbed.recipes import make_recipe

from ._harness import MIB, VARIANT_LABELS


@dataclass(frozen=True)
class Size:
    name: str
    hidden: int
    ffn: int
    heads: int
    seq: int
    batch: int
    layers: int  # default depth


SIZES = {
    # TE's FSDP2 leak-test model.
    "leak": Size("leak", hidden=256, ffn=1024, heads=8, seq=32, batch=2, layers=8),
    # A realistic layer; fsdp2_memory sizes its depth to the memory budget (auto_layers).
    "realistic": Size("realistic", hidden=4096, ffn=16384, heads=32, seq=2048, batch=1, layers=8),
}


@dataclass(frozen=True)
class ModelSpec:
    """One model to build and train."""

    size: Size
    layers: int
    recipe: str = "bf16"  # "bf16" or a recipe class name of transformer_engine.common.recipe
    managed: bool = False
    quantized_init: bool = False
    reshard_after_forward: bool = True
    checkpoint: str = "none"  # "none", "nonreentrant" or "reentrant" te.checkpoint around every layer
    #: A policy pinned on the drop-ins by its ``explain`` name (e.g. "fsdp2_microbatch_cache");
    #: None: selected per call, the default.
    policy: str | None = None

    @property
    def variant(self) -> str:
        return "bf16" if self.recipe == "bf16" else ("dropin" if self.managed else "stock")

    def label(self) -> str:
        parts = [self.size.name, f"{self.layers}L", self.recipe]
        if self.quantized_init:
            parts.append("qinit")
        if not self.reshard_after_forward:
            parts.append("keep")
        if self.checkpoint != "none":
            parts.append(f"ckpt-{self.checkpoint}")
        variant = VARIANT_LABELS[self.variant] + (f" ({self.policy})" if self.policy else "")
        return " ".join(parts + [variant])

    def as_dict(self) -> dict:
        d = asdict(self)
        d["size"] = self.size.name
        d["variant"] = self.variant
        return d


@dataclass(frozen=True)
class Steps:
    """Steps per model: untimed warm-up, memory probes (synchronizing, with
    quantization counting), then timed steps."""

    warmup: int
    probe: int
    timed: int
    micro: int = 1


def auto_layers(size: Size, world: int, budget_gib: float, total_gib: float, max_layers: int) -> int:
    """How many layers of ``size`` fit in ``budget_gib`` per GPU (at most 80%
    of ``total_gib``), with margin. Per layer and rank: bf16 param and grad,
    fp32 master weight and two Adam moments, sharded over ``world`` (16 bytes
    a parameter), and about 40 bytes of saved activations per token and
    hidden unit; x1.25 for FP8 copies and the allocator. Fixed: 6 GiB plus
    two gathered bf16 layers."""
    params = 4 * size.hidden**2 + 2 * size.hidden * size.ffn + 9 * size.hidden + size.ffn
    per_layer = 1.25 * (16 * params / world + 40 * size.seq * size.batch * size.hidden)
    fixed = 6 * 2**30 + 2 * 2 * params
    budget = min(budget_gib, 0.8 * total_gib) * 2**30
    return max(1, min(max_layers, int((budget - fixed) // per_layer)))


def estimate_seconds(spec: ModelSpec, steps: Steps) -> float:
    """A rough duration of one measured model, for the ETA and the time
    budget: building, then per layer and microbatch step the larger of a
    launch-bound floor (3 ms) and the GEMM time at ~500 TFLOP/s, plus the
    optimizer step (memory-bound)."""
    s = spec.size
    params = 4 * s.hidden**2 + 2 * s.hidden * s.ffn
    per_layer = max(0.003, 6 * s.seq * s.batch * params / 5e14)
    if spec.checkpoint != "none":
        per_layer *= 1.35
    n_steps = steps.warmup + steps.probe + steps.timed
    build = 0.3 + spec.layers * (0.02 + params / 2e9)
    optimizer = 0.002 + spec.layers * params * 14 / 4e12
    return build + n_steps * (steps.micro * spec.layers * per_layer + optimizer)


# -- the model ---------------------------------------------------------------------
def build(spec: ModelSpec) -> torch.nn.Module:
    """The stack of ``spec``, sharded with FSDP2 (seeded: stock and drop-in
    start from the same weights)."""
    s = spec.size
    return build_stack(s.hidden, s.ffn, s.heads, spec.layers, recipe=make_recipe(spec.recipe), managed=spec.managed,
                       quantized_init=spec.quantized_init, reshard_after_forward=spec.reshard_after_forward,
                       checkpoint=spec.checkpoint, policy=pinned_policy(spec.policy))


def pinned_policy(name: str | None):
    """The policy ``explain --policy NAME`` shows, to pin on drop-ins; None for None."""
    if name is None:
        return None
    from workspace_manager import named_policy

    return named_policy(name)


def fsdp2_policy_names() -> tuple[str, ...]:
    """The ``explain`` policy names that plan FSDP2-sharded weights: what a
    drop-in of the FSDP2 stack can have pinned."""
    from workspace_manager import POLICY_NAMES, Sharding, named_policy

    return tuple(n for n in POLICY_NAMES if Sharding.FSDP2_RESHARD in named_policy(n).shardings)


def add_policy_argument(parser, what: str) -> None:
    """``--policy NAME``: a policy pinned on the drop-in models (``what``
    says what else it changes); default none, the drop-ins' defaults."""
    names = fsdp2_policy_names()
    parser.add_argument("--policy", choices=names, default=None, metavar="NAME",
                        help=f"pin this policy on the drop-in models, by its explain name ({', '.join(names)}); "
                             f"default: none, the drop-ins' defaults. {what}")


def weight_numel(model: torch.nn.Module) -> int:
    """Elements of the GEMM weights (global, unsharded): the size of one FP8 copy in bytes."""
    return int(sum(p.numel() for _, p in model.named_parameters() if p.dim() == 2))


def make_batches(size: Size, step: int, micro: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Inputs and targets of one step: different per rank, step and
    microbatch; the same for every model."""
    shape = (size.seq, size.batch, size.hidden)
    return [random_pair(1_000 + 1_000 * step + 10 * m + rank(), shape) for m in range(micro)]


# -- measuring ---------------------------------------------------------------------
def seams_for(managed: bool) -> None:
    """Before a timed step or block: the seams installed for a drop-in, and
    taken out for stock TE, so stock runs TE's code untouched (timing
    benchmarks only: the quantization counter needs them installed)."""
    from te_integration.debug import install_seams, uninstall_seams

    if managed:
        install_seams()
    else:
        uninstall_seams()


class Probe:
    """Synchronizing memory marks for one step: before and after the first
    microbatch's forward and backward, after every layer's forward (forward
    hooks; recompute passes in backward are not recorded), after the step.
    ``peak_from_start``: the allocator's peak is reset at the first mark, so
    that :meth:`peak_over_start` is the step's own."""

    def __init__(self, model: torch.nn.Module, peak_from_start: bool = False) -> None:
        self.model, self.peak_from_start = model, peak_from_start
        self.marks: list[int] = []
        self.points: dict[str, int] = {}
        #: Live workspace bytes at each mark, and the leftovers after the
        #: step, from te_integration.workspace_report (issue 6).
        self.workspace: dict[str, int] = {}
        self.leftovers: list[dict] = []
        self.recording = False
        self._hooks = [child.register_forward_hook(self._hook) for child in model.children()]

    def _hook(self, *_: Any) -> None:
        if self.recording:
            self.marks.append(allocated())

    def mark(self, name: str) -> None:
        self.points[name] = allocated()
        if name == "pre_fwd" and self.peak_from_start:
            torch.cuda.reset_peak_memory_stats()
        import te_integration as ti

        report = ti.workspace_report(self.model)
        self.workspace[name] = report.total_bytes
        if name == "after_step":
            self.leftovers = [e.as_dict() for e in report.leftovers]

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def peak_over_start(self) -> int:
        return torch.cuda.max_memory_allocated() - self.points["pre_fwd"]

    def figures(self, baseline: int) -> dict:
        p = self.points
        diffs = [b - a for a, b in zip(self.marks, self.marks[1:])]
        return {
            "fwd_kib_per_layer": sum(diffs) / len(diffs) / 1024 if diffs else None,
            # TE's leak-test measure: after backward minus after forward.
            "bwd_mib": (p["post_bwd"] - p["post_fwd"]) / MIB,
            # After backward minus before forward: what forward+backward leaves.
            "kept_after_bwd_mib": (p["post_bwd"] - p["pre_fwd"]) / MIB,
            "fwd_total_mib": (p["post_fwd"] - p["pre_fwd"]) / MIB,
            "after_step_mib": (p["after_step"] - baseline) / MIB,
            "workspace_after_fwd_mib": self.workspace["post_fwd"] / MIB,
            "workspace_after_step_mib": self.workspace["after_step"] / MIB,
            "leftover_workspaces": len(self.leftovers),
            "leftovers": self.leftovers,
        }


def run_step(model, opt, recipe, batches, probe: Probe | None = None) -> list[torch.Tensor]:
    """One optimizer step over ``batches`` (microbatches with
    ``is_first_microbatch`` when there are several); the detached losses."""
    import transformer_engine.pytorch as te

    opt.zero_grad(set_to_none=True)
    losses = []
    for m, (x, target) in enumerate(batches):
        first = (m == 0) if len(batches) > 1 else None
        watch = probe is not None and m == 0
        if watch:
            probe.mark("pre_fwd")
            probe.recording = True
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            out = model(x, is_first_microbatch=first)
        if watch:
            probe.recording = False
            probe.mark("post_fwd")
        loss = F.mse_loss(out, target) / len(batches)
        loss.backward()
        if watch:
            probe.mark("post_bwd")
        losses.append(loss.detach())
    opt.step()
    if probe is not None:
        probe.mark("after_step")
    return losses


def measure(spec: ModelSpec, steps: Steps, dist) -> dict:
    """Build ``spec``, train it (warm-up, probes, timed steps), free it;
    every figure as a dict (see :func:`_train`)."""
    release_memory()
    baseline = allocated()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    model = build(spec)
    opt = optimizer_for(model)
    build_s = time.perf_counter() - t0
    try:
        figures = _train(model, opt, spec, steps, dist, baseline)
        figures.update(spec=spec.as_dict(), variant=spec.variant, build_s=build_s, baseline_mib=baseline / MIB,
                       weight_numel=weight_numel(model))
        return figures
    finally:
        del model, opt
        release_memory()


def _train(model, opt, spec: ModelSpec, steps: Steps, dist, baseline: int) -> dict:
    recipe = make_recipe(spec.recipe)
    losses: list[float] = []
    step = 0
    for _ in range(steps.warmup):
        losses += [float(v) for v in run_step(model, opt, recipe, make_batches(spec.size, step, steps.micro))]
        step += 1
    peak_from_build = torch.cuda.max_memory_allocated() - baseline
    torch.cuda.reset_peak_memory_stats()
    probes = []
    for _ in range(steps.probe):
        batches = make_batches(spec.size, step, steps.micro)
        probe = Probe(model)
        try:
            with QuantizationCounter() as counter, record_workspaces(model, timeline=False):
                step_losses = run_step(model, opt, recipe, batches, probe)
        finally:
            probe.close()
        losses += [float(v) for v in step_losses]
        del batches
        probes.append({**probe.figures(baseline), "quantizations": counter.count,
                       "cached_workspaces": cached_workspaces(model)})
        step += 1
    peak = torch.cuda.max_memory_allocated() - baseline
    times, timed_losses = timed_steps(model, opt, recipe, spec, steps, step)
    return {**_mean_probes(probes), "probes": probes, "peak_mib": peak / MIB,
            "peak_from_build_mib": peak_from_build / MIB, "step_time_s": dist.max_over_ranks(times),
            "losses": losses + ([float(v) for v in torch.stack(timed_losses).tolist()] if timed_losses else [])}


def timed_steps(model, opt, recipe, spec: ModelSpec, steps: Steps, first_step: int):
    """``steps.timed`` steps, each between two synchronizations (data made
    before the clock starts); this rank's seconds and the losses."""
    times, losses = [], []
    for i in range(steps.timed):
        batches = make_batches(spec.size, first_step + i, steps.micro)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        losses += run_step(model, opt, recipe, batches)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times, losses


def record_workspaces(model: torch.nn.Module, timeline: bool = False):
    """Workspace recording over the probe steps (never over timed steps)."""
    import te_integration as ti

    return ti.record_workspaces(model, timeline=timeline)


def _mean_probes(probes: list[dict]) -> dict:
    keys = ("fwd_kib_per_layer", "bwd_mib", "kept_after_bwd_mib", "fwd_total_mib", "after_step_mib",
            "workspace_after_fwd_mib", "workspace_after_step_mib")
    out: dict[str, Any] = {}
    for key in keys:
        values = [p[key] for p in probes if p.get(key) is not None]
        out[key] = sum(values) / len(values) if values else None
    out["quantizations_per_step"] = [p["quantizations"] for p in probes]
    out["cached_workspaces_after_step"] = [p["cached_workspaces"] for p in probes]
    out["leftover_workspaces"] = [p.get("leftover_workspaces", 0) for p in probes]
    return out


def prime(recipes: list[str], dist) -> None:
    """Build and step a small model per recipe, stock and drop-in, and
    discard it: one-time allocations and kernel compilation then do not
    land in the first measured model."""
    size = SIZES["leak"]
    for name in ["bf16", *recipes]:
        for managed in ((False,) if name == "bf16" else (False, True)):
            spec = ModelSpec(size=size, layers=2, recipe=name, managed=managed)
            measure(spec, Steps(warmup=1, probe=1, timed=1), dist)


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


def probe_step(model, opt, recipe, batches, baseline: int) -> tuple[dict, list[float]]:
    """One probed step of any model: :meth:`Probe.figures` with the per-layer
    rise in MiB per block, the peak over the step's start, quantizations
    and cached workspaces; and the step's losses."""
    probe = Probe(model, peak_from_start=True)
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


def probe_model(build, recipe_name: str, batches_for, steps: Steps, *, optimizer=optimizer_for) -> dict:
    """Build a model (``build()``), train ``steps.warmup`` steps, then probe
    ``steps.probe`` steps (:func:`probe_step`); the mean of each figure, each
    probe, the recipe state and the losses of every step. Memory after the
    step is over what was allocated before the model was built; the other
    figures are over the step's start. The seams stay installed (stock
    modules pass through them unchanged): the quantization counter needs them.
    ``optimizer(model)`` makes the optimizer (TE's FusedAdam by default)."""
    release_memory()
    baseline = allocated()
    t0 = time.perf_counter()
    model = build()
    opt = optimizer(model)
    build_s = time.perf_counter() - t0
    recipe = make_recipe(recipe_name)
    losses: list[float] = []
    probes: list[dict] = []
    try:
        for step in range(steps.warmup + steps.probe):
            batches = batches_for(step)
            if step < steps.warmup:
                losses += [float(v) for v in run_step(model, opt, recipe, batches)]
                continue
            figures, step_losses = probe_step(model, opt, recipe, batches, baseline)
            probes.append(figures)
            losses += step_losses
        means = {key: _mean([p[key] for p in probes]) for key in {k for p in probes for k in p}}
        return {**means, "quantizations_per_step": [p["quantizations"] for p in probes],
                "quantizer_state_mib": quantizer_state_bytes(model) / MIB, "probes": probes, "losses": losses,
                "build_s": build_s, "baseline_mib": baseline / MIB}
    finally:
        del model, opt
        release_memory()


def _mean(values: list) -> float | None:
    """The mean of the numbers among ``values`` (None where there are none)."""
    numbers = [v for v in values if isinstance(v, (int, float))]
    return sum(numbers) / len(numbers) if numbers else None


def profile_pair(models: dict, opts: dict, recipes: dict, batches, *, kernels: bool = False) -> dict:
    """One step of the stock and the drop-in models after the timed rounds
    (seams as in them), profiled: Python-level calls per function (cProfile)
    and, with ``kernels``, CUDA kernels, launches and GPU busy time
    (torch.profiler) of a second step (``_profile``)."""
    from ._profile import kernel_profile, profile_step

    out = {}
    for label in ("stock", "dropin"):
        seams_for(label == "dropin")
        step = lambda label=label: run_step(models[label], opts[label], recipes[label], batches)  # noqa: E731
        step()  # the same state for every profiler: one step after the timed rounds
        found = kernel_profile(step) if kernels else {}
        host = profile_step(step)
        out[label] = {**found, "calls": host["calls"], "python_calls": sum(host["calls"].values())}
    return out


def paired(builders: dict, recipe_name: str, batches_for, steps: Steps, dist, *, profile: bool = False,
           kernels: bool = False, optimizer=optimizer_for) -> dict:
    """Build every model of ``builders`` ({label: build()}, alive together;
    a label starting with ``stock`` is stock TE) and train them in turn
    (:func:`take_turns`), each with ``optimizer(model)`` (TE's FusedAdam by
    default). With ``profile``, one more step of ``stock`` and ``dropin`` is
    profiled (:func:`profile_pair`)."""
    release_memory()
    models = {label: build() for label, build in builders.items()}
    opts = {label: optimizer(model) for label, model in models.items()}
    recipes = {label: make_recipe(recipe_name) for label in models}  # one recipe object per model
    try:
        result = take_turns(models, opts, recipes, {label: not label.startswith("stock") for label in models},
                            batches_for, steps, dist)
        if profile:  # after the timed rounds: profiling must not touch them
            result["profile"] = profile_pair(models, opts, recipes, batches_for(10_000), kernels=kernels)
        return result
    finally:
        seams_for(True)
        del models, opts
        release_memory()


def paired_times(specs: dict[str, ModelSpec], steps: Steps, dist, profile: bool = False) -> dict:
    """:func:`paired` for dense stacks ({label: spec}, one size and recipe)."""
    first = next(iter(specs.values()))
    result = paired({label: (lambda spec=spec: build(spec)) for label, spec in specs.items()}, first.recipe,
                    lambda step: make_batches(first.size, step, steps.micro), steps, dist, profile=profile)
    result["specs"] = {label: spec.as_dict() for label, spec in specs.items()}
    return result


def take_turns(models: dict, opts: dict, recipes: dict, managed: dict[str, bool], batches_for, steps: Steps,
               dist) -> dict:
    """Train the models ({label: model}) in turn, one step each on the same
    ``batches_for(step)``: ``steps.warmup`` untimed rounds, then
    ``steps.timed`` timed ones. Each step is timed between two
    synchronizations and reported as the slowest rank's; its peak over its
    start is read after the clock stops (``step_peak_mib``: the largest over
    the timed steps, the largest rank's). Drift in clocks or load then hits
    every model alike. Stock models (``managed[label]`` False) step with the
    seams taken out (see :func:`seams_for`), so the ratios compare against
    TE's own code; the seams come back after."""
    times: dict[str, list[float]] = {label: [] for label in models}
    peaks: dict[str, list[float]] = {label: [] for label in models}
    losses: dict[str, list[float]] = {label: [] for label in models}
    try:
        for step in range(steps.warmup + steps.timed):
            batches = batches_for(step)
            labels = list(models)
            # Rotate who goes first each round: a position in the round must not favour anyone.
            for label in labels[step % len(labels):] + labels[:step % len(labels)]:
                seams_for(managed[label])
                torch.cuda.synchronize()
                start = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                t0 = time.perf_counter()
                step_losses = run_step(models[label], opts[label], recipes[label], batches)
                torch.cuda.synchronize()
                if step >= steps.warmup:
                    times[label].append(time.perf_counter() - t0)
                    peaks[label].append((torch.cuda.max_memory_allocated() - start) / MIB)
                losses[label] += [float(v) for v in step_losses]
    finally:
        seams_for(True)
    return {"step_time_s": {label: dist.max_over_ranks(t) for label, t in times.items()},
            "step_peak_mib": {label: max(dist.max_over_ranks(p), default=0.0) for label, p in peaks.items()},
            "losses": losses}
