"""``meaningful_plans`` and ``DrawnPlanPolicy`` (workspace_manager.testing.plans).

Every plan a shipped policy makes is among the meaningful ones (so the
rules do not leave out what TE itself does), every listed plan is one
WorkspacePlan accepts, and the drawn policy ties a non-reentrant first
pass to its recompute pass and allows cache reads only after a fill.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from workspace_manager import (
    RECIPE_PROFILES,
    CacheAction,
    Microbatch,
    RecomputePass,
    WorkspaceContext,
    select_policy,
)
from workspace_manager._context import valid_contexts
from workspace_manager.testing.invariants import SHIPPED_POLICIES
from workspace_manager.testing.plans import DrawnPlanPolicy, meaningful_plans


@pytest.mark.parametrize("recipe", sorted(RECIPE_PROFILES))
def test_every_shipped_plan_is_meaningful(recipe):
    for ctx in valid_contexts(RECIPE_PROFILES[recipe]):
        listed = meaningful_plans(ctx, cache_filled=True)
        assert listed, ctx
        for policy in (*SHIPPED_POLICIES, select_policy(ctx)):
            if policy.covers(ctx):
                assert policy.plan(ctx) in listed, (type(policy).__name__, ctx)


def _ctx(**fields) -> WorkspaceContext:
    return WorkspaceContext(capabilities=RECIPE_PROFILES["Float8CurrentScaling"], **fields)


def test_cache_reads_need_an_earlier_fill():
    later = _ctx(microbatch=Microbatch.LATER)
    reads = {CacheAction.REUSE, CacheAction.READ_ONLY}
    assert not reads & {p.cache for p in meaningful_plans(later, cache_filled=False)}
    policy = DrawnPlanPolicy(chooser=lambda ctx, plans: plans[-1])
    policy.plan(replace(later, microbatch=Microbatch.FIRST))  # the last candidate fills
    assert policy.plan(later).cache in reads


def test_a_non_reentrant_first_pass_saves_what_its_recompute_pass_saves():
    first = _ctx(recompute=RecomputePass.FIRST, grad_enabled=True, microbatch=Microbatch.FIRST)
    policy = DrawnPlanPolicy(chooser=lambda ctx, plans: plans[len(plans) // 2])
    plan = policy.plan(first)
    replay = policy.planned()[replace(first, recompute=RecomputePass.RECOMPUTE)]
    assert replace(plan, cache=replay.cache) == replay


def test_a_chooser_that_invents_a_plan_is_refused():
    from workspace_manager import InvalidPlanError

    invented = meaningful_plans(_ctx(microbatch=Microbatch.LATER), cache_filled=True)[-1]
    policy = DrawnPlanPolicy(chooser=lambda ctx, plans: invented)
    with pytest.raises(InvalidPlanError):
        policy.plan(_ctx())
