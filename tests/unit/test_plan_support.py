"""Which valid plans the binding carries out, and the clear refusal of the
rest (te_integration/runtime/_plan_support.py), on CPU against a stand-in TE.

Also D9 (a backward rebuild builds only what dgrad reads) and D7 (a TE
distributed weight is planned by the policy), driven through the public
``forward`` of a converted stand-in module.
"""

from __future__ import annotations

import importlib
import itertools
from dataclasses import dataclass

import pytest
import torch
from _fake_te import LinearFunction, TELinear, load_full_binding

from workspace_manager import (
    BackwardOverride,
    BackwardSource,
    CacheAction,
    ColumnwiseSource,
    LeanWorkspacePolicy,
    Microbatch,
    PolicyMismatchError,
    RecomputeWorkspacePolicy,
    RecomputePass,
    RecomputeScope,
    Sharding,
    UnsupportedPlanError,
    Usage,
    WeightSource,
    WorkspaceContext,
    WorkspacePolicy,
)
from workspace_manager.extending import PROFILES
from workspace_manager._explain import POLICY_CHOICES, _policy_choices


@pytest.fixture
def ti(monkeypatch):
    LinearFunction.fail_backward = False
    LinearFunction.rebuilt.clear()
    ti = load_full_binding(monkeypatch)
    # Loaded with the binding (``_state`` imports them), against the same stand-in.
    ti.plan_support = importlib.import_module("te_integration.runtime._plan_support")
    ti.rebuild = importlib.import_module("te_integration.runtime._rebuild")
    return ti


def _contexts():
    for caps, fields in itertools.product(PROFILES.values(), itertools.product(
            Sharding, RecomputePass, RecomputeScope, (True, False), (True, False), WeightSource, Microbatch,
            BackwardOverride)):
        sharding, recompute, scope, grad, input_rg, weight, microbatch, override = fields
        try:
            yield WorkspaceContext(capabilities=caps, sharding=sharding, recompute=recompute, recompute_scope=scope,
                                   grad_enabled=grad, input_requires_grad=input_rg, weight=weight,
                                   microbatch=microbatch, backward_override=override)
        except ValueError:
            continue  # an impossible context (e.g. a recompute pass without grad)


@pytest.mark.parametrize("name", POLICY_CHOICES)
def test_every_plan_of_a_shipped_policy_is_carried_out(ti, name):
    policy, planned = _policy_choices()[name], 0
    for ctx in _contexts():
        if not policy.covers(ctx):
            continue
        try:
            plan = policy.plan(ctx)
        except PolicyMismatchError:
            continue
        planned += 1
        assert ti.plan_support.unsupported_reason(ctx, plan) is None, (ctx, plan.summary())
    assert planned > 100


@pytest.mark.parametrize("name", POLICY_CHOICES)
def test_a_shipped_policy_plans_both_passes_of_a_non_reentrant_checkpoint_alike(ti, name):
    from dataclasses import replace

    from workspace_manager import resolve_policy

    pinned, checked = _policy_choices()[name], 0
    for ctx in _contexts():
        if not (ctx.recompute is RecomputePass.FIRST and ctx.grad_enabled):
            continue
        again_ctx = replace(ctx, recompute=RecomputePass.RECOMPUTE)
        try:  # as the binding plans a call with this policy pinned
            first, again = resolve_policy(ctx, pinned).plan(ctx), resolve_policy(again_ctx, pinned).plan(again_ctx)
        except PolicyMismatchError:
            continue
        checked += 1
        assert ti.plan_support.recompute_mismatch_reason(first, again) is None, (ctx, first.summary(), again.summary())
    assert checked > 10


@dataclass(frozen=True)
class _RebuildsFirstSavesAgain(RecomputeWorkspacePolicy):
    """A user policy that plans a rebuild in a non-reentrant first pass and a
    saved workspace in the recompute pass (found by the GPU drawn-plan test:
    TE's backward failed on the mismatched saved tensors)."""

    def plan(self, ctx):
        if ctx.recompute is RecomputePass.FIRST and ctx.grad_enabled:
            return LeanWorkspacePolicy().plan(ctx.as_plain_forward())
        return super().plan(ctx)


