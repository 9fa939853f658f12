"""te_integration's attribution layer on CPU, with a stand-in for TE.

CI has no TE, and ``te_integration.te._compat`` is the binding's only TE
import, so these tests give ``_attribution`` a stand-in ``_compat`` (TE's
module classes and quantized-tensor base class) and drive it with toy
modules that call the same hooks the seams call: a forward workspace made,
saved on the autograd graph, and dropped in backward.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import pytest
import torch
from _binding_standin import load_binding

from workspace_manager import Sharding, WorkspaceContext, select_policy
from workspace_manager.attribution import Lifetime, WorkspaceKind
from workspace_manager._profiles import FLOAT8_CURRENT_SCALING
from workspace_manager.testing.reference import Float8PerTensorQuantizer, Float8PerTensorWeight

class _QuantizedTensorStorage:
    """Stands for TE's QuantizedTensorStorage."""


class _TELinear(torch.nn.Module):
    """Stands for te.Linear (the recording hooks every instance)."""


@dataclass(eq=False)
class QWeight(Float8PerTensorWeight, _QuantizedTensorStorage):
    """The reference quantizer's weight, seen as a TE quantized tensor."""


@pytest.fixture
def attribution(monkeypatch):
    compat = {
        "QuantizedTensorStorage": _QuantizedTensorStorage,
        "TELinear": _TELinear,
        "TELayerNormLinear": type("_TELayerNormLinear", (torch.nn.Module,), {}),
        "TELayerNormMLP": type("_TELayerNormMLP", (torch.nn.Module,), {}),
        "TEGroupedLinear": type("_TEGroupedLinear", (torch.nn.Module,), {}),
    }
    loaded = load_binding(monkeypatch, compat, "runtime._attribution", "runtime._state", "runtime._levers",
                          "runtime._kind_registry")
    registry = loaded["runtime._kind_registry"]
    # Attribution finds TE modules through the kind registry (the kinds' files fill it).
    for kind, name in (("linear", "TELinear"), ("layernorm_linear", "TELayerNormLinear"),
                       ("layernorm_mlp", "TELayerNormMLP"), ("grouped_linear", "TEGroupedLinear")):
        drop_in = type(f"Managed{name}", (compat[name],), {"_wm_kind": registry.ModuleKind(kind)})
        registry.register(registry.Adapter(drop_in._wm_kind, compat[name], drop_in, op=registry.OpHooks(list)))
    loaded["runtime._attribution"].state_module = loaded["runtime._state"]
    loaded["runtime._attribution"].levers_module = loaded["runtime._levers"]
    return loaded["runtime._attribution"]


def _plan():
    ctx = WorkspaceContext(capabilities=FLOAT8_CURRENT_SCALING, sharding=Sharding.NONE)
    return select_policy(ctx).plan(ctx)


class _Matmul(torch.autograd.Function):
    """A GEMM that saves the quantized weight for backward, as TE's do."""

    @staticmethod
    def forward(ctx, x, weight, ws, attribution, owner):
        ctx.ws, ctx.attribution = ws, attribution
        if attribution.ACTIVE_RECORDINGS:
            attribution.tag(ctx, owner)
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad):
        # As the seams do: mark, run TE's backward (which drops the saved
        # workspace), mark again.
        ctx.attribution.backward_mark(ctx, "start")
        grad_x = _Matmul.te_backward(ctx, grad)
        ctx.attribution.backward_mark(ctx, "end")
        return grad_x, None, None, None, None

    @staticmethod
    def te_backward(ctx, grad):
        ws, ctx.ws = ctx.ws, None
        return grad @ (ws.columnwise.float().t() / ws.scale)


class ToyLinear(_TELinear):
    def __init__(self, attribution, *, managed: bool, leak: list | None = None) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(32, 16, generator=torch.Generator().manual_seed(1)))
        self.attribution, self.managed, self.leak = attribution, managed, leak
        self._fp8_workspaces: dict = {}

    def forward(self, x):
        q = Float8PerTensorQuantizer().quantize(self.weight, rowwise=True, columnwise=True)
        ws = QWeight(shape=q.shape, scale=q.scale, rowwise=q.rowwise, columnwise=q.columnwise)
        if self.attribution.ACTIVE_RECORDINGS:  # what the quantize_weight seam does
            if self.managed:
                self.attribution.forward_workspace(self, "weight", _plan(), ws, from_cache=False)
            else:
                self.attribution.forward_workspace(None, None, None, ws, from_cache=False, weight=self.weight)
        if self.leak is not None:
            self.leak.append(ws)
        return _Matmul.apply(x, self.weight, ws, self.attribution, self if self.managed else None)


