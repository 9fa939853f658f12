"""The whole binding on CPU against a stand-in TE: which module a call is
planned for, the memo of levers, and what survives a failing call.

A TE module called inside a drop-in's ``forward`` (a LoRA adapter left
stock, say) once ran under the drop-in's plan and wrote into its cache,
which changed the numbers silently. Each test here drives modules through
their public ``forward`` only.
"""

from __future__ import annotations

import pytest
import torch
from _fake_te import LinearFunction, TELinear, load_full_binding

MICROBATCHES = (True, False, False)


class LoRA(TELinear):
    """A user subclass whose forward adds a second TE Linear (the adapter)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(8, 8, seed=seed)
        self.adapter = TELinear(8, 8, seed=seed + 100)

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


def _train(model, steps: int = 3) -> list[torch.Tensor]:
    outs = []
    for step in range(steps):
        for i, first in enumerate(MICROBATCHES):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + i), requires_grad=True)
            out = model(x, is_first_microbatch=first)
            out.sum().backward()
            outs.append(out.detach())
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.01 * torch.ones_like(p)
    return outs


def test_stock_adapter_inside_a_drop_in_is_planned_as_itself(ti):
    stock, managed = LoRA(seed=1), LoRA(seed=1)
    ti.modules.convert_model(managed, module_filter=lambda mod, fqn: fqn != "adapter")
    assert type(managed.adapter) is TELinear and isinstance(managed, ti.modules._ManagedModule)
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
    assert ti.seams.ACTIVE.get() is None
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
    assert ti.seams.ACTIVE.get() is None


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
    assert ti.seams.ACTIVE.get() is None
    managed(x).sum().backward()  # the next step runs
    assert x.grad is not None
