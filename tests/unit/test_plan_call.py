"""``plan_call``: the memoized context and plan the bindings use per call."""

from __future__ import annotations

import inspect
from dataclasses import astuple, fields, replace

import pytest
from hypothesis import given

from workspace_manager import (
    BackwardOverride,
    CallShape,
    FSDP2WorkspacePolicy,
    Microbatch,
    PlannedCall,
    PolicyMismatchError,
    RecomputePass,
    RecomputeScope,
    Sharding,
    WeightSource,
    WorkspaceContext,
    plan_call,
    resolve_policy,
)
from workspace_manager._profiles import FLOAT8_CURRENT_SCALING
from workspace_manager.testing.strategies import contexts, covering_policies


def _shape(ctx: WorkspaceContext) -> CallShape:
    return CallShape(*(getattr(ctx, f.name) for f in fields(ctx)))


@given(contexts())
def test_it_plans_exactly_what_the_selected_policy_plans(ctx):
    planned = plan_call(None, _shape(ctx))
    assert isinstance(planned, PlannedCall)
    assert planned.context == ctx
    assert planned.plan == resolve_policy(ctx).plan(ctx)


@given(covering_policies())
def test_a_pinned_policy_is_honoured(pair):
    policy, ctx = pair
    assert plan_call(policy, _shape(ctx)).plan == resolve_policy(ctx, policy).plan(ctx)


def test_a_call_shape_is_planned_once():
    shape = CallShape(FLOAT8_CURRENT_SCALING, Sharding.FSDP2_RESHARD, RecomputePass.NONE, RecomputeScope.REGION, True,
                      True, WeightSource.HIGH_PRECISION, Microbatch.NONE, BackwardOverride.NONE)
    first = plan_call(None, shape)
    assert plan_call(None, shape) is first
    assert plan_call(None, replace(shape)) is first  # an equal shape, not only the same object
    other = plan_call(None, replace(shape, microbatch=Microbatch.FIRST))
    assert other.context.microbatch is Microbatch.FIRST and other is not first


def test_errors_are_raised_on_every_call_not_memoized():
    shape = CallShape(FLOAT8_CURRENT_SCALING, Sharding.NONE, RecomputePass.NONE, RecomputeScope.REGION, True, True,
                      WeightSource.HIGH_PRECISION, Microbatch.NONE, BackwardOverride.NONE)
    for _ in range(2):
        with pytest.raises(PolicyMismatchError):
            plan_call(FSDP2WorkspacePolicy(), shape)


def test_invalid_arguments_fail_as_the_context_does():
    with pytest.raises(Exception) as direct:
        WorkspaceContext(capabilities=FLOAT8_CURRENT_SCALING, grad_enabled="yes")
    with pytest.raises(type(direct.value)):
        plan_call(None, CallShape(FLOAT8_CURRENT_SCALING, Sharding.NONE, RecomputePass.NONE, RecomputeScope.REGION,
                                  "yes", True, WeightSource.HIGH_PRECISION, Microbatch.NONE, BackwardOverride.NONE))


def test_argument_order_is_the_context_field_order():
    """A call shape holds the context's fields; one reordered or missing
    against the context would silently swap or drop them, so its fields are
    pinned to the dataclass's, in order."""
    ctx = WorkspaceContext(capabilities=FLOAT8_CURRENT_SCALING, sharding=Sharding.FSDP2_KEEP,
                           recompute=RecomputePass.FIRST, recompute_scope=RecomputeScope.MODULE, grad_enabled=True,
                           input_requires_grad=False,
                           weight=WeightSource.QUANTIZED_PARAM, microbatch=Microbatch.LATER,
                           backward_override=BackwardOverride.NONE)
    assert astuple(plan_call(None, _shape(ctx)).context) == astuple(ctx)
    assert list(inspect.signature(plan_call).parameters) == ["pinned", "shape"]
    assert [f.name for f in fields(CallShape)] == [f.name for f in fields(WorkspaceContext)]