WS_BYTES = 2 * 32 * 16 + 4  # rowwise + columnwise FP8 bytes and the float32 scale


def _train_one_step(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 16, requires_grad=True)
    model(x).sum().backward()
    opt.step()


def test_a_recorded_step_has_a_point_at_every_boundary(attribution):
    model = torch.nn.Sequential(ToyLinear(attribution, managed=True), torch.nn.Linear(32, 16),
                                ToyLinear(attribution, managed=True))
    with attribution.record_workspaces(model) as rec:
        _train_one_step(model)
    labels = [(p.label, p.module) for p in rec.timeline]
    assert labels == [("forward start", "0"), ("forward end", "0"), ("forward start", "2"), ("forward end", "2"),
                      ("backward start", "2"), ("backward end", "2"), ("backward start", "0"),
                      ("backward end", "0"), ("optimizer step", "")]
    totals = [p.total for p in rec.timeline]
    # Each layer's workspace is saved for its backward and dropped there.
    assert totals == [0, WS_BYTES, WS_BYTES, 2 * WS_BYTES, 2 * WS_BYTES, WS_BYTES, WS_BYTES, 0, 0]
    assert rec.timeline[3].by_module == {"0": WS_BYTES, "2": WS_BYTES}
    assert attribution.workspace_report(model).entries == ()


def test_saved_workspaces_carry_their_plan_and_a_leak_is_a_leftover(attribution):
    kept: list = []
    model = torch.nn.Sequential(ToyLinear(attribution, managed=True, leak=kept))
    with attribution.record_workspaces(model, timeline=False) as rec:
        _train_one_step(model)
    assert rec.timeline == []
    assert attribution.workspace_report(model).leftovers == ()  # a report of its own sees no seam
    report = rec.report()  # the recording's: what its seams saw, after the block too
    (left,) = report.leftovers
    assert left.record.module == "0" and left.record.weight == "weight"
    assert left.record.kind is WorkspaceKind.SAVED_FOR_BACKWARD and left.record.lifetime is Lifetime.BACKWARD
    assert left.nbytes == WS_BYTES and "cache=" in left.record.decision
    kept.clear()
    assert rec.report().leftovers == ()


def test_stock_modules_are_observed_without_a_plan(attribution):
    kept: list = []
    model = torch.nn.Sequential(ToyLinear(attribution, managed=False, leak=kept))
    with attribution.record_workspaces(model) as rec:
        _train_one_step(model)
    assert [p.total for p in rec.timeline][:2] == [0, WS_BYTES]
    (entry,) = rec.report().entries
    assert entry.record.kind is WorkspaceKind.UNPLANNED and entry.record.lifetime is Lifetime.UNPLANNED
    assert entry.record.weight == "weight" and not entry.leftover  # no plan, so nothing to hold it to


def test_cached_workspaces_are_found_by_inspection_with_recording_off(attribution):
    layer = ToyLinear(attribution, managed=True)
    q = Float8PerTensorQuantizer().quantize(layer.weight, rowwise=True, columnwise=False)
    layer._fp8_workspaces["weight"] = QWeight(shape=q.shape, scale=q.scale, rowwise=q.rowwise)
    state = attribution.state_module.ModuleWorkspaceState(attribution.state_module.ModuleKind("linear"))
    ctx = WorkspaceContext(capabilities=FLOAT8_CURRENT_SCALING, sharding=Sharding.NONE)
    state.remember(attribution.levers_module.levers_from_plan("weight", ctx, _plan()))
    layer.__dict__["_wm_state"] = state
    model = torch.nn.Sequential(layer)
    assert not attribution.ACTIVE_RECORDINGS
    (entry,) = attribution.workspace_report(model).entries
    assert entry.record.kind is WorkspaceKind.CACHED and entry.nbytes == 32 * 16 + 4
    assert entry.record.lifetime is Lifetime.KEPT
    del layer._fp8_workspaces["weight"], q  # q held the same storages
    gc.collect()
    assert attribution.workspace_report(model).entries == ()


