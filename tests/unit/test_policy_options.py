"""The shipped policies' options, off by default (docs/decisions.md, D3 and D4).

``FSDP2WorkspacePolicy(microbatch_cache=...)`` and
``RecomputeWorkspacePolicy(recompute_copy=...)``: each option changes the
plans of exactly the calls its section names, and no other; the defaults
plan those calls as TE does.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from _spaces import every_context, holds_for_each

import workspace_manager as wm
from workspace_manager import (
    BackwardSource,
    CacheAction,
    ContextTypeError,
    FSDP2WorkspacePolicy,
    KeepForBackwardWorkspacePolicy,
    Microbatch,
    MicrobatchCache,
    QuantizedGather,
    RecomputeCopy,
    RecomputePass,
    RecomputeScope,
    RecomputeWorkspacePolicy,
    Release,
    ShardGather,
    Sharding,
    Usage,
    WorkspaceContext,
    WorkspacePolicy,
    plan_call,
    select_policy,
)
from workspace_manager._profiles import FLOAT8_CURRENT_SCALING, FLOAT8_DELAYED_SCALING
from workspace_manager.extending import shard_gather_refusal
from workspace_manager.testing.invariants import every_option_on

CACHE = FSDP2WorkspacePolicy(microbatch_cache=MicrobatchCache.EXACT_FORMATS)
FSDP2 = FSDP2WorkspacePolicy()


def _fsdp2_contexts(*passes: RecomputePass):
    """Every FSDP2 context (``_spaces``) in one of ``passes``."""
    return ((ctx,) for ctx in every_context() if ctx.sharding.is_fsdp2 and ctx.recompute in passes)


def test_the_options_are_public_enums_and_off_by_default():
    assert {"MicrobatchCache", "RecomputeCopy"} <= set(wm.__all__)
    assert FSDP2.microbatch_cache is MicrobatchCache.OFF
    assert KeepForBackwardWorkspacePolicy().microbatch_cache is MicrobatchCache.OFF
    assert RecomputeWorkspacePolicy().recompute_copy is RecomputeCopy.AS_TE
    # Not an option that is off: the rule of the FSDP2 policy (D13), with ON and OFF to force it.
    assert FSDP2.quantized_gather is QuantizedGather.AUTO and "QuantizedGather" in wm.__all__


@pytest.mark.parametrize("make", [
    lambda: FSDP2WorkspacePolicy(microbatch_cache=True),
    lambda: KeepForBackwardWorkspacePolicy(microbatch_cache="exact_formats"),
    lambda: RecomputeWorkspacePolicy(inner=FSDP2, recompute_copy=RecomputeCopy.BUILD_ONCE.value),
    lambda: RecomputeWorkspacePolicy(inner=FSDP2, recompute_copy=MicrobatchCache.EXACT_FORMATS),
], ids=["bool", "string", "recompute-string", "other-enum"])
def test_an_option_must_be_a_member_of_its_enum(make):
    """A bool or a string would silently pick a branch."""
    with pytest.raises(ContextTypeError, match="expects one of"):
        make()


def test_policies_with_other_options_are_other_policies():
    """A binding's memo is per module and emptied when its pinned policy
    changes; a policy with an option on is another value, and plans otherwise."""
    assert CACHE != FSDP2 and hash(CACHE) != hash(FSDP2)
    ctx = WorkspaceContext(capabilities=FLOAT8_CURRENT_SCALING, sharding=Sharding.FSDP2_KEEP, microbatch=Microbatch.FIRST)
    assert plan_call(ctx, FSDP2).cache is CacheAction.BYPASS
    assert plan_call(ctx, CACHE).cache is CacheAction.FILL


def _made_from_the_shard(ctx: WorkspaceContext) -> bool:
    """The default FSDP2 policy makes the workspace from the shard (D13):
    no module cache then, whatever the options of the call in the call."""
    return ctx.shard_gather is ShardGather.MANY_RANKS and shard_gather_refusal(ctx) is None


def _caches(ctx: WorkspaceContext) -> bool:
    """The calls the microbatch cache option plans differently (D4)."""
    return (ctx.sharding is Sharding.FSDP2_KEEP and ctx.grad_enabled and ctx.capabilities.requantization_safe
            and not ctx.is_quantized_param and ctx.microbatch is not Microbatch.NONE
            and not _made_from_the_shard(ctx))


def test_the_microbatch_cache_changes_only_the_calls_it_caches():
    def check(ctx):
        default, cached = FSDP2.plan(ctx), CACHE.plan(ctx)
        assert default.cache is CacheAction.BYPASS and Release.CACHED_WORKSPACE not in default.release
        if not _caches(ctx):
            assert cached == default
            return
        assert cached.cache is (CacheAction.FILL if ctx.microbatch is Microbatch.FIRST else CacheAction.REUSE)
        assert Release.CACHED_WORKSPACE in cached.release
        assert not default.saves_quantized  # as TE: nothing outlives the microbatch's forward

    assert holds_for_each(check, _fsdp2_contexts(RecomputePass.NONE)) > 1_000


def test_the_default_fsdp2_policy_is_what_select_policy_picks():
    ctx = WorkspaceContext(capabilities=FLOAT8_CURRENT_SCALING, sharding=Sharding.FSDP2_KEEP, microbatch=Microbatch.FIRST)
    assert select_policy(ctx) == FSDP2
    assert select_policy(ctx).plan(ctx).cache is CacheAction.BYPASS


def _builds_once(ctx: WorkspaceContext) -> bool:
    """The calls RecomputeCopy.BUILD_ONCE plans differently (D3): both
    passes of a te.checkpoint region under FSDP2, for a high-precision
    weight whose backward reads quantized data, with a format that
    requantizes exactly (a non-reentrant first pass saves what the
    recompute pass saves)."""
    pass_with_backward = ctx.recompute is RecomputePass.RECOMPUTE or (
        ctx.recompute is RecomputePass.FIRST and ctx.grad_enabled)
    return (pass_with_backward and ctx.recompute_scope is RecomputeScope.REGION and ctx.sharding.is_fsdp2
            and ctx.capabilities.requantization_safe and not ctx.is_quantized_param and ctx.input_requires_grad
            and ctx.backward_override is not wm.BackwardOverride.HIGH_PRECISION and not _made_from_the_shard(ctx))


def test_building_once_changes_only_the_region_passes_of_exact_formats():
    default = RecomputeWorkspacePolicy(inner=FSDP2)
    once = replace(default, recompute_copy=RecomputeCopy.BUILD_ONCE)

    def check(ctx):
        plan, asked = default.plan(ctx), once.plan(ctx)
        if not _builds_once(ctx):
            assert asked == plan
            return
        assert asked != plan
        if ctx.recompute is RecomputePass.RECOMPUTE:
            assert plan.backward_source is BackwardSource.REQUANTIZE and Usage.COLUMNWISE not in plan.forward_usage
            assert asked.backward_source is BackwardSource.SAVED_WORKSPACE

    assert holds_for_each(check, _fsdp2_contexts(RecomputePass.FIRST, RecomputePass.RECOMPUTE)) > 1_000


def test_building_once_leaves_whole_weights_and_a_modules_own_recompute_alone():
    """Unsharded recompute passes and LayerNormMLP's own one keep their copy
    either way: that is TE's behaviour there."""
    for sharding, scope in [(Sharding.NONE, RecomputeScope.REGION), (Sharding.FSDP2_RESHARD, RecomputeScope.MODULE)]:
        ctx = WorkspaceContext(capabilities=FLOAT8_CURRENT_SCALING, sharding=sharding,
                               recompute=RecomputePass.RECOMPUTE, recompute_scope=scope)
        plans = {copy: select_policy(ctx).__class__(inner=select_policy(ctx).inner, recompute_copy=copy).plan(ctx)
                 for copy in RecomputeCopy}
        assert {p.backward_source for p in plans.values()} == {BackwardSource.SAVED_WORKSPACE}, sharding


