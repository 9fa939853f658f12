"""Hypothesis properties every plan of every shipped policy must have."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from workspace_manager import (
    BackwardOverride,
    BackwardSource,
    CacheAction,
    ColumnwiseSource,
    PolicyMismatchError,
    RecomputePass,
    Release,
    Sharding,
    Usage,
    WeightSource,
    select_policy,
)
from workspace_manager.testing.strategies import ALL_POLICIES, contexts, covering_policies


@given(covering_policies(contexts(sharding=st.just(Sharding.FSDP2_RESHARD))))
def test_fsdp2_resharding_after_forward_never_caches(pair):
    policy, ctx = pair
    assert policy.plan(ctx).cache is CacheAction.BYPASS


@given(covering_policies(contexts(sharding=st.just(Sharding.FSDP2_RESHARD), weight=st.just(WeightSource.HIGH_PRECISION))))
def test_fsdp2_resharding_keeps_no_quantized_copy_outside_a_recompute_pass(pair):
    """TE#2681: a layer's quantized copy must not wait for backward. (A
    recompute pass feeds the backward that follows at once; a non-reentrant
    first pass saves what checkpointing drops and the recompute pass rebuilds.)"""
    policy, ctx = pair
    plan = policy.plan(ctx)
    if ctx.recompute is RecomputePass.NONE or not ctx.grad_enabled:
        assert not plan.saves_quantized


@given(covering_policies())
def test_never_derives_what_the_format_cannot_derive(pair):
    policy, ctx = pair
    if policy.plan(ctx).columnwise_source is ColumnwiseSource.DERIVED:
        assert ctx.capabilities.columnwise_derivable


@given(covering_policies())
def test_a_plan_that_does_not_save_leaves_backward_a_way_to_rebuild(pair):
    policy, ctx = pair
    plan = policy.plan(ctx)
    if plan.backward_usage is Usage.NONE:
        return
    if plan.backward_source is BackwardSource.SAVED_WORKSPACE:
        # the saved workspace has the data, or it can be derived
        assert Usage.COLUMNWISE not in plan.backward_usage or (
            Usage.COLUMNWISE in plan.forward_usage or ctx.capabilities.columnwise_derivable
        )
    else:
        assert plan.backward_source in (
            BackwardSource.SAVED_PARAMETER,
            BackwardSource.REQUANTIZE,
            BackwardSource.REGATHER,
        )
        if plan.backward_source is BackwardSource.REQUANTIZE:
            assert not ctx.is_quantized_param, "nothing high precision to requantize from"


@given(covering_policies(contexts(recompute=st.just(RecomputePass.RECOMPUTE))))
def test_recompute_passes_never_write_a_cache(pair):
    policy, ctx = pair
    assert not policy.plan(ctx).cache.writes


@given(covering_policies(contexts(recompute=st.just(RecomputePass.RECOMPUTE))))
def test_recompute_passes_quantize_once(pair):
    """The recompute pass's workspace feeds the backward that follows at once,
    so it is never requantized there (unless backward gathers the weight anyway)."""
    policy, ctx = pair
    plan = policy.plan(ctx)
    if ctx.sharding is not Sharding.DISTRIBUTED_WEIGHT:
        assert plan.backward_source is not BackwardSource.REQUANTIZE


@given(covering_policies())
def test_no_grad_builds_no_columnwise_unless_a_first_pass_fills_a_cache(pair):
    policy, ctx = pair
    plan = policy.plan(ctx)
    if not ctx.grad_enabled and Usage.COLUMNWISE in plan.forward_usage:
        assert ctx.recompute is RecomputePass.FIRST and plan.cache.writes


@given(covering_policies())
def test_columnwise_built_in_forward_is_used(pair):
    """No waste: columnwise data built in forward is saved for dgrad or kept in a cache."""
    policy, ctx = pair
    plan = policy.plan(ctx)
    if Usage.COLUMNWISE in plan.forward_usage:
        assert plan.columnwise_source is ColumnwiseSource.FORWARD or plan.cache.writes


@given(covering_policies())
def test_plans_are_deterministic_and_hashable(pair):
    policy, ctx = pair
    first, second = policy.plan(ctx), policy.plan(ctx)
    assert first == second and hash(first) == hash(second)
    assert {first: 1}[second] == 1
    assert hash(ctx) == hash(ctx)


@given(covering_policies(contexts(weight=st.just(WeightSource.QUANTIZED_PARAM))))
def test_quantized_parameters_are_never_cached_or_requantized(pair):
    policy, ctx = pair
    plan = policy.plan(ctx)
    assert plan.cache is CacheAction.BYPASS
    assert plan.backward_source is not BackwardSource.REQUANTIZE


@given(covering_policies())
def test_sharded_caches_do_not_outlive_the_step(pair):
    policy, ctx = pair
    plan = policy.plan(ctx)
    if ctx.sharding is not Sharding.NONE and plan.cache is not CacheAction.BYPASS and ctx.recompute is not RecomputePass.FIRST:
        assert Release.CACHED_WORKSPACE in plan.release


@given(covering_policies(contexts(sharding=st.sampled_from([Sharding.FSDP2_RESHARD, Sharding.FSDP2_KEEP]),
                                  weight=st.just(WeightSource.QUANTIZED_PARAM))))
def test_fsdp2_derived_data_is_released_whenever_backward_runs(pair):
    """TE#2717: the backward gather derives columnwise data in memory FSDP2 cannot free."""
    policy, ctx = pair
    plan = policy.plan(ctx)
    # A reentrant first pass runs without grad; a non-reentrant one (grad on)
    # is the pass whose autograd nodes backward runs.
    backward_runs = ctx.grad_enabled
    expected = backward_runs and ctx.capabilities.derived_caches
    assert (Release.DERIVED_COLUMNWISE in plan.release) is expected


@given(covering_policies(contexts(backward_override=st.just(BackwardOverride.HIGH_PRECISION))))
def test_high_precision_override_keeps_no_quantized_weight_for_backward(pair):
    policy, ctx = pair
    plan = policy.plan(ctx)
    assert plan.backward_usage is Usage.NONE
    if ctx.recompute is not RecomputePass.FIRST or not plan.cache.writes:
        assert Usage.COLUMNWISE not in plan.forward_usage


@given(contexts())
def test_inference_has_no_backward(ctx):
    plan = select_policy(ctx).plan(ctx)
    if not ctx.grad_enabled:
        assert plan.backward_source is BackwardSource.NONE and plan.release is Release.NOTHING


@given(contexts())
def test_select_policy_covers_every_valid_context(ctx):
    policy = select_policy(ctx)
    assert policy.covers(ctx)
    policy.plan(ctx)  # never raises for a valid context


@given(contexts(), st.sampled_from(ALL_POLICIES))
def test_a_policy_refuses_exactly_the_contexts_it_does_not_cover(ctx, policy):
    if policy.covers(ctx):
        policy.plan(ctx)
    else:
        try:
            policy.plan(ctx)
        except PolicyMismatchError as err:
            assert type(policy).__name__ in str(err)
        else:
            raise AssertionError(f"{policy!r} planned a context it does not cover: {ctx}")
