"""LeanWorkspacePolicy: no quantized copy of a high-precision weight lives
from forward to backward, where requantizing is exact; elsewhere it plans
as the plain policy does."""

from __future__ import annotations

from dataclasses import replace

import pytest

from workspace_manager import (
    RECIPE_PROFILES,
    BackwardSource,
    CacheAction,
    LeanWorkspacePolicy,
    Microbatch,
    Sharding,
    Usage,
    WeightSource,
    WorkspaceContext,
    WorkspacePolicy,
)


def _ctx(recipe: str, **fields) -> WorkspaceContext:
    return WorkspaceContext(capabilities=RECIPE_PROFILES[recipe], sharding=Sharding.NONE, **fields)


@pytest.mark.parametrize("recipe", ["Float8CurrentScaling", "Float8BlockScaling", "MXFP8BlockScaling"])
@pytest.mark.parametrize("microbatch", list(Microbatch))
def test_exact_formats_keep_nothing_and_rebuild_columnwise(recipe, microbatch):
    plan = LeanWorkspacePolicy().plan(_ctx(recipe, microbatch=microbatch))
    assert plan.cache is CacheAction.BYPASS and plan.forward_usage == Usage.ROWWISE
    assert plan.backward_source is BackwardSource.REQUANTIZE and plan.backward_usage == Usage.COLUMNWISE
    assert plan.saves_quantized is False


@pytest.mark.parametrize("ctx", [
    _ctx("DelayedScaling"),  # a rebuild would use a newer scale
    _ctx("Float8CurrentScaling", weight=WeightSource.QUANTIZED_PARAM),
    _ctx("Float8CurrentScaling", grad_enabled=False),
], ids=["delayed", "quantized_param", "no_grad"])
def test_other_calls_are_planned_as_the_plain_policy_plans_them(ctx):
    assert LeanWorkspacePolicy().plan(ctx) == WorkspacePolicy().plan(ctx)


def test_lean_is_never_selected_by_default():
    from workspace_manager import select_policy

    ctx = _ctx("Float8CurrentScaling")
    assert type(select_policy(ctx)) is WorkspacePolicy
    assert select_policy(replace(ctx, microbatch=Microbatch.FIRST)).plan(
        replace(ctx, microbatch=Microbatch.FIRST)).cache is CacheAction.FILL
