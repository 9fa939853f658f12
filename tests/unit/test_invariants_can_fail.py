"""Every shipped invariant can fire: each is fed a bad case and must raise.

A plan here is a valid ``WorkspacePlan`` (its ``__post_init__`` accepts it)
that breaks the invariant under test, so each invariant is shown to catch
something ``WorkspacePlan`` itself lets through. Invariants overlap: the bad
case of ``a_plan_that_does_not_save_leaves_backward_a_way_to_rebuild`` (a
saved workspace whose columnwise data a non-derivable format would have to
derive) also breaks ``never_derives_what_the_format_cannot_derive``.
"""

from __future__ import annotations

import pytest

from workspace_manager import (
    BackwardOverride,
    BackwardSource,
    CacheAction,
    ColumnwiseSource,
    FSDP2WorkspacePolicy,
    PolicyMismatchError,
    RecomputePass,
    RecomputeWorkspacePolicy,
    Release,
    ShardGather,
    Sharding,
    Usage,
    WeightSource,
    WorkspaceContext,
    WorkspaceOrigin,
    WorkspacePlan,
    WorkspacePolicy,
)
from workspace_manager._profiles import FLOAT8_CURRENT_SCALING, FLOAT8_DELAYED_SCALING, MXFP8
from workspace_manager.testing import invariants as inv

B, C, R, N = Usage.BOTH, Usage.COLUMNWISE, Usage.ROWWISE, Usage.NONE


def _plan(cache, forward, source, usage, columnwise, release=Release.NOTHING, keeps=N, notes=()):
    return WorkspacePlan(cache, forward, source, usage, columnwise, release, keeps, notes)


def _ctx(caps=FLOAT8_CURRENT_SCALING, **kw):
    return WorkspaceContext(capabilities=caps, **kw)


SAVES_BOTH = _plan(CacheAction.BYPASS, B, BackwardSource.SAVED_WORKSPACE, C, ColumnwiseSource.FORWARD)
FILLS_BOTH = _plan(CacheAction.FILL, B, BackwardSource.SAVED_WORKSPACE, C, ColumnwiseSource.FORWARD)
DERIVES_ON_SAVE = _plan(CacheAction.BYPASS, R, BackwardSource.SAVED_WORKSPACE, C, ColumnwiseSource.DERIVED)
REQUANTIZES = _plan(CacheAction.BYPASS, R, BackwardSource.REQUANTIZE, C, ColumnwiseSource.REQUANTIZED)
UNUSED_COLUMNWISE = _plan(CacheAction.BYPASS, B, BackwardSource.NONE, N, ColumnwiseSource.NOT_NEEDED)
QP = dict(weight=WeightSource.QUANTIZED_PARAM)
PLAIN = WorkspacePolicy()
#: A quantized all-gather set up for an FSDP2 weight, and a workspace made from the shard.
GATHERED = dict(sharding=Sharding.FSDP2_RESHARD, shard_gather=ShardGather.MANY_RANKS)
FROM_THE_SHARD = WorkspacePlan(CacheAction.BYPASS, R, BackwardSource.SAVED_PARAMETER, C, ColumnwiseSource.DERIVED,
                               Release.DERIVED_COLUMNWISE, workspace_origin=WorkspaceOrigin.SHARD)