def test_every_option_on_pins_every_option_for_a_sharding():
    policy = every_option_on(Sharding.FSDP2_KEEP)
    inner = replace(CACHE, quantized_gather=QuantizedGather.ON)
    assert policy == RecomputeWorkspacePolicy(inner=inner, recompute_copy=RecomputeCopy.BUILD_ONCE)
    assert every_option_on(Sharding.NONE).inner == WorkspacePolicy()
    ctx = WorkspaceContext(capabilities=FLOAT8_DELAYED_SCALING, sharding=Sharding.FSDP2_KEEP,
                           microbatch=Microbatch.FIRST)
    assert policy.plan(ctx).cache is CacheAction.BYPASS  # delayed scaling is never cached under FSDP2
    assert policy.plan(replace(ctx, capabilities=FLOAT8_CURRENT_SCALING)).cache is CacheAction.FILL


def test_the_options_are_shipped_by_name_for_tools_to_pin():
    """``explain --policy`` and the benchmarks' ``--policy`` take these names."""
    from workspace_manager._explain import POLICY_CHOICES

    assert {"POLICY_NAMES", "named_policy"} <= set(wm.__all__) and POLICY_CHOICES == wm.POLICY_NAMES
    assert wm.named_policy("fsdp2_microbatch_cache") == CACHE
    assert wm.named_policy("fsdp2_recompute_build_once") == RecomputeWorkspacePolicy(
        inner=FSDP2, recompute_copy=RecomputeCopy.BUILD_ONCE)
    assert wm.named_policy("fsdp2") == FSDP2  # the default, options off
    with pytest.raises(ValueError, match="no shipped policy is named 'nope'; choose from plain, fsdp2"):
        wm.named_policy("nope")


def test_a_policy_is_found_by_its_name_in_any_case_and_an_unknown_name_gets_a_hint():
    """As ``explain --policy`` takes them: any case. A name that is none is
    refused with the package's own error, a ValueError (as before it had one)
    and a KeyError (a failed lookup), naming the choices and the closest."""
    assert wm.named_policy("FSDP2") is wm.named_policy("fsdp2") is wm.named_policy("Fsdp2")
    assert wm.named_policy("FSDP2_Microbatch_Cache") == CACHE
    with pytest.raises(wm.UnknownPolicyError) as info:
        wm.named_policy("fsdp2_microbatch")
    assert isinstance(info.value, ValueError) and isinstance(info.value, KeyError)
    assert isinstance(info.value, wm.WorkspaceManagerError)
    assert str(info.value) == ("no shipped policy is named 'fsdp2_microbatch'; choose from " + ", ".join(wm.POLICY_NAMES)
                               + "; did you mean 'fsdp2_microbatch_cache'?")
    with pytest.raises(wm.UnknownPolicyError, match=r"expects a policy name \(a str\); received None \(NoneType\)"):
        wm.named_policy(None)
    with pytest.raises(wm.UnknownPolicyError) as info:
        wm.named_policy("zzz")
    assert "did you mean" not in str(info.value)
