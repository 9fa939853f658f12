"""Planning one recompute call derives the inner policy's view of it once.

Each question of the recompute policy used to derive the call as its inner
policy sees it again: 18 contexts for a recompute pass, 21 for a
non-reentrant first pass. Now ``plan`` derives it once: the call without its
pass, plus, at most, the step's real forward (a reentrant first pass runs
without grad) or the recompute pass that a non-reentrant first pass replays.
Where the workspace is made from the FSDP2 shard (``WorkspaceOrigin.SHARD``),
the call as the weight arrives from the all-gather is derived too, once for
the inner policy's plan and once for the pass's: two more at most.
"""

from __future__ import annotations

import pytest

from workspace_manager import (
    FSDP2WorkspacePolicy,
    RecomputePass,
    RecomputeWorkspacePolicy,
    Sharding,
    WorkspaceContext,
    WorkspaceOrigin,
    WorkspacePolicy,
    plan_call,
    select_policy,
)
from workspace_manager.extending import PROFILES
from workspace_manager._context import valid_contexts

#: Contexts one ``plan`` of a recompute call may build ...
MAX_PER_PLAN = 2
#: ... and of one whose workspace is made from the shard.
MAX_FROM_THE_SHARD = MAX_PER_PLAN + 2


@pytest.fixture
def built(monkeypatch):
    """A counter of the WorkspaceContexts constructed while it is read."""
    count = [0]
    original = WorkspaceContext.__post_init__

    def counting(self):
        count[0] += 1
        original(self)

    monkeypatch.setattr(WorkspaceContext, "__post_init__", counting)
    return count


def _recompute_contexts():
    for caps in PROFILES.values():
        for ctx in valid_contexts(caps, passes=[RecomputePass.FIRST, RecomputePass.RECOMPUTE]):
            yield ctx


def test_the_counter_counts(built):
    WorkspaceContext(capabilities=PROFILES["mxfp8"])
    assert built[0] == 1


def test_planning_a_recompute_call_builds_at_most_two_contexts(built):
    worst = {}
    for ctx in _recompute_contexts():
        policy = select_policy(ctx)
        assert isinstance(policy, RecomputeWorkspacePolicy)
        built[0] = 0
        plan = policy.plan(ctx)
        if plan.workspace_origin is WorkspaceOrigin.SHARD:
            assert built[0] <= MAX_FROM_THE_SHARD, ctx
            continue
        key = (ctx.recompute, ctx.grad_enabled)
        worst[key] = max(worst.get(key, 0), built[0])
    assert worst, "no recompute context was planned"
    assert max(worst.values()) <= MAX_PER_PLAN, worst
    # A recompute pass has grad and replays nothing: its plain view is all it builds.
    assert worst[(RecomputePass.RECOMPUTE, True)] == 1


def test_planning_a_call_outside_recompute_builds_no_context(built):
    for policy in (WorkspacePolicy(), RecomputeWorkspacePolicy(inner=WorkspacePolicy())):
        for ctx in valid_contexts(PROFILES["mxfp8"], shardings=[Sharding.NONE], passes=[RecomputePass.NONE]):
            built[0] = 0
            policy.plan(ctx)
            assert built[0] == 0, (policy, ctx)


def test_the_bindings_path_builds_at_most_two_beyond_the_call(built):
    """``plan_call`` plans from the context the binding built: it builds no
    copy of it, only what the recompute policy derives."""
    pinned = FSDP2WorkspacePolicy()
    for ctx in _recompute_contexts():
        if ctx.sharding not in pinned.shardings:
            continue
        built[0] = 0
        plan = plan_call(ctx, pinned)
        assert built[0] <= (MAX_FROM_THE_SHARD if plan.workspace_origin is WorkspaceOrigin.SHARD else MAX_PER_PLAN), ctx