def test_recording_is_off_outside_the_block_and_does_not_nest(attribution):
    model = torch.nn.Sequential(ToyLinear(attribution, managed=True))
    with attribution.record_workspaces(model):
        assert attribution.ACTIVE_RECORDINGS
        with pytest.raises(RuntimeError, match="already active"):
            with attribution.record_workspaces(model):
                pass
    assert not attribution.ACTIVE_RECORDINGS
    with attribution.record_workspaces(model) as rec:  # the hooks were removed: a new block starts clean
        pass
    assert rec.timeline == []


def test_quantized_parameter_data_is_found_with_the_drop_in_plan(attribution):
    """A drop-in's quantized parameter: its columnwise copy is reported with
    the plan the policy makes for it, even before the module's first forward."""
    from workspace_manager import Usage
    from workspace_manager.extending import default_registry
    from workspace_manager.testing.reference import REFERENCE_CAPABILITIES

    default_registry.register(Float8PerTensorQuantizer, REFERENCE_CAPABILITIES, override=True)
    try:
        q = Float8PerTensorQuantizer()
        w = q.quantize(torch.randn(32, 16), rowwise=True, columnwise=True)
        param = QWeight(shape=w.shape, scale=w.scale, rowwise=w.rowwise, columnwise=w.columnwise)
        param._quantizer = q

        class DropIn(_TELinear):
            # what state_of reads of a drop-in
            _wm_kind, _wm_state = attribution.state_module.ModuleKind("linear"), None

            def named_parameters(self, *args, **kwargs):  # a quantized parameter, as quantized_model_init makes
                yield "weight", param

        (entry,) = attribution.workspace_report(torch.nn.Sequential(DropIn())).entries
        assert entry.record.kind is WorkspaceKind.PARAMETER_COLUMNWISE and entry.usage is Usage.COLUMNWISE
        assert entry.nbytes == 32 * 16 and entry.record.lifetime is Lifetime.KEPT
        assert entry.record.decision.startswith("cache=bypass")
    finally:
        default_registry.unregister(Float8PerTensorQuantizer)


def test_fsdp2s_parameters_the_module_does_not_register_now_are_inspected(attribution):
    """While FSDP2 has a module's unsharded parameter in the shard's place (a
    forward, a kept gather), the shard's columnwise copy still holds bytes,
    and after the reshard the unsharded parameter's may: both are found
    through FSDP2's records of the module's parameters."""
    from types import SimpleNamespace

    from workspace_manager import Usage

    q = Float8PerTensorQuantizer()

    def quantized(rows: int):
        w = q.quantize(torch.randn(rows, 16), rowwise=True, columnwise=True)
        return QWeight(shape=w.shape, scale=w.scale, rowwise=w.rowwise, columnwise=w.columnwise)

    # A shard of 8 rows (its own copy), the unsharded parameter of 32, another module's parameter.
    shard, unsharded, other = SimpleNamespace(_local_tensor=quantized(8)), quantized(32), quantized(32)
    layer = ToyLinear(attribution, managed=False)
    del layer.weight
    layer.register_parameter("weight", None)
    records = [SimpleNamespace(module=layer, name="weight", sharded=shard, unsharded=unsharded),
               SimpleNamespace(module=torch.nn.Linear(2, 2), name="weight", sharded=None, unsharded=other)]
    ledger = attribution.WorkspaceLedger()
    attribution.inspect_module(layer, ledger, "0", records)
    found = sorted((e.record.kind.value, e.usage.label, e.nbytes) for e in ledger.live([layer]))
    assert found == sorted([(WorkspaceKind.GATHERED.value, Usage.ROWWISE.label, 32 * 16 + 4),
                            (WorkspaceKind.PARAMETER_COLUMNWISE.value, Usage.COLUMNWISE.label, 32 * 16),
                            (WorkspaceKind.PARAMETER_COLUMNWISE.value, Usage.COLUMNWISE.label, 8 * 16)])