def test_a_bypassed_first_pass_and_a_filling_recompute_pass_are_refused(ti):
    """The GPU drawn-plan case: same backward fields, forward rowwise only,
    a saved workspace with derived columnwise data; the first pass bypasses
    the cache and the recompute pass fills it."""
    from dataclasses import replace

    ctx = WorkspaceContext(capabilities=PROFILES["float8_delayed_scaling"], sharding=Sharding.NONE,
                           microbatch=Microbatch.FIRST)
    base = replace(WorkspacePolicy().plan(ctx), forward_usage=Usage.ROWWISE, columnwise_source=ColumnwiseSource.DERIVED)
    filling, bypass = replace(base, cache=CacheAction.FILL), replace(base, cache=CacheAction.BYPASS)
    assert ti.plan_support.recompute_mismatch_reason(filling, filling) is None
    reason = ti.plan_support.recompute_mismatch_reason(bypass, filling)
    assert reason is not None and "cache is bypass" in reason and "fill" in reason
    # Both usages built in forward: a cache entry and a fresh workspace save the same tensors.
    both = replace(filling, forward_usage=Usage.BOTH, columnwise_source=ColumnwiseSource.FORWARD)
    assert ti.plan_support.recompute_mismatch_reason(replace(both, cache=CacheAction.BYPASS), both) is None
    assert "forward_usage" in ti.plan_support.recompute_mismatch_reason(both, filling)


def test_a_non_reentrant_checkpoint_refuses_passes_that_keep_different_things(ti):
    from _fake_te import checkpoint

    managed = ti.modules.convert_model(TELinear(8, 8), policy=_RebuildsFirstSavesAgain())
    x = torch.randn(4, 8, requires_grad=True)
    with pytest.raises(UnsupportedPlanError, match=r"backward_source is requantize in a non-reentrant checkpoint's "
                                                   r"first pass but saved_workspace in its recompute pass"):
        checkpoint(managed, x, use_reentrant=False)
    assert ti.call.ACTIVE.module() is None
    # A reentrant checkpoint's first pass saves nothing: the same policy runs there.
    checkpoint(managed, x, use_reentrant=True).sum().backward()
    assert x.grad is not None


@dataclass(frozen=True)
class _HighPrecisionDgrad(WorkspacePolicy):
    """A user policy asking for a high-precision dgrad without TE's override."""

    def backward_source(self, ctx, cache):
        return BackwardSource.HIGH_PRECISION if ctx.needs_dgrad else super().backward_source(ctx, cache)


@dataclass(frozen=True)
class _SavesWithoutGrad(WorkspacePolicy):
    """A user policy that keeps a workspace for a backward that never comes."""

    def backward_source(self, ctx, cache):
        return BackwardSource.SAVED_WORKSPACE


def test_a_plan_te_cannot_carry_out_is_refused_naming_the_field_before_te_runs(ti, monkeypatch):
    gemms = []
    file = ti.files["linear"]
    gemm = file.general_gemm
    monkeypatch.setattr(file, "general_gemm", lambda *a, **k: gemms.append(a) or gemm(*a, **k))
    managed = ti.modules.convert_model(TELinear(8, 8), policy=_HighPrecisionDgrad())
    with pytest.raises(UnsupportedPlanError, match=r"backward_source=high_precision needs backward_override"):
        managed(torch.randn(4, 8, requires_grad=True))
    assert gemms == []  # refused at planning: TE's forward never ran
    assert ti.call.ACTIVE.module() is None


def test_the_refusal_names_the_context(ti):
    managed = ti.modules.convert_model(TELinear(8, 8), policy=_SavesWithoutGrad())
    with torch.no_grad(), pytest.raises(UnsupportedPlanError, match=r"grad is off.*Context: WorkspaceContext"):
        managed(torch.randn(4, 8))
    assert issubclass(UnsupportedPlanError, PolicyMismatchError)  # callers catching the old error still do


