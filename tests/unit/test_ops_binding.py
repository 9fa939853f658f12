"""te.ops.BasicLinear under the policy (CPU, the te.ops stand-in ``_fake_te_ops``).

What each plan keeps for backward is read from the fuser's autograd ctx
(what ``prepare_for_saving`` split into it), and what backward rebuilds
from the stand-in's rebuild log; numerics are compared with a stock twin.
"""

from __future__ import annotations

import pytest
import torch

import _fake_te
import _fake_te_ops as ops
from _fake_te import load_full_binding
from workspace_manager import PolicyMismatchError, Sharding, Usage
from workspace_manager.testing.plans import DrawnPlanPolicy, FixedSharding

IN, OUT, TOKENS = 8, 6, 4


@pytest.fixture
def ti(monkeypatch):
    binding = load_full_binding(monkeypatch)
    ops.REBUILT.clear()
    ops.FORWARD.clear()
    monkeypatch.setitem(ops._STATE, "fuse", True)
    monkeypatch.setitem(ops._STATE, "override", None)
    return binding


def _sharded(ti, op, sharding: Sharding, policy=None) -> None:
    op.__dict__["_wm_state"] = ti.state.ModuleWorkspaceState(op._wm_kind, policy,
                                                             probe=FixedSharding(sharding, is_fsdp2=False))


def _step(model, seed: int = 0):
    x = torch.randn(TOKENS, IN, generator=torch.Generator().manual_seed(seed)).requires_grad_(True)
    out = model(x)
    saved = [t for t in out.grad_fn.saved_tensors if t is not None] if out.grad_fn is not None else []
    objects = getattr(out.grad_fn, "tensor_objects", [])
    out.square().sum().backward()
    return out, x.grad, [p.grad.clone() for p in model.parameters()], saved, objects


def _workspaces(objects) -> list:
    return [o for o in objects if isinstance(o, _fake_te.Workspace)]


def _model(kind: str, seed: int = 3):
    if kind == "alone":
        return ops.BasicLinear(IN, OUT, seed=seed)
    return ops.Sequential(ops.Linear(IN, OUT, seed=seed), ops.Linear(OUT, IN, bias=False, seed=seed + 1))


def _linears(model) -> list:
    return [m for m in model.modules() if isinstance(m, ops.BasicLinear)]


@pytest.mark.parametrize("kind", ["alone", "sequential"])
@pytest.mark.parametrize("sharding", [Sharding.NONE, Sharding.FSDP2_RESHARD])
def test_default_plans_are_carried_out_and_match_stock(ti, kind, sharding):
    stock, managed = _model(kind), _model(kind)
    ti.modules.convert_model(managed)
    assert all(type(op).__name__ == "OpsBasicLinear" for op in _linears(managed))
    for op in _linears(managed):
        _sharded(ti, op, sharding)
    want, got = _step(stock), _step(managed)
    for a, b in zip(want[:3], got[:3]):
        assert all(torch.equal(x, y) for x, y in zip(a, b)) if isinstance(a, list) else torch.equal(a, b)
    stock_ws, managed_ws = _workspaces(want[4]), _workspaces(got[4])
    assert len(stock_ws) == len(_linears(stock))  # stock te.ops saves a workspace per linear
    if sharding is Sharding.NONE:  # the columnwise copy only, as TE's own
        assert len(managed_ws) == len(_linears(managed))
        assert all(w._transpose is not None and w._data is None for w in managed_ws) and not ops.REBUILT
    else:  # nothing saved but the weight; backward quantizes columnwise only
        assert managed_ws == []
        assert all(any(t is op.weight for t in got[3]) for op in _linears(managed))
        assert ops.REBUILT == [{"rowwise": False, "columnwise": True}] * len(_linears(managed))
        assert ops.FORWARD[-len(_linears(managed)):] == [{"rowwise": True, "columnwise": False}] * len(
            _linears(managed))
    for op in _linears(managed):
        (context, plan), = ti.modules.last_plans(op).values()
        assert context.sharding is sharding
        assert plan.backward_usage is Usage.COLUMNWISE


def test_fusion_is_kept_after_conversion(ti, monkeypatch):
    fused = []
    original = ops.ForwardLinearBias.fuser_forward
    monkeypatch.setattr(ops.ForwardLinearBias, "fuser_forward",
                        lambda self, *a: fused.append(type(self.linear).__name__) or original(self, *a))
    managed = _model("sequential")
    ti.modules.convert_model(managed)
    _step(managed)
    assert fused == ["OpsBasicLinear"]


