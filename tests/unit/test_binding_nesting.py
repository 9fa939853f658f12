"""The whole binding on CPU against a stand-in TE: which module a call is
planned for, the memo of levers, and what survives a failing call.

A TE module called inside a drop-in's ``forward`` (a LoRA adapter left
stock, say) once ran under the drop-in's plan and wrote into its cache,
which changed the numbers silently. Each test here drives modules through
their public ``forward`` only.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from _fake_te import InjectedFault, LinearFunction, TELinear, checkpoint, in_recompute_phase, load_full_binding

MICROBATCHES = (True, False, False)


class LoRA(TELinear):
    """A user subclass whose forward adds a second TE Linear (the adapter;
    another LoRA nests one level more)."""

    def __init__(self, seed: int = 0, adapter: TELinear | None = None) -> None:
        super().__init__(8, 8, seed=seed)
        self.adapter = adapter if adapter is not None else TELinear(8, 8, seed=seed + 100)

    def forward(self, inp, is_first_microbatch=None):
        return super().forward(inp, is_first_microbatch) + self.adapter(inp, is_first_microbatch)


class Outer(torch.nn.Module):
    """A stock container holding a drop-in holding a stock module: two levels deep."""

    def __init__(self) -> None:
        super().__init__()
        self.lora = LoRA(seed=1)
        self.tail = TELinear(8, 8, seed=2)

    def forward(self, inp, is_first_microbatch=None):
        return self.tail(self.lora(inp, is_first_microbatch), is_first_microbatch)


@pytest.fixture
def ti(monkeypatch):
    LinearFunction.fail_backward = False
    return load_full_binding(monkeypatch)


def _call(model, x, scenario: str, first: bool):
    """A forward: plainly with its microbatch position, or under the
    stand-in te.checkpoint (without positions)."""
    if scenario.startswith("checkpoint"):
        return checkpoint(model, x, use_reentrant=scenario == "checkpoint")
    return model(x, is_first_microbatch=first)


def _train(model, steps: int = 3, scenario: str = "plain", first_step: int = 0) -> list[torch.Tensor]:
    outs = []
    for step in range(first_step, first_step + steps):
        for i, first in enumerate(MICROBATCHES):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + i), requires_grad=True)
            out = _call(model, x, scenario, first)
            out.sum().backward()
            outs += [out.detach(), x.grad]
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.01 * torch.ones_like(p)
    return outs


def test_stock_adapter_inside_a_drop_in_is_planned_as_itself(ti):
    stock, managed = LoRA(seed=1), LoRA(seed=1)
    ti.modules.convert_model(managed, module_filter=lambda mod, fqn: fqn != "adapter")
    assert type(managed.adapter) is TELinear and isinstance(managed, ti.modules.ManagedModule)
    for a, b in zip(_train(stock), _train(managed)):
        assert torch.equal(a, b)
    # Each cache holds a workspace of its own module's weight only.
    assert set(managed._fp8_workspaces) == {"weight"}
    assert managed._fp8_workspaces["weight"].source is managed.weight
    assert managed.adapter._fp8_workspaces["weight"].source is managed.adapter.weight
    # The adapter ran TE's own path: it was handed its cached workspace.
    assert managed.adapter.calls[-1].weight_workspace is managed.adapter._fp8_workspaces["weight"]
    assert set(ti.modules.last_plans(managed)) == {"weight"}


def test_drop_in_adapter_and_two_levels_of_nesting_match_stock(ti):
    stock, managed = Outer(), Outer()
    ti.modules.convert_model(managed, module_filter=lambda mod, fqn: fqn in ("lora.adapter", "tail"))
    assert type(managed.lora) is LoRA  # the middle level stays stock
    for a, b in zip(_train(stock), _train(managed)):
        assert torch.equal(a, b)
    for module in (managed.lora.adapter, managed.tail):
        assert module._fp8_workspaces["weight"].source is module.weight
        assert set(ti.modules.last_plans(module)) == {"weight"}
    assert managed.lora._fp8_workspaces["weight"].source is managed.lora.weight


def test_an_exception_in_a_nested_module_leaves_nothing_active(ti):
    managed = ti.modules.convert_model(LoRA(seed=3), module_filter=lambda mod, fqn: fqn != "adapter")
    _train(managed, steps=1)
    before = dict(managed._fp8_workspaces)

    def broken(inp, is_first_microbatch=None):
        raise RuntimeError("adapter failed")

    managed.adapter.forward = broken
    with pytest.raises(RuntimeError, match="adapter failed"):
        managed(torch.randn(4, 8), is_first_microbatch=True)
    assert ti.call.ACTIVE.module() is None
    assert managed._fp8_workspaces == before
    del managed.adapter.forward
    stock = LoRA(seed=3)
    _train(stock, steps=1)
    # Before the adapter raised, the drop-in's own first-microbatch forward
    # refreshed its cache with the updated weight, as TE refreshes on a first
    # microbatch; the twin's own part does the same (the adapters never ran).
    with torch.no_grad():
        TELinear.forward(stock, torch.randn(4, 8), is_first_microbatch=True)
    x = torch.randn(4, 8)
    assert torch.equal(managed(x, is_first_microbatch=False), stock(x, is_first_microbatch=False))


def test_a_failing_forward_leaves_the_cache_as_it_was(ti):
    managed = ti.modules.convert_model(TELinear(8, 8, seed=4))
    managed(torch.randn(4, 8), is_first_microbatch=True)
    cached = managed._fp8_workspaces["weight"]
    with pytest.raises(RuntimeError):
        managed(torch.randn(4, 3), is_first_microbatch=True)  # wrong width: the GEMM fails
    assert managed._fp8_workspaces == {"weight": cached}
    assert ti.call.ACTIVE.module() is None


def test_repeated_call_shapes_are_planned_once_and_new_shapes_again(ti):
    managed = ti.modules.convert_model(TELinear(8, 8, seed=5))
    state = ti.modules.workspace_state(managed)
    x = torch.randn(4, 8, requires_grad=True)
    for _ in range(5):
        managed(x).sum().backward()
    assert state.shapes_planned() == 1
    managed(x, is_first_microbatch=True)
    managed(x, is_first_microbatch=False)
    assert state.shapes_planned() == 3
    with torch.no_grad():
        managed(x)
    assert state.shapes_planned() == 4
    ctx, plan = ti.modules.last_plans(managed)["weight"]
    assert ctx.grad_enabled is False
    managed(x, is_first_microbatch=False)
    assert state.shapes_planned() == 4  # seen before: a lookup


def test_pinning_a_policy_forgets_the_memo(ti):
    from workspace_manager import WorkspacePolicy

    managed = ti.modules.convert_model(TELinear(8, 8, seed=6))
    state = ti.modules.workspace_state(managed)
    managed(torch.randn(4, 8))
    assert state.shapes_planned() == 1
    ti.modules.set_workspace_policy(managed, WorkspacePolicy())
    assert state.shapes_planned() == 0 and managed.workspace_policy == WorkspacePolicy()
    managed(torch.randn(4, 8))
    assert state.shapes_planned() == 1


def test_a_backward_that_raises_still_clears_the_call(ti):
    managed = ti.modules.convert_model(TELinear(8, 8, seed=7))
    x = torch.randn(4, 8, requires_grad=True)
    out = managed(x)
    LinearFunction.fail_backward = True
    with pytest.raises(RuntimeError, match="injected failure"):
        out.sum().backward()
    LinearFunction.fail_backward = False
    assert ti.call.ACTIVE.module() is None
    managed(x).sum().backward()  # the next step runs
    assert x.grad is not None


def test_a_backward_that_raises_still_releases_the_planned_cache(ti, monkeypatch):
    """FSDP2_KEEP with microbatches and the microbatch cache option plans the
    cache's release after backward; a backward that raises must still mark
    it (GPU: tests/gpu/test_faults.py)."""
    from workspace_manager import FSDP2WorkspacePolicy, MicrobatchCache, Release, Sharding

    keep = Sharding.FSDP2_KEEP
    probe = SimpleNamespace(is_fsdp2=False, read=lambda: keep, current=lambda: keep, stale=lambda: False)
    managed = ti.modules.convert_model(TELinear(8, 8, seed=8))
    option = FSDP2WorkspacePolicy(microbatch_cache=MicrobatchCache.EXACT_FORMATS)
    managed.__dict__["_wm_state"] = ti.state.ModuleWorkspaceState(managed._wm_kind, option, probe=probe)
    x = torch.randn(4, 8, requires_grad=True)
    _, out = managed(x, is_first_microbatch=True), managed(x, is_first_microbatch=False)
    cached = managed._fp8_workspaces["weight"]
    assert Release.CACHED_WORKSPACE in ti.modules.last_plans(managed)["weight"][1].release
    monkeypatch.setattr(LinearFunction, "fault", lambda where, weight: where == "backward")
    with pytest.raises(InjectedFault):
        out.sum().backward()  # the step's first backward: nothing was marked before it
    assert managed._fp8_workspaces == {"weight": cached}  # dropped at the step's end, not before
    assert ti.model.release_step_caches(managed) == 1 and managed._fp8_workspaces == {}

# -- faults in nested modules (the GPU version: tests/gpu/test_nesting.py) ----------
#: scenario -> phases a fault is injected in: the forward (a checkpoint's
#: first pass), the forward a checkpoint replays in backward, the backward.
FAULT_PHASES = {
    "plain": ("forward", "backward"),
    "two_levels": ("forward", "backward"),
    "checkpoint": ("forward", "recompute", "backward"),
    "checkpoint_nonreentrant": ("forward", "recompute", "backward"),
}
FAULT_CASES = [(s, t, p) for s, phases in FAULT_PHASES.items() for t in ("stock", "drop_in") for p in phases]


def _nested(ti, scenario: str, managed: bool, target: str):
    """(model, the module the fault hits): a LoRA, or a LoRA whose adapter is
    a LoRA; converted except the innermost adapter. ``target``: that stock
    adapter, or the deepest drop-in (the outer LoRA, or the middle one)."""
    levels = 2 if scenario == "two_levels" else 1
    model = LoRA(seed=1, adapter=LoRA(seed=2)) if levels == 2 else LoRA(seed=1)
    innermost = ".".join(["adapter"] * levels)
    if managed:
        ti.modules.convert_model(model, module_filter=lambda mod, fqn: fqn != innermost)
    return model, model.get_submodule(innermost if target == "stock" else ".".join(["adapter"] * (levels - 1)))


def _fail_in(phase: str, weights: tuple) -> object:
    def fault(where: str, weight: torch.Tensor) -> bool:
        if where == "forward" and in_recompute_phase():
            where = "recompute"
        return where == phase and any(weight is w for w in weights)

    return fault


@pytest.mark.parametrize("scenario,target,phase", FAULT_CASES)
def test_a_fault_in_a_nested_module_leaves_nothing_active(ti, monkeypatch, scenario, target, phase):
    """A clean step, a step whose ``target`` raises in ``phase`` (the stock
    twin fails the same way), two clean steps: nothing active after the
    fault, the drop-ins' per-call state empty, the same numbers as stock,
    and every cache holding its own module's weight."""
    (stock, stock_target), (managed, managed_target) = (_nested(ti, scenario, m, target) for m in (False, True))
    expected, got = _train(stock, 1, scenario), _train(managed, 1, scenario)
    monkeypatch.setattr(LinearFunction, "fault", _fail_in(phase, (stock_target.weight, managed_target.weight)))
    for model in (stock, managed):
        with pytest.raises(InjectedFault, match="injected failure"):
            _call(model, torch.randn(4, 8, requires_grad=True), scenario, True).sum().backward()
        assert ti.call.ACTIVE.module() is None
        for p in model.parameters():
            p.grad = None  # the failed step's partial gradients are discarded
    monkeypatch.setattr(LinearFunction, "fault", None)
    for module in managed.modules():
        if isinstance(module, ti.modules.ManagedModule):
            # Every call window closed: no record left on the stack, TE's is_fsdp2 back to the state's probe.
            assert ti.call.ACTIVE.record is None and "is_fsdp2" not in module.__dict__
    expected += _train(stock, 2, scenario, first_step=1)
    got += _train(managed, 2, scenario, first_step=1)
    assert len(expected) == len(got)
    for i, (a, b) in enumerate(zip(expected, got)):
        assert torch.equal(a, b), f"tensor {i} differs from stock (the fault came after step 1)"
    for module in managed.modules():
        for ws in module._fp8_workspaces.values():
            assert ws.source is module.weight