#: invariant -> (policy, context, plan, what the message says)
BAD_PLANS = {
    inv.fsdp2_resharding_never_caches: (PLAIN, _ctx(sharding=Sharding.FSDP2_RESHARD), FILLS_BOTH, "cache=fill"),
    inv.fsdp2_resharding_keeps_no_quantized_copy_outside_a_recompute_pass: (
        PLAIN, _ctx(sharding=Sharding.FSDP2_RESHARD), SAVES_BOTH, "saves backward_source=saved_workspace"),
    inv.never_derives_what_the_format_cannot_derive: (PLAIN, _ctx(MXFP8), DERIVES_ON_SAVE, "non-derivable"),
    inv.a_plan_that_does_not_save_leaves_backward_a_way_to_rebuild: (
        PLAIN, _ctx(MXFP8), DERIVES_ON_SAVE, "cannot derive columnwise"),
    inv.recompute_passes_never_write_a_cache: (
        PLAIN, _ctx(recompute=RecomputePass.RECOMPUTE), FILLS_BOTH, "recompute pass planned cache=fill"),
    inv.recompute_passes_quantize_once: (
        PLAIN, _ctx(recompute=RecomputePass.RECOMPUTE), REQUANTIZES, "requantizes in backward"),
    inv.inexact_region_recompute_rebuilds_as_the_inner_policy: (
        RecomputeWorkspacePolicy(inner=FSDP2WorkspacePolicy()),
        _ctx(FLOAT8_DELAYED_SCALING, sharding=Sharding.FSDP2_RESHARD, recompute=RecomputePass.RECOMPUTE),
        SAVES_BOTH, "the inner policy rebuilds in backward"),
    inv.region_recompute_rebuilds_as_te_unless_asked_to_build_once: (
        RecomputeWorkspacePolicy(inner=FSDP2WorkspacePolicy()),
        _ctx(sharding=Sharding.FSDP2_RESHARD, recompute=RecomputePass.RECOMPUTE),
        SAVES_BOTH, "recompute_copy is RecomputeCopy.AS_TE"),
    inv.no_grad_builds_no_columnwise_unless_a_first_pass_fills_a_cache: (
        PLAIN, _ctx(grad_enabled=False), UNUSED_COLUMNWISE, "no-grad forward"),
    inv.columnwise_built_in_forward_is_used: (PLAIN, _ctx(), UNUSED_COLUMNWISE, "dgrad never reads"),
    # the plan handed in is not the one the policy makes for the context
    inv.plans_are_deterministic_and_hashable: (PLAIN, _ctx(), UNUSED_COLUMNWISE, "two plans of one context differ"),
    inv.quantized_parameters_are_never_cached_or_requantized: (
        PLAIN, _ctx(**QP), _plan(CacheAction.FILL, R, BackwardSource.SAVED_PARAMETER, C, ColumnwiseSource.PARAMETER,
                                 keeps=B), "caches a quantized parameter"),
    inv.sharded_caches_do_not_outlive_the_step: (
        PLAIN, _ctx(sharding=Sharding.FSDP2_KEEP), FILLS_BOTH, "without releasing the cache"),
    inv.fsdp2_derived_data_is_released_whenever_backward_runs: (
        PLAIN, _ctx(sharding=Sharding.FSDP2_RESHARD, **QP),
        _plan(CacheAction.BYPASS, R, BackwardSource.SAVED_PARAMETER, C, ColumnwiseSource.DERIVED, keeps=R),
        "expected derived_columnwise in it"),
    inv.derived_data_is_released_only_for_formats_that_cache_it: (
        PLAIN, _ctx(MXFP8), _plan(CacheAction.BYPASS, R, BackwardSource.NONE, N, ColumnwiseSource.NOT_NEEDED,
                                  Release.DERIVED_COLUMNWISE), "a format that keeps none"),
    inv.high_precision_override_keeps_no_quantized_weight_for_backward: (
        PLAIN, _ctx(backward_override=BackwardOverride.HIGH_PRECISION), SAVES_BOTH, "backward reads columnwise"),
    inv.inference_has_no_backward: (
        PLAIN, _ctx(grad_enabled=False), _plan(CacheAction.BYPASS, R, BackwardSource.NONE, N,
                                               ColumnwiseSource.NOT_NEEDED, Release.CACHED_WORKSPACE),
        "no-grad call plans"),
    inv.unsafe_requantization_is_noted: (PLAIN, _ctx(FLOAT8_DELAYED_SCALING), REQUANTIZES, "without a note"),
    inv.a_workspace_is_made_from_the_shard_only_where_that_is_exact: (
        FSDP2WorkspacePolicy(), _ctx(FLOAT8_DELAYED_SCALING, **GATHERED), FROM_THE_SHARD,
        "makes the workspace from the shard, but float8_delayed_scaling does not quantize a shard"),
    inv.a_quantized_gather_set_up_but_not_used_is_noted: (
        FSDP2WorkspacePolicy(), _ctx(**GATHERED), REQUANTIZES, "made in the call, unexplained"),
}


def test_every_plan_invariant_has_a_bad_case():
    assert set(BAD_PLANS) == set(inv.PLAN_INVARIANTS)


@pytest.mark.parametrize("invariant", inv.PLAN_INVARIANTS, ids=lambda f: f.__name__)
def test_each_plan_invariant_fires_on_its_bad_case(invariant):
    policy, ctx, plan, message = BAD_PLANS[invariant]
    with pytest.raises(inv.InvariantViolation, match=message):
        invariant(policy, ctx, plan)


def test_a_rebuild_of_a_quantized_parameter_is_caught_twice():
    bad = _plan(CacheAction.BYPASS, R, BackwardSource.REQUANTIZE, C, ColumnwiseSource.REQUANTIZED, keeps=B)
    ctx = _ctx(**QP)
    with pytest.raises(inv.InvariantViolation, match="nothing high precision to requantize from"):
        inv.a_plan_that_does_not_save_leaves_backward_a_way_to_rebuild(PLAIN, ctx, bad)
    with pytest.raises(inv.InvariantViolation, match="requantizes a quantized parameter"):
        inv.quantized_parameters_are_never_cached_or_requantized(PLAIN, ctx, bad)


def test_select_policy_covers_fires_when_the_selection_is_wrong(monkeypatch):
    monkeypatch.setattr(inv, "select_policy", lambda ctx: PLAIN)
    with pytest.raises(inv.InvariantViolation, match="which does not cover the context"):
        inv.select_policy_covers_every_valid_context(_ctx(sharding=Sharding.FSDP2_KEEP))


class _PlansEverything(WorkspacePolicy):
    """Claims to cover nothing, but plans every call."""

    def covers(self, ctx):
        return False

    def check_context(self, ctx):
        return None


class _Anonymous(WorkspacePolicy):
    """Refuses with an error that does not name it."""

    def covers(self, ctx):
        return False

    def check_context(self, ctx):
        raise PolicyMismatchError("no")


@pytest.mark.parametrize(
    "policy, message", [(_PlansEverything(), "planned a context it does not cover"), (_Anonymous(), "does not name it")]
)
def test_a_policy_refuses_fires_on_a_policy_that_misreports(policy, message):
    with pytest.raises(inv.InvariantViolation, match=message):
        inv.a_policy_refuses_exactly_the_contexts_it_does_not_cover(_ctx(), (policy,))


def test_the_shipped_policies_pass_the_context_invariants():
    for ctx in inv.all_contexts(MXFP8):
        for invariant in inv.CONTEXT_INVARIANTS:
            invariant(ctx)