@pytest.mark.parametrize("field, plan_fields, reason", [
    ("backward_source", dict(backward_source=BackwardSource.SAVED_PARAMETER,
                             columnwise_source=ColumnwiseSource.PARAMETER), "needs a quantized parameter"),
    ("cache", dict(cache=CacheAction.FILL), "never caches a quantized parameter"),
    ("parameter_keeps", dict(parameter_keeps=Usage.ROWWISE), "trims FSDP2 shards only"),
])
def test_unsupported_reason_names_the_field(ti, field, plan_fields, reason):
    from dataclasses import replace

    weight = WeightSource.HIGH_PRECISION if field == "backward_source" else WeightSource.QUANTIZED_PARAM
    ctx = WorkspaceContext(capabilities=PROFILES["float8_current_scaling"], sharding=Sharding.NONE, weight=weight)
    plan = WorkspacePolicy().plan(ctx)
    assert ti.plan_support.unsupported_reason(ctx, plan) is None
    changed = replace(plan, **plan_fields)
    refusal = ti.plan_support.unsupported_reason(ctx, changed)
    assert reason in refusal and field in refusal


def test_a_backward_rebuild_builds_only_the_columnwise_data_dgrad_reads(ti):
    managed = ti.modules.convert_model(TELinear(8, 8, seed=3), policy=LeanWorkspacePolicy())
    x = torch.randn(4, 8, requires_grad=True)
    managed(x).sum().backward()
    _, plan = ti.modules.last_plans(managed)["weight"]
    assert plan.backward_source is BackwardSource.REQUANTIZE and plan.backward_usage.label == "columnwise"
    assert LinearFunction.rebuilt == [{"rowwise": False, "columnwise": True}]
    q = managed.quantizer  # left as TE's own rebuild leaves it
    assert (q.rowwise_usage, q.columnwise_usage) == (True, True)
    stock = TELinear(8, 8, seed=3)
    x2 = x.detach().clone().requires_grad_()
    stock(x2).sum().backward()
    assert torch.equal(x.grad, x2.grad)


def test_a_distributed_weight_is_planned_by_its_policy_and_never_cached(ti, monkeypatch):
    monkeypatch.setattr(ti.call.te, "is_distributed_weight", lambda w: bool(getattr(w, "is_distributed_weight", 0)))
    managed = ti.modules.convert_model(TELinear(8, 8, seed=5))
    managed.weight.is_distributed_weight = True
    for first in (True, False):
        managed(torch.randn(4, 8, requires_grad=True), is_first_microbatch=first).sum().backward()
        ctx, plan = ti.modules.last_plans(managed)["weight"]
        assert ctx.sharding is Sharding.DISTRIBUTED_WEIGHT
        assert plan.backward_source is BackwardSource.REGATHER and plan.cache is CacheAction.BYPASS
    assert managed._fp8_workspaces == {}
    assert managed.calls[-1].is_fsdp2 is True  # TE keeps nothing from forward


class _NoColumnwiseOnly:
    """A quantizer whose kernel cannot build columnwise data alone (TE 2.20's
    per-tensor FP8 raises NotImplementedError for that)."""

    def __init__(self) -> None:
        self.rowwise_usage = self.columnwise_usage = True
        self.calls = 0

    def set_usage(self, *, rowwise=None, columnwise=None):
        self.rowwise_usage, self.columnwise_usage = rowwise, columnwise

    def __call__(self, tensor):
        self.calls += 1
        if not self.rowwise_usage:
            raise NotImplementedError("columnwise-only quantization is not implemented")
        return _Built(self.rowwise_usage, self.columnwise_usage)


@dataclass
class _Built:
    rowwise: bool
    columnwise: bool

    def update_usage(self, rowwise_usage=None, columnwise_usage=None):
        self.rowwise, self.columnwise = rowwise_usage, columnwise_usage


def test_a_format_that_cannot_build_columnwise_alone_builds_both_and_keeps_columnwise(ti):
    from workspace_manager import Usage

    quantizer = _NoColumnwiseOnly()
    rebuild = ti.rebuild.RebuildQuantizer(quantizer, Usage.COLUMNWISE)
    rebuild.set_usage(rowwise=True, columnwise=True)  # TE's request, ignored
    first, second = rebuild(torch.ones(2)), rebuild(torch.ones(2))
    assert (first.rowwise, first.columnwise) == (second.rowwise, second.columnwise) == (False, True)
    assert quantizer.calls == 3  # the narrow attempt once, then straight to both usages
    assert (quantizer.rowwise_usage, quantizer.columnwise_usage) == (True, True)
