"""Hypothesis properties every plan of every shipped policy must have.

The properties themselves live in ``workspace_manager.testing.invariants``,
shipped with the package, so that ``check_quantizer`` runs exactly these on
a quantizer author's capabilities. Each test draws the contexts its
property is about and calls the invariant.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from workspace_manager import (
    BackwardOverride,
    CacheAction,
    RecomputePass,
    Sharding,
    Usage,
    WeightSource,
    select_policy,
)
from workspace_manager.testing import invariants as inv
from workspace_manager.testing.strategies import ALL_POLICIES, capabilities, contexts, covering_policies


def _check(invariant, pair) -> None:
    policy, ctx = pair
    invariant(policy, ctx, policy.plan(ctx))


@given(covering_policies(contexts(sharding=st.just(Sharding.FSDP2_RESHARD))))
def test_fsdp2_resharding_after_forward_never_caches(pair):
    _check(inv.fsdp2_resharding_never_caches, pair)


@given(covering_policies(contexts(sharding=st.just(Sharding.FSDP2_RESHARD), weight=st.just(WeightSource.HIGH_PRECISION))))
def test_fsdp2_resharding_keeps_no_quantized_copy_outside_a_recompute_pass(pair):
    """TE#2681: a layer's quantized copy must not wait for backward. (A
    recompute pass feeds the backward that follows at once; a non-reentrant
    first pass saves what checkpointing drops and the recompute pass rebuilds.)"""
    _check(inv.fsdp2_resharding_keeps_no_quantized_copy_outside_a_recompute_pass, pair)


@given(covering_policies())
def test_never_derives_what_the_format_cannot_derive(pair):
    _check(inv.never_derives_what_the_format_cannot_derive, pair)


@given(covering_policies())
def test_a_plan_that_does_not_save_leaves_backward_a_way_to_rebuild(pair):
    _check(inv.a_plan_that_does_not_save_leaves_backward_a_way_to_rebuild, pair)


@given(covering_policies(contexts(recompute=st.just(RecomputePass.RECOMPUTE))))
def test_recompute_passes_never_write_a_cache(pair):
    _check(inv.recompute_passes_never_write_a_cache, pair)


@given(covering_policies(contexts(recompute=st.just(RecomputePass.RECOMPUTE))))
def test_recompute_passes_quantize_once(pair):
    """The recompute pass's workspace feeds the backward that follows at once,
    so it is never requantized there (unless backward gathers the weight anyway)."""
    _check(inv.recompute_passes_quantize_once, pair)


@given(covering_policies(contexts(recompute=st.just(RecomputePass.RECOMPUTE))))
def test_inexact_region_recompute_rebuilds_as_the_inner_policy(pair):
    """Identical numerics with delayed scaling under FSDP2 and te.checkpoint."""
    _check(inv.inexact_region_recompute_rebuilds_as_the_inner_policy, pair)


@given(covering_policies(contexts(recompute=st.just(RecomputePass.RECOMPUTE))))
def test_region_recompute_rebuilds_as_te_unless_asked_to_build_once(pair):
    """No peak over stock by default under FSDP2 and te.checkpoint (D3)."""
    _check(inv.region_recompute_rebuilds_as_te_unless_asked_to_build_once, pair)


@given(covering_policies())
def test_no_grad_builds_no_columnwise_unless_a_first_pass_fills_a_cache(pair):
    _check(inv.no_grad_builds_no_columnwise_unless_a_first_pass_fills_a_cache, pair)


@given(covering_policies())
def test_columnwise_built_in_forward_is_used(pair):
    """No waste: columnwise data built in forward is saved for dgrad or kept in a cache."""
    _check(inv.columnwise_built_in_forward_is_used, pair)


@given(covering_policies())
def test_plans_are_deterministic_and_hashable(pair):
    _check(inv.plans_are_deterministic_and_hashable, pair)


@given(covering_policies(contexts(weight=st.just(WeightSource.QUANTIZED_PARAM))))
def test_quantized_parameters_are_never_cached_or_requantized(pair):
    _check(inv.quantized_parameters_are_never_cached_or_requantized, pair)


@given(covering_policies())
def test_sharded_caches_do_not_outlive_the_step(pair):
    _check(inv.sharded_caches_do_not_outlive_the_step, pair)


@given(covering_policies(contexts(sharding=st.sampled_from([Sharding.FSDP2_RESHARD, Sharding.FSDP2_KEEP]),
                                  weight=st.just(WeightSource.QUANTIZED_PARAM))))
def test_fsdp2_derived_data_is_released_whenever_backward_runs(pair):
    """TE#2717: the backward gather derives columnwise data in memory FSDP2 cannot free."""
    _check(inv.fsdp2_derived_data_is_released_whenever_backward_runs, pair)


