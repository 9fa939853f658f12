"""An exception inside TE's own backward, for each module kind (helpers of test_faults.py).

One *run* builds a drop-in, runs the step a fault hits, then one clean
step, and reports what the fault left behind, the clean step's numbers and
the memory allocated. The twin run is the same run with the fault switched
off; test_faults.py compares the two.

The fault: the ``at``-th GEMM that TE's backward calls raises. TE's module
files call ``general_gemm`` through their own globals, so replacing it there
for the length of one backward makes TE's backward fail part-way (``at=1``:
before any gradient exists; ``at=2``: after the dgrad GEMM, and for
LayerNormMLP after FC2's, with TE's own in-backward clears already done).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
from dataclasses import dataclass, field
from typing import Any

from workspace_manager import FSDP2WorkspacePolicy, MicrobatchCache, Release, Sharding
from workspace_manager.testing.plans import FixedSharding

HIDDEN, FFN, TOKENS = 64, 128, 32
#: TE's module file of each kind (its ``general_gemm`` is what backward calls).
TE_FILES = {"Linear": "linear", "LayerNormLinear": "layernorm_linear", "LayerNormMLP": "layernorm_mlp"}
#: The weights each kind plans, by the keys of its cache and plans.
WEIGHT_KEYS = {"Linear": ("weight",), "LayerNormLinear": ("weight",), "LayerNormMLP": ("fc1_weight", "fc2_weight")}
#: Pinned where the sharding is described: the microbatch cache is an option
#: (off by default, docs/decisions.md D4), and the faults test its release.
CACHE_OPTION = FSDP2WorkspacePolicy(microbatch_cache=MicrobatchCache.EXACT_FORMATS)


class InjectedFault(RuntimeError):
    """The exception the broken GEMM raises."""


@dataclass(frozen=True)
class Setup:
    kind: str
    #: Weights made by ``quantized_model_init`` (quantized parameters).
    quantized: bool
    #: The sharding the module's plans are made for. One GPU has no FSDP2 to
    #: shard with, yet the plans that release after backward are the FSDP2
    #: ones (FSDP2_KEEP with microbatches and the microbatch cache option
    #: releases the cache; quantized parameters their columnwise data). The
    #: module's state is given this sharding, so the binding plans and
    #: releases as under FSDP2, while TE sees the whole weight it has
    #: (``FixedSharding(..., is_fsdp2=False)``).
    sharding: Sharding


@dataclass(frozen=True)
class FaultReport:
    """What the faulted step left, read while the module was alive."""

    raised: bool
    #: Plan of each weight in the faulted call (the latest managed call).
    releases: dict[str, Release]
    cached_before: frozenset[str]
    #: Every cache entry is still the very object of before the backward.
    entries_unchanged: bool
    #: What ``release_step_caches`` dropped at the failed step's end.
    dropped: int
    cached_after: frozenset[str]
    #: Whether each quantized weight held columnwise data, before and after.
    columnwise_before: dict[str, bool] = field(default_factory=dict)
    columnwise_after: dict[str, bool] = field(default_factory=dict)
    active_after: Any = None
    fp8_enabled_after: bool = False


@dataclass(frozen=True)
class Run:
    report: FaultReport
    #: Outputs and gradients of the clean step, copied to the CPU.
    results: list
    #: Bytes allocated after the clean step, above the run's starting point.
    after_step: int
    #: Bytes still allocated once the module and results are deleted.
    leftover: int


def build(setup: Setup, recipe):
    import torch
    import transformer_engine.pytorch as te

    import te_integration as ti

    torch.manual_seed(7)
    init = te.quantized_model_init(enabled=True, recipe=recipe) if setup.quantized else contextlib.nullcontext()
    args = (HIDDEN, FFN) if setup.kind == "LayerNormMLP" else (HIDDEN, HIDDEN)
    with init:
        module = getattr(ti, setup.kind)(*args, params_dtype=torch.bfloat16, device="cuda")
    if setup.sharding is not Sharding.NONE:
        # The module's state, made before its first call as the binding makes
        # it (state_of), with the described sharding as its probe and the
        # microbatch cache option pinned (quantized parameters are never cached).
        probe = FixedSharding(setup.sharding, is_fsdp2=False)
        state = ti.debug.ModuleWorkspaceState(module._wm_kind, CACHE_OPTION, probe=probe)
        module.__dict__["_wm_state"] = state
    return module


def forward(module, recipe, seed: int, first: bool):
    import torch
    import transformer_engine.pytorch as te

    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True)
    with te.autocast(enabled=True, recipe=recipe):
        out = module(x, is_first_microbatch=first)
    return x, out


def backward(out) -> None:
    out.float().square().sum().backward()


@contextlib.contextmanager
def failing_gemm(kind: str, at: int | None):
    """While open, the ``at``-th GEMM call of TE's ``kind`` file raises
    :class:`InjectedFault` (``at=None``: no fault)."""
    if at is None:
        yield
        return
    file = importlib.import_module(f"transformer_engine.pytorch.module.{TE_FILES[kind]}")
    original, calls = file.general_gemm, [0]

    def gemm(*args, **kwargs):
        calls[0] += 1
        if calls[0] == at:
            raise InjectedFault(f"GEMM {at} of {kind}'s backward")
        return original(*args, **kwargs)

    file.general_gemm = gemm
    try:
        yield
    finally:
        file.general_gemm = original


def columnwise_data(weight) -> list:
    """The tensors holding a quantized weight's columnwise data (TE 2.20's
    storages; ``clear_columnwise_cache`` empties every one); [] for bf16."""
    names = ["_columnwise_data", "_columnwise_scale_inv"]
    if not getattr(weight, "_transpose_invalid", False):
        names.append("_transpose")
    return [t for t in (getattr(weight, n, None) for n in names) if t is not None]


def faulted_step(module, recipe, setup: Setup, at: int | None) -> FaultReport:
    """Microbatch 1 fills the cache, microbatch 2 reads it; microbatch 2's
    backward, the step's first, runs with GEMM ``at`` failing. The failed
    step is then abandoned (microbatch 1 never runs backward), as a training
    loop that catches the error would, and ended with ``release_step_caches``."""
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    import te_integration as ti
    from te_integration.runtime._call import ACTIVE

    keys = WEIGHT_KEYS[setup.kind]
    _, out1 = forward(module, recipe, 1, True)
    _, out2 = forward(module, recipe, 2, False)
    cached = dict(module._fp8_workspaces)
    columnwise_before = {k: bool(columnwise_data(getattr(module, k))) for k in keys}
    raised = False
    with failing_gemm(setup.kind, at):
        try:
            backward(out2)
        except InjectedFault:
            raised = True
    del out1, out2
    releases = {key: plan.release for key, (_, plan) in ti.last_plans(module).items()}
    kept = all(module._fp8_workspaces.get(k) is v for k, v in cached.items())
    columnwise_after = {k: bool(columnwise_data(getattr(module, k))) for k in keys}
    dropped = ti.release_step_caches(module)  # the failed step's end
    report = FaultReport(
        raised=raised, releases=releases, cached_before=frozenset(cached), entries_unchanged=kept,
        dropped=dropped, cached_after=frozenset(module._fp8_workspaces), columnwise_before=columnwise_before,
        columnwise_after=columnwise_after, active_after=ACTIVE.module(),
        fp8_enabled_after=FP8GlobalStateManager.is_fp8_enabled(),
    )
    del cached
    for p in module.parameters():
        p.grad = None  # the failed step's partial gradients are discarded (the twin's too)
    return report


def clean_step(module, recipe) -> list:
    """Two microbatches, forward and backward each, then the step's end."""
    import te_integration as ti

    results = []
    for micro in range(2):
        x, out = forward(module, recipe, 10 + micro, micro == 0)
        backward(out)
        results += [out.detach(), x.grad]
    results += [p.grad for p in module.parameters()]
    ti.release_step_caches(module)
    return results


def _allocated() -> int:
    import torch

    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def run(setup: Setup, recipe, at: int | None) -> Run:
    """Build, run the faulted step (a clean one for ``at=None``) and a clean
    step, measure, delete. Memory is counted from this run's own starting
    point, with the previous run deleted, so no run sees another's tensors;
    the clean step's results stay alive while measuring in both runs (as
    training would keep them) and are copied to the CPU before deletion."""
    start = _allocated()
    module = build(setup, recipe)
    report = faulted_step(module, recipe, setup, at)
    results = clean_step(module, recipe)
    after_step = _allocated() - start
    on_cpu = [None if t is None else t.detach().cpu() for t in results]
    del results, module
    return Run(report, on_cpu, after_step, _allocated() - start)
