"""KeepForBackwardWorkspacePolicy: under FSDP2, forward's columnwise copy of
a high-precision weight is kept for backward where requantizing is exact;
every other call is planned as FSDP2WorkspacePolicy plans it."""

from __future__ import annotations

from dataclasses import replace

import pytest
from _spaces import every_context, holds_for_each

from workspace_manager import (
    RECIPE_PROFILES,
    BackwardOverride,
    BackwardSource,
    CacheAction,
    ColumnwiseSource,
    FSDP2WorkspacePolicy,
    KeepForBackwardWorkspacePolicy,
    Microbatch,
    MicrobatchCache,
    PolicyMismatchError,
    RecomputePass,
    RecomputeWorkspacePolicy,
    Release,
    Sharding,
    Usage,
    WeightSource,
    WorkspaceContext,
    resolve_policy,
    select_policy,
)
from workspace_manager.testing import invariants as inv

KEEP = KeepForBackwardWorkspacePolicy()
FSDP2 = FSDP2WorkspacePolicy()


def _plain_calls():
    """Every FSDP2 context outside recompute (``_spaces``): the calls the policy plans itself."""
    return ((ctx,) for ctx in every_context() if ctx.sharding.is_fsdp2 and ctx.recompute is RecomputePass.NONE)


def _ctx(recipe: str, sharding: Sharding = Sharding.FSDP2_RESHARD, **fields) -> WorkspaceContext:
    return WorkspaceContext(capabilities=RECIPE_PROFILES[recipe], sharding=sharding, **fields)


@pytest.mark.parametrize("recipe", ["Float8CurrentScaling", "Float8BlockScaling", "MXFP8BlockScaling"])
@pytest.mark.parametrize("sharding", [Sharding.FSDP2_RESHARD, Sharding.FSDP2_KEEP])
def test_exact_formats_keep_the_forward_columnwise_copy_for_backward(recipe, sharding):
    plan = KEEP.plan(_ctx(recipe, sharding))
    assert plan.cache is CacheAction.BYPASS and plan.forward_usage == Usage.BOTH
    assert plan.backward_source is BackwardSource.SAVED_WORKSPACE and plan.backward_usage == Usage.COLUMNWISE
    assert plan.columnwise_source is ColumnwiseSource.FORWARD and plan.release is Release.NOTHING
    assert any("kept for this layer's backward" in note for note in plan.notes)
    # FSDP2's default rebuilds instead: that is the quantization the option saves.
    assert FSDP2.plan(_ctx(recipe, sharding)).backward_source is BackwardSource.REQUANTIZE


def test_dequantized_backward_keeps_the_rowwise_copy_it_reads():
    plan = KEEP.plan(_ctx("Float8CurrentScaling", backward_override=BackwardOverride.DEQUANTIZED))
    assert plan.forward_usage == Usage.ROWWISE and plan.backward_source is BackwardSource.SAVED_WORKSPACE
    assert plan.backward_usage == Usage.ROWWISE and plan.columnwise_source is ColumnwiseSource.NOT_NEEDED


def test_every_call_it_does_not_keep_for_is_planned_as_fsdp2():
    """Inexact quantizers (a kept copy would change dgrad), quantized
    parameters, no grad, no dgrad and high-precision dgrad: FSDP2's plan."""
    def check(ctx):
        kept = KEEP.plan(ctx)
        default = FSDP2.plan(ctx)
        if kept != default:
            assert ctx.capabilities.requantization_safe and not ctx.is_quantized_param
            assert default.backward_source is BackwardSource.REQUANTIZE
            assert kept.backward_source is BackwardSource.SAVED_WORKSPACE
            assert (kept.cache, kept.release, kept.parameter_keeps) == (default.cache, default.release,
                                                                         default.parameter_keeps)

    assert holds_for_each(check, _plain_calls()) > 1_000


def test_it_never_requantizes_where_requantizing_is_exact():
    def check(ctx):
        plan = KEEP.plan(ctx)
        if ctx.capabilities.requantization_safe and not ctx.is_quantized_param:
            assert plan.backward_source is not BackwardSource.REQUANTIZE

    assert holds_for_each(check, _plain_calls()) > 1_000


