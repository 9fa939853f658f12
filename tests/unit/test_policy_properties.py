"""Properties every plan of every shipped policy must have, on every context.

The properties themselves live in ``workspace_manager.testing.invariants``,
shipped with the package, so that ``check_quantizer`` runs exactly these on
a quantizer author's capabilities. The contexts are finitely many
(``_spaces``): each test checks its property on all of them, with every
shipped policy that plans each, rather than on drawn examples. An invariant
returns at once on a context it is not about.
"""

from __future__ import annotations

import pytest
from _spaces import FLAG_SETS, covering_plans, every_context, holds_for_each, selected_plans

from workspace_manager import CacheAction, Sharding, Usage, select_policy
from workspace_manager.testing import invariants as inv


def _check(invariant) -> None:
    """``invariant`` holds for every plan of every shipped policy that plans a context."""
    assert holds_for_each(invariant, covering_plans()) > 100_000


def test_fsdp2_resharding_after_forward_never_caches():
    _check(inv.fsdp2_resharding_never_caches)


def test_fsdp2_resharding_keeps_no_quantized_copy_outside_a_recompute_pass():
    """TE#2681: a layer's quantized copy must not wait for backward. (A
    recompute pass feeds the backward that follows at once; a non-reentrant
    first pass saves what checkpointing drops and the recompute pass rebuilds.)"""
    _check(inv.fsdp2_resharding_keeps_no_quantized_copy_outside_a_recompute_pass)


def test_never_derives_what_the_format_cannot_derive():
    _check(inv.never_derives_what_the_format_cannot_derive)


def test_a_plan_that_does_not_save_leaves_backward_a_way_to_rebuild():
    _check(inv.a_plan_that_does_not_save_leaves_backward_a_way_to_rebuild)


def test_recompute_passes_never_write_a_cache():
    _check(inv.recompute_passes_never_write_a_cache)


def test_recompute_passes_quantize_once():
    """The recompute pass's workspace feeds the backward that follows at once,
    so it is never requantized there (unless backward gathers the weight anyway)."""
    _check(inv.recompute_passes_quantize_once)


def test_inexact_region_recompute_rebuilds_as_the_inner_policy():
    """Identical numerics with delayed scaling under FSDP2 and te.checkpoint."""
    _check(inv.inexact_region_recompute_rebuilds_as_the_inner_policy)


def test_region_recompute_rebuilds_as_te_unless_asked_to_build_once():
    """No peak over stock by default under FSDP2 and te.checkpoint (D3)."""
    _check(inv.region_recompute_rebuilds_as_te_unless_asked_to_build_once)


def test_no_grad_builds_no_columnwise_unless_a_first_pass_fills_a_cache():
    _check(inv.no_grad_builds_no_columnwise_unless_a_first_pass_fills_a_cache)


def test_columnwise_built_in_forward_is_used():
    """No waste: columnwise data built in forward is saved for dgrad or kept in a cache."""
    _check(inv.columnwise_built_in_forward_is_used)


def test_plans_are_deterministic_and_hashable():
    _check(inv.plans_are_deterministic_and_hashable)


def test_quantized_parameters_are_never_cached_or_requantized():
    _check(inv.quantized_parameters_are_never_cached_or_requantized)


def test_sharded_caches_do_not_outlive_the_step():
    _check(inv.sharded_caches_do_not_outlive_the_step)


def test_fsdp2_derived_data_is_released_whenever_backward_runs():
    """TE#2717: the backward gather derives columnwise data in memory FSDP2 cannot free."""
    _check(inv.fsdp2_derived_data_is_released_whenever_backward_runs)


def test_derived_data_is_released_only_for_formats_that_cache_it():
    _check(inv.derived_data_is_released_only_for_formats_that_cache_it)


def test_high_precision_override_keeps_no_quantized_weight_for_backward():
    _check(inv.high_precision_override_keeps_no_quantized_weight_for_backward)


def test_plans_that_requantize_an_unsafe_format_say_so():
    _check(inv.unsafe_requantization_is_noted)


def test_a_workspace_is_made_from_the_shard_only_where_that_is_exact():
    _check(inv.a_workspace_is_made_from_the_shard_only_where_that_is_exact)


def test_a_quantized_gather_set_up_but_not_used_is_noted():
    _check(inv.a_quantized_gather_set_up_but_not_used_is_noted)


def test_inference_has_no_backward():
    """For the policy select_policy picks (the others are checked above, with the plan invariants)."""
    def check(ctx, plan):
        inv.inference_has_no_backward(None, ctx, plan)

    assert holds_for_each(check, selected_plans()) > 10_000


def test_select_policy_covers_every_valid_context():
    assert holds_for_each(inv.select_policy_covers_every_valid_context, ((ctx,) for ctx in every_context())) > 10_000


def test_a_policy_refuses_exactly_the_contexts_it_does_not_cover():
    """Every shipped policy on every context. Whether a policy covers a
    context does not depend on the quantizer's name: one name suffices."""
    cases = ((ctx,) for ctx in every_context(FLAG_SETS))
    assert holds_for_each(inv.a_policy_refuses_exactly_the_contexts_it_does_not_cover, cases) > 5_000


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
    # ...and a loop over the contexts names the one it failed for.
    with pytest.raises(AssertionError, match=r"cache=fill\n  failed for: FSDP2WorkspacePolicy\(.*sharding=<Sharding.FSDP2"):
        holds_for_each(inv.fsdp2_resharding_never_caches, [(select_policy(ctx), ctx, caching)])


def test_sharded_quantized_parameters_keep_only_what_their_gather_needs():
    """Issue 7: an FSDP2 shard of a derivable format keeps rowwise data only
    (TE's hooks gather rowwise data and derive the rest); a format that
    cannot derive keeps both, since its gather sends both; whole parameters
    keep TE's behaviour; high-precision weights keep no quantized copy."""
    def check(policy, ctx, plan):
        keeps = plan.parameter_keeps
        if not ctx.is_quantized_param:
            assert keeps is Usage.NONE
        elif ctx.sharding.is_fsdp2 and ctx.capabilities.columnwise_derivable:
            assert keeps is Usage.ROWWISE
        else:
            assert keeps is Usage.BOTH

    holds_for_each(check, covering_plans())


def test_fsdp2_caches_only_what_requantizes_exactly():
    """Stock TE quantizes every microbatch again under FSDP2; a cached
    workspace gives the same numbers only if requantizing is exact."""
    def check(policy, ctx, plan):
        if ctx.sharding is Sharding.FSDP2_KEEP and plan.cache is not CacheAction.BYPASS:
            assert ctx.capabilities.requantization_safe

    holds_for_each(check, covering_plans())