@given(covering_policies())
def test_derived_data_is_released_only_for_formats_that_cache_it(pair):
    _check(inv.derived_data_is_released_only_for_formats_that_cache_it, pair)


@given(covering_policies(contexts(backward_override=st.just(BackwardOverride.HIGH_PRECISION))))
def test_high_precision_override_keeps_no_quantized_weight_for_backward(pair):
    _check(inv.high_precision_override_keeps_no_quantized_weight_for_backward, pair)


@given(covering_policies(contexts(capabilities=capabilities().filter(lambda c: not c.requantization_safe))))
def test_plans_that_requantize_an_unsafe_format_say_so(pair):
    _check(inv.unsafe_requantization_is_noted, pair)


@given(contexts())
def test_inference_has_no_backward(ctx):
    policy = select_policy(ctx)
    inv.inference_has_no_backward(policy, ctx, policy.plan(ctx))


@given(contexts())
def test_select_policy_covers_every_valid_context(ctx):
    inv.select_policy_covers_every_valid_context(ctx)


@given(contexts(), st.sampled_from(ALL_POLICIES))
def test_a_policy_refuses_exactly_the_contexts_it_does_not_cover(ctx, policy):
    inv.a_policy_refuses_exactly_the_contexts_it_does_not_cover(ctx, (policy,))


def test_every_shipped_invariant_has_a_property_test_here():
    """The kit and these tests check the same list."""
    tested = {name.removeprefix("test_") for name in globals() if name.startswith("test_")}
    aliases = {
        "fsdp2_resharding_after_forward_never_caches": "fsdp2_resharding_never_caches",
        "plans_that_requantize_an_unsafe_format_say_so": "unsafe_requantization_is_noted",
    }
    tested |= {aliases[t] for t in tested if t in aliases}
    shipped = {f.__name__ for f in (*inv.PLAN_INVARIANTS, *inv.CONTEXT_INVARIANTS)}
    assert shipped <= tested, shipped - tested


def test_the_invariants_can_fail():
    """A plan that breaks an invariant is reported with a reason."""
    from workspace_manager import BackwardSource, CacheAction, ColumnwiseSource, Release, Usage, WorkspaceContext, WorkspacePlan
    from workspace_manager._profiles import MXFP8

    ctx = WorkspaceContext(capabilities=MXFP8, sharding=Sharding.FSDP2_RESHARD)
    caching = WorkspacePlan(CacheAction.FILL, Usage.BOTH, BackwardSource.SAVED_WORKSPACE, Usage.COLUMNWISE,
                            ColumnwiseSource.FORWARD, Release.NOTHING)
    with pytest.raises(inv.InvariantViolation, match="cache=fill"):
        inv.fsdp2_resharding_never_caches(select_policy(ctx), ctx, caching)
    with pytest.raises(AssertionError, match="saves backward_source=saved_workspace"):
        inv.fsdp2_resharding_keeps_no_quantized_copy_outside_a_recompute_pass(select_policy(ctx), ctx, caching)


@given(covering_policies())
def test_sharded_quantized_parameters_keep_only_what_their_gather_needs(pair):
    """Issue 7: an FSDP2 shard of a derivable format keeps rowwise data only
    (TE's hooks gather rowwise data and derive the rest); a format that
    cannot derive keeps both, since its gather sends both; whole parameters
    keep TE's behaviour; high-precision weights keep no quantized copy."""
    policy, ctx = pair
    keeps = policy.plan(ctx).parameter_keeps
    if not ctx.is_quantized_param:
        assert keeps is Usage.NONE
    elif ctx.sharding.is_fsdp2 and ctx.capabilities.columnwise_derivable:
        assert keeps is Usage.ROWWISE
    else:
        assert keeps is Usage.BOTH


@given(covering_policies(contexts(sharding=st.just(Sharding.FSDP2_KEEP))))
def test_fsdp2_caches_only_what_requantizes_exactly(pair):
    """Stock TE quantizes every microbatch again under FSDP2; a cached
    workspace gives the same numbers only if requantizing is exact."""
    policy, ctx = pair
    if policy.plan(ctx).cache is not CacheAction.BYPASS:
        assert ctx.capabilities.requantization_safe