def test_microbatch_caching_is_fsdp2s_option_inherited():
    cache = MicrobatchCache.EXACT_FORMATS
    keep, fsdp2 = KeepForBackwardWorkspacePolicy(microbatch_cache=cache), FSDP2WorkspacePolicy(microbatch_cache=cache)
    for mb in (Microbatch.FIRST, Microbatch.LATER):
        ctx = _ctx("Float8CurrentScaling", Sharding.FSDP2_KEEP, microbatch=mb)
        assert keep.plan(ctx) == fsdp2.plan(ctx) and keep.plan(ctx).cache is not CacheAction.BYPASS
        # Off by default: no cache; forward's copy is kept for this microbatch's backward.
        default = KEEP.plan(ctx)
        assert default.cache is CacheAction.BYPASS and default.backward_source is BackwardSource.SAVED_WORKSPACE


@pytest.mark.parametrize("ctx", [
    _ctx("DelayedScaling"),  # the kept copy would carry the forward's scale
    _ctx("Float8CurrentScaling", weight=WeightSource.QUANTIZED_PARAM),
    _ctx("Float8CurrentScaling", grad_enabled=False),
    _ctx("Float8CurrentScaling", input_requires_grad=False),
    _ctx("Float8CurrentScaling", backward_override=BackwardOverride.HIGH_PRECISION),
], ids=["delayed", "quantized_param", "no_grad", "no_dgrad", "high_precision_dgrad"])
def test_named_exceptions_are_planned_as_fsdp2(ctx):
    assert KEEP.plan(ctx) == FSDP2.plan(ctx)


def test_it_plans_only_fsdp2_weights_and_says_what_to_do():
    with pytest.raises(PolicyMismatchError, match="KeepForBackwardWorkspacePolicy.*fully_shard"):
        KEEP.plan(WorkspaceContext(capabilities=RECIPE_PROFILES["Float8CurrentScaling"]))


def test_recompute_passes_wrap_it_and_keep_the_recompute_rules():
    ctx = _ctx("Float8CurrentScaling", recompute=RecomputePass.RECOMPUTE)
    policy = resolve_policy(ctx, KEEP)
    assert policy == RecomputeWorkspacePolicy(inner=KEEP)
    plan = policy.plan(ctx)
    assert plan.cache is CacheAction.BYPASS and plan.backward_source is BackwardSource.SAVED_WORKSPACE
    first = policy.plan(replace(ctx, recompute=RecomputePass.FIRST, grad_enabled=False))
    assert first.backward_source is BackwardSource.NONE and first.forward_usage == Usage.ROWWISE


def test_it_is_never_selected_by_default():
    for sharding in (Sharding.FSDP2_RESHARD, Sharding.FSDP2_KEEP):
        assert type(select_policy(_ctx("Float8CurrentScaling", sharding))) is FSDP2WorkspacePolicy


def test_the_invariant_suite_lists_it_and_exempts_only_its_exact_copies():
    assert KEEP in inv.SHIPPED_POLICIES and RecomputeWorkspacePolicy(inner=KEEP) in inv.SHIPPED_POLICIES
    check = inv.fsdp2_resharding_keeps_no_quantized_copy_outside_a_recompute_pass
    exact = _ctx("Float8CurrentScaling")
    check(KEEP, exact, KEEP.plan(exact))  # asked for: no violation
    with pytest.raises(inv.InvariantViolation, match="saves backward_source=saved_workspace"):
        check(FSDP2, exact, KEEP.plan(exact))  # the same plan from a policy that did not ask for it
    delayed = _ctx("DelayedScaling")
    with pytest.raises(inv.InvariantViolation, match="saves backward_source=saved_workspace"):
        check(KEEP, delayed, KEEP.plan(exact))  # never for a quantizer that does not requantize exactly


def test_every_plan_invariant_holds_on_every_fsdp2_context():
    # the contexts of the two FSDP2 shardings, with and without a quantized all-gather set up
    per_profile = sum(c.sharding.is_fsdp2 for c in inv.all_contexts(RECIPE_PROFILES["DelayedScaling"]))
    assert inv.check_policy(KEEP, RECIPE_PROFILES.values()) == per_profile * len(RECIPE_PROFILES)