def test_stock_ops_run_te_unchanged_next_to_drop_ins(ti):
    stock, managed = _model("sequential"), _model("sequential")
    ti.modules.convert_model(managed, module_filter=lambda m, fqn: fqn.startswith("ops.0"))
    kinds = [type(op).__name__ for op in _linears(managed)]
    assert kinds == ["OpsBasicLinear", "BasicLinear"]
    assert ti.modules.last_plans(_linears(managed)[1]) == {}
    _sharded(ti, _linears(managed)[0], Sharding.FSDP2_RESHARD)
    want, got = _step(stock), _step(managed)
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    assert len(_workspaces(got[4])) == 1  # the stock op's


def test_managed_construction_builds_drop_in_ops(ti, monkeypatch):
    import sys

    compat = sys.modules["te_integration.te._compat"]
    for module, name in ((compat.mha_module, "Linear"), (compat.mha_module, "LayerNormLinear"),
                         (compat.transformer_module, "LayerNormMLP")):
        monkeypatch.setattr(module, name, None, raising=False)  # the stand-in's composite modules build none
    with ti.construction.managed_construction():
        inside = ops.Linear(IN, OUT)
    outside = ops.Linear(IN, OUT)
    assert type(inside.basic_ops[0]).__name__ == "OpsBasicLinear"
    assert type(outside.basic_ops[0]) is ops.BasicLinear


def test_a_plan_te_ops_cannot_carry_out_is_refused_by_name(ti):
    def keep_both(ctx, candidates):
        for plan in candidates:
            if plan.backward_source.value == "saved_workspace" and plan.forward_usage is Usage.ROWWISE:
                return plan
        return candidates[0]

    managed = _model("alone")
    ti.modules.convert_model(managed)
    _sharded(ti, managed, Sharding.NONE, DrawnPlanPolicy(chooser=keep_both))
    with pytest.raises(PolicyMismatchError) as err:
        _step(managed)
    text = str(err.value)
    assert "te.ops.BasicLinear" in text and "forward_usage=rowwise" in text and "Context" in text
    # Refused where the shape is planned (the kind's adapter), so the plan is never memoized.
    assert any(frame.name == "_require_kind_supports" for frame in err.traceback)
    assert ti.modules.workspace_state(managed).shapes_planned() == 0


def _usages(usage: Usage) -> dict:
    return {"rowwise": Usage.ROWWISE in usage, "columnwise": Usage.COLUMNWISE in usage}


@pytest.mark.parametrize("override", [None, "high_precision", "dequantized"])
@pytest.mark.parametrize("sharding", [Sharding.NONE, Sharding.FSDP2_RESHARD, Sharding.FSDP2_KEEP])
def test_the_default_policies_are_never_refused_for_te_ops(ti, sharding, override):
    ops._STATE["override"] = override
    stock, managed = _model("sequential"), _model("sequential")
    ti.modules.convert_model(managed)
    for op in _linears(managed):
        _sharded(ti, op, sharding)
    got, want = _step(managed), _step(stock)
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    with torch.no_grad():
        assert torch.equal(stock(torch.ones(TOKENS, IN)), managed(torch.ones(TOKENS, IN)))


def test_workspace_report_and_recording_cover_te_ops(ti):
    managed = _model("sequential")
    ti.modules.convert_model(managed)
    x = torch.randn(TOKENS, IN).requires_grad_(True)
    with ti.attribution.record_workspaces(managed) as recording:
        out = managed(x)
        during = recording.report()
        out.sum().backward()
        del out  # the graph, and with it what the ctx held
    names = sorted({e.record.module for e in during.entries})
    assert names == ["ops.0.basic_ops.0", "ops.1.basic_ops.0"], during.entries
    assert all(e.record.kind.value == "saved for backward" and "saved_workspace(columnwise)" in e.record.decision
               for e in during.entries)
    # After backward the columnwise copies are gone; what stays is the
    # stand-in's reference to the weight each was made from (``source``,
    # which the ledger counts as a rowwise buffer; TE's storages have none).
    after = ti.attribution.workspace_report(managed).entries
    assert all(e.usage is Usage.ROWWISE and e.nbytes == OUT * IN * 4 for e in after), after


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("sharding", [Sharding.NONE, Sharding.FSDP2_RESHARD])
def test_te_checkpoint_around_te_ops_matches_stock(ti, sharding, reentrant):
    stock, managed = _model("sequential"), _model("sequential")
    ti.modules.convert_model(managed)
    for op in _linears(managed):
        _sharded(ti, op, sharding)
    got, want = [], []
    for model, out in ((managed, got), (stock, want)):
        x = torch.randn(TOKENS, IN, generator=torch.Generator().manual_seed(2)).requires_grad_(True)
        y = _fake_te.checkpoint(model, x, use_reentrant=reentrant)
        y.square().sum().backward()
        out += [y, x.grad, *[p.grad for p in model.parameters()]]
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    passes = {ctx.recompute.value for op in _linears(managed) for ctx, _ in ti.modules.last_plans(op).values()}
    assert passes == {"recompute"}  # the last call of each op: the recompute pass in backward


