"""``plan_call``: the memoized context and plan the bindings use per call,
keyed by a :class:`CallShape` and returned as a :class:`PlannedCall`."""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import fields

import pytest
from hypothesis import given

import workspace_manager as wm
from workspace_manager import (
    BackwardOverride,
    CallShape,
    ContextTypeError,
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
    return CallShape(**{f.name: getattr(ctx, f.name) for f in fields(ctx)})


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
    shape = CallShape(capabilities=FLOAT8_CURRENT_SCALING, sharding=Sharding.FSDP2_RESHARD)
    first = plan_call(None, shape)
    assert plan_call(None, shape) is first
    # An equal shape built anew is the same key.
    assert plan_call(None, CallShape(capabilities=FLOAT8_CURRENT_SCALING, sharding=Sharding.FSDP2_RESHARD)) is first
    other = plan_call(None, dataclasses.replace(shape, microbatch=Microbatch.FIRST))
    assert other.context.microbatch is Microbatch.FIRST and other is not first
    # The pinned policy is part of the key.
    pinned = plan_call(FSDP2WorkspacePolicy(), shape)
    assert pinned is not first and plan_call(FSDP2WorkspacePolicy(), shape) is pinned


def test_errors_are_raised_on_every_call_not_memoized():
    shape = CallShape(capabilities=FLOAT8_CURRENT_SCALING)
    for _ in range(2):
        with pytest.raises(PolicyMismatchError):
            plan_call(FSDP2WorkspacePolicy(), shape)


def test_invalid_arguments_fail_as_the_context_does():
    with pytest.raises(Exception) as direct:
        WorkspaceContext(capabilities=FLOAT8_CURRENT_SCALING, grad_enabled="yes")
    for _ in range(2):
        with pytest.raises(type(direct.value)):
            plan_call(None, CallShape(capabilities=FLOAT8_CURRENT_SCALING, grad_enabled="yes"))


def test_a_shape_must_be_a_call_shape():
    with pytest.raises(ContextTypeError, match="expects a CallShape; received tuple"):
        plan_call(None, (FLOAT8_CURRENT_SCALING, Sharding.NONE))
    with pytest.raises(TypeError):
        plan_call(None, FLOAT8_CURRENT_SCALING, Sharding.NONE)  # the old positional form


def test_the_signature_is_pinned_and_the_shape_by_name():
    assert list(inspect.signature(plan_call).parameters) == ["pinned", "shape"]
    with pytest.raises(TypeError):
        CallShape(FLOAT8_CURRENT_SCALING, Sharding.NONE, RecomputePass.NONE, RecomputeScope.REGION, True, True,
                  WeightSource.HIGH_PRECISION, Microbatch.NONE, BackwardOverride.NONE, "one too many")


def test_a_call_shape_has_exactly_the_context_fields_and_defaults():
    """A field missing or with another default would plan another call than
    the context a binding describes."""
    shape_fields = [(f.name, f.type, f.default) for f in fields(CallShape)]
    context_fields = [(f.name, f.type, f.default) for f in fields(WorkspaceContext)]
    assert shape_fields == context_fields
    ctx = WorkspaceContext(capabilities=FLOAT8_CURRENT_SCALING, sharding=Sharding.FSDP2_KEEP,
                           recompute=RecomputePass.FIRST, recompute_scope=RecomputeScope.MODULE, grad_enabled=True,
                           input_requires_grad=False, weight=WeightSource.QUANTIZED_PARAM,
                           microbatch=Microbatch.LATER, backward_override=BackwardOverride.DEQUANTIZED)
    assert plan_call(None, _shape(ctx)).context == ctx
    assert plan_call(None, CallShape(capabilities=FLOAT8_CURRENT_SCALING)).context == WorkspaceContext(
        capabilities=FLOAT8_CURRENT_SCALING)


@given(contexts())
def test_call_shapes_and_planned_calls_are_frozen_hashable_values(ctx):
    shape = _shape(ctx)
    again = _shape(ctx)
    assert shape == again and hash(shape) == hash(again)
    assert dataclasses.replace(shape, grad_enabled=not ctx.grad_enabled) != shape
    planned = plan_call(None, shape)
    assert planned == PlannedCall(context=ctx, plan=planned.plan)
    assert hash(planned) == hash(PlannedCall(context=ctx, plan=planned.plan))
    for value, field_name in ((shape, "sharding"), (planned, "plan")):
        assert not hasattr(value, "__dict__")  # slots
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(value, field_name, None)


def test_both_are_exported():
    assert {"CallShape", "PlannedCall", "plan_call"} <= set(wm.__all__)
