"""``plan_call(ctx, pinned)``: a binding's one call from a context to its
plan, and the one description of a call it plans from, the frozen
:class:`WorkspaceContext` (its recompute pass included:
``as_recompute_pass``). The contexts are enumerated (``_spaces``)."""

from __future__ import annotations

import inspect
from dataclasses import fields

import pytest
from _spaces import FLAG_SETS, every_context, holds_for_each, selected_plans

import workspace_manager as wm
from workspace_manager import (
    ContextTypeError,
    FSDP2WorkspacePolicy,
    PolicyMismatchError,
    RecomputePass,
    RecomputeWorkspacePolicy,
    WorkspaceContext,
    plan_call,
)
from workspace_manager._profiles import FLOAT8_CURRENT_SCALING
from workspace_manager.testing.strategies import BASE_POLICIES


def test_it_plans_exactly_what_the_selected_policy_plans():
    def check(ctx, plan):
        assert plan_call(ctx) == plan

    assert holds_for_each(check, selected_plans()) > 10_000


def test_a_pinned_policy_plans_its_shardings_and_is_wrapped_for_recompute_passes():
    """Every shipped non-recompute policy, pinned, on every context of its
    shardings: a recompute pass is planned by the recompute wrapper around it."""
    def check(policy, ctx):
        planner = policy if ctx.recompute is RecomputePass.NONE else RecomputeWorkspacePolicy(inner=policy)
        assert plan_call(ctx, policy) == planner.plan(ctx)

    cases = ((p, ctx) for ctx in every_context(FLAG_SETS) for p in BASE_POLICIES if ctx.sharding in p.shardings)
    assert holds_for_each(check, cases) > 5_000


def test_errors_are_raised_on_every_call():
    ctx = WorkspaceContext(capabilities=FLOAT8_CURRENT_SCALING)
    for _ in range(2):
        with pytest.raises(PolicyMismatchError):
            plan_call(ctx, FSDP2WorkspacePolicy())


def test_it_plans_from_a_context_only():
    with pytest.raises(ContextTypeError, match="expects a WorkspaceContext; received tuple"):
        plan_call((FLOAT8_CURRENT_SCALING, wm.Sharding.NONE))
    with pytest.raises(ContextTypeError, match="expects a WorkspaceContext; received tuple"):
        plan_call((FLOAT8_CURRENT_SCALING, wm.Sharding.FSDP2_RESHARD), FSDP2WorkspacePolicy())
    assert list(inspect.signature(plan_call).parameters) == ["ctx", "pinned"]


def test_the_context_is_the_one_description_of_a_call():
    """No second type that copies its fields, and no memo in the core: a
    binding memoizes (``te_integration/runtime/_state.py``)."""
    assert "plan_call" in wm.__all__
    assert not {"CallShape", "PlannedCall"} & (set(wm.__all__) | set(dir(wm)))
    assert not hasattr(plan_call, "cache_info")


def test_the_recompute_pass_of_a_call_differs_from_it_in_the_pass_and_grad_only():
    """``as_recompute_pass``: the call as its checkpoint's recompute pass
    replays it, which a non-reentrant first pass is planned against."""
    def check(ctx):
        replay = ctx.as_recompute_pass()
        assert replay.recompute is RecomputePass.RECOMPUTE and replay.grad_enabled
        same = [f.name for f in fields(ctx) if f.name not in ("recompute", "grad_enabled")]
        assert [getattr(replay, f) for f in same] == [getattr(ctx, f) for f in same]

    assert holds_for_each(check, ((ctx,) for ctx in every_context(FLAG_SETS))) > 5_000