def test_every_shipped_policy_plan_for_a_te_ops_call_is_carried_out():
    """The plans ``explain`` prints hold for te.ops as for the modules: every
    context a te.ops call can have (no microbatch position), under every
    shipped policy and quantizer profile, gets a plan te.ops carries out."""
    import importlib.util
    import itertools
    from pathlib import Path

    from workspace_manager import (BackwardOverride, Microbatch, RecomputePass, RecomputeScope, WeightSource,
                                   WorkspaceContext, named_policy, plan_call)
    from workspace_manager.extending import PROFILES

    path = Path(__file__).resolve().parents[2] / "te_integration" / "runtime" / "_plan_support_ops.py"
    spec = importlib.util.spec_from_file_location("_plan_support_ops", path)
    rules = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rules)
    names = [None, "plain", "fsdp2", "recompute", "fsdp2_recompute", "lean", "keep_for_backward",
             "fsdp2_microbatch_cache", "fsdp2_recompute_build_once"]
    checked = 0
    for name, caps, sharding, grad, input_grad, override, weight, recompute in itertools.product(
            names, PROFILES.values(), (Sharding.NONE, Sharding.FSDP2_RESHARD, Sharding.FSDP2_KEEP), (True, False),
            (True, False), (None, "high_precision", "dequantized"), tuple(WeightSource)[:2], tuple(RecomputePass)):
        if recompute is RecomputePass.RECOMPUTE and not grad:
            continue  # no such call: a recompute pass feeds a backward
        ctx = WorkspaceContext(capabilities=caps, sharding=sharding, recompute=recompute,
                               recompute_scope=RecomputeScope.REGION, grad_enabled=grad, input_requires_grad=input_grad,
                               weight=weight, microbatch=Microbatch.NONE,
                               backward_override=BackwardOverride.from_te(override))
        try:
            plan = plan_call(ctx, named_policy(name) if name else None)
        except PolicyMismatchError:
            continue  # the policy does not cover this context (a pinned FSDP2 policy on a whole weight)
        assert rules.ops_unsupported_reason(ctx, plan) is None, (name, ctx)
        checked += 1
    assert checked > 1000


def test_a_stock_grouped_linear_inside_a_te_ops_call_saves_as_te_does(ti, monkeypatch):
    """A stock te.GroupedLinear called inside a te.ops fuser call (an MoE
    block written as an op) finds the op's record on top of the stack: the
    grouped saving seam must leave its call to TE, whatever the record of
    another kind holds (it once read a GroupedLinear field that te.ops
    records never set: an AttributeError)."""
    import _fake_te_grouped as grouped

    managed = _model("alone")
    ti.modules.convert_model(managed)
    saved = []
    te_op_forward = type(managed).op_forward

    def op_forward(self, ctx, input_, **kwargs):
        assert ti.call.ACTIVE.record is not None and ti.call.ACTIVE.record.module is self
        saved.append(grouped._file().prepare_for_saving(input_.detach()))  # what TE's grouped forward calls
        return te_op_forward(self, ctx, input_, **kwargs)

    monkeypatch.setattr(type(managed), "op_forward", op_forward)
    _step(managed)
    assert grouped._file().prepare_for_saving.__module__ == "te_integration.kinds.grouped_linear"  # the seam ran
    (tensors, objects), = saved
    assert len(tensors) == 1 and objects == [None]  # TE's own result for one plain tensor
