"""Properties every plan of every shipped policy must have.

Each *plan invariant* takes ``(policy, ctx, plan)``, where ``policy``
covers ``ctx`` and ``plan = policy.plan(ctx)``, and raises
:class:`InvariantViolation` (an ``AssertionError``) when the plan breaks
it; an invariant that does not apply to the context returns at once. Each
*context invariant* takes a context alone. The core's property tests
(``tests/unit/test_policy_properties.py``) draw contexts with Hypothesis and
call these; :func:`~workspace_manager.testing.check_quantizer` runs them on
every context with a quantizer's capabilities (:func:`all_contexts`).

Needs nothing beyond the package (no Hypothesis).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from .._context import (
    valid_contexts,
    BackwardOverride,
    QuantizerCapabilities,
    RecomputePass,
    RecomputeScope,
    ShardGather,
    Sharding,
    WeightSource,
    WorkspaceContext,
)
from .._errors import PolicyMismatchError
from .._plan import BackwardSource, CacheAction, ColumnwiseSource, Release, Usage, WorkspaceOrigin, WorkspacePlan
from .._policy import (
    DistributedWeightWorkspacePolicy,
    FSDP2WorkspacePolicy,
    KeepForBackwardWorkspacePolicy,
    LeanWorkspacePolicy,
    MicrobatchCache,
    Policy,
    QuantizedGather,
    RecomputeCopy,
    RecomputeWorkspacePolicy,
    WorkspacePolicy,
    base_policy_for,
    shard_gather_refusal,
)
from .._selection import resolve_policy, select_policy

__all__ = [
    "InvariantViolation",
    "PlanInvariant",
    "ContextInvariant",
    "SHIPPED_POLICIES",
    "PLAN_INVARIANTS",
    "CONTEXT_INVARIANTS",
    "all_contexts",
    "covering",
    "every_option_on",
    "fsdp2_resharding_never_caches",
    "fsdp2_resharding_keeps_no_quantized_copy_outside_a_recompute_pass",
    "never_derives_what_the_format_cannot_derive",
    "a_plan_that_does_not_save_leaves_backward_a_way_to_rebuild",
    "recompute_passes_never_write_a_cache",
    "recompute_passes_quantize_once",
    "inexact_region_recompute_rebuilds_as_the_inner_policy",
    "region_recompute_rebuilds_as_te_unless_asked_to_build_once",
    "no_grad_builds_no_columnwise_unless_a_first_pass_fills_a_cache",
    "columnwise_built_in_forward_is_used",
    "plans_are_deterministic_and_hashable",
    "quantized_parameters_are_never_cached_or_requantized",
    "sharded_caches_do_not_outlive_the_step",
    "fsdp2_derived_data_is_released_whenever_backward_runs",
    "derived_data_is_released_only_for_formats_that_cache_it",
    "high_precision_override_keeps_no_quantized_weight_for_backward",
    "inference_has_no_backward",
    "unsafe_requantization_is_noted",
    "a_workspace_is_made_from_the_shard_only_where_that_is_exact",
    "a_quantized_gather_set_up_but_not_used_is_noted",
    "select_policy_covers_every_valid_context",
    "a_policy_refuses_exactly_the_contexts_it_does_not_cover",
    "check_policy",
]


class InvariantViolation(AssertionError):
    """A plan (or a policy's choice of contexts) broke an invariant."""


PlanInvariant = Callable[[Policy, WorkspaceContext, WorkspacePlan], None]
ContextInvariant = Callable[[WorkspaceContext], None]

_CACHE = MicrobatchCache.EXACT_FORMATS
_BASE: tuple[WorkspacePolicy, ...] = (WorkspacePolicy(), FSDP2WorkspacePolicy(), DistributedWeightWorkspacePolicy(),
                                      LeanWorkspacePolicy(), KeepForBackwardWorkspacePolicy(),
                                      # the options, which are off by default
                                      FSDP2WorkspacePolicy(microbatch_cache=_CACHE),
                                      KeepForBackwardWorkspacePolicy(microbatch_cache=_CACHE),
                                      FSDP2WorkspacePolicy(quantized_gather=QuantizedGather.ON),
                                      FSDP2WorkspacePolicy(quantized_gather=QuantizedGather.OFF))
#: Every policy the core ships, with and without its options, recompute
#: wrappers (with either ``recompute_copy``) included.
SHIPPED_POLICIES: tuple[Policy, ...] = _BASE + tuple(
    RecomputeWorkspacePolicy(inner=p, recompute_copy=copy) for copy in RecomputeCopy for p in _BASE
)


def every_option_on(sharding: Sharding) -> RecomputeWorkspacePolicy:
    """The shipped policy for ``sharding`` with every option switched on
    (``MicrobatchCache.EXACT_FORMATS`` and ``QuantizedGather.ON`` under
    FSDP2, ``RecomputeCopy.BUILD_ONCE``), as one policy to pin: the recompute
    wrapper plans calls outside recompute passes by its inner policy."""
    inner = base_policy_for(sharding)()
    if isinstance(inner, FSDP2WorkspacePolicy):
        inner = FSDP2WorkspacePolicy(microbatch_cache=_CACHE, quantized_gather=QuantizedGather.ON)
    return RecomputeWorkspacePolicy(inner=inner, recompute_copy=RecomputeCopy.BUILD_ONCE)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise InvariantViolation(message)


def all_contexts(capabilities: QuantizerCapabilities) -> Iterator[WorkspaceContext]:
    """Every valid context for a quantizer with ``capabilities`` (1,728 of them)."""
    return valid_contexts(capabilities)


def covering(ctx: WorkspaceContext) -> list[Policy]:
    """The shipped policies that plan ``ctx``, and the one select_policy picks."""
    found = [p for p in SHIPPED_POLICIES if p.covers(ctx)]
    selected = select_policy(ctx)
    return found if selected in found else [*found, selected]


# -- plan invariants ----------------------------------------------------------
def fsdp2_resharding_never_caches(policy: Policy, ctx: WorkspaceContext, plan: WorkspacePlan) -> None:
    """Under FSDP2 with reshard_after_forward=True no workspace is cached (TE#2681)."""
    if ctx.sharding is Sharding.FSDP2_RESHARD:
        _require(plan.cache is CacheAction.BYPASS, f"FSDP2 resharding planned cache={plan.cache.value}")


def fsdp2_resharding_keeps_no_quantized_copy_outside_a_recompute_pass(
    policy: Policy, ctx: WorkspaceContext, plan: WorkspacePlan
) -> None:
    """TE#2681: a layer's quantized copy of a high-precision weight must not
    wait for backward. (A recompute pass feeds the backward that follows at
    once; a non-reentrant first pass saves what checkpointing drops and the
    recompute pass rebuilds.) The one exception is asked for: a
    KeepForBackwardWorkspacePolicy pinned on the layer keeps the copy of a
    quantizer that requantizes exactly, where the user's budget pays for it."""
    if (
        ctx.sharding is Sharding.FSDP2_RESHARD
        and ctx.weight is WeightSource.HIGH_PRECISION
        and plan.workspace_origin is WorkspaceOrigin.CALL  # from the shard: FSDP2 reshards the gathered one
        and (ctx.recompute is RecomputePass.NONE or not ctx.grad_enabled)
    ):
        if _keeps_for_backward(policy) and ctx.capabilities.requantization_safe:
            return
        _require(not plan.saves_quantized, f"FSDP2 resharding saves backward_source={plan.backward_source.value}")


def _keeps_for_backward(policy: Policy) -> bool:
    """The policy (or, for a recompute wrapper, its inner one) keeps forward's copy under FSDP2 on purpose."""
    inner = policy.inner if isinstance(policy, RecomputeWorkspacePolicy) else policy
    return isinstance(inner, KeepForBackwardWorkspacePolicy)


def never_derives_what_the_format_cannot_derive(
    policy: Policy, ctx: WorkspaceContext, plan: WorkspacePlan
) -> None:
    """Columnwise data is derived only from formats with columnwise_derivable=True."""
    if plan.columnwise_source is ColumnwiseSource.DERIVED:
        _require(ctx.capabilities.columnwise_derivable, "derives columnwise data from a non-derivable format")


def a_plan_that_does_not_save_leaves_backward_a_way_to_rebuild(
    policy: Policy, ctx: WorkspaceContext, plan: WorkspacePlan
) -> None:
    """Backward always has a way to the quantized weight it reads."""
    if plan.backward_usage is Usage.NONE:
        return
    if plan.backward_source is BackwardSource.SAVED_WORKSPACE:
        # the saved workspace has the data, or it can be derived
        _require(
            Usage.COLUMNWISE not in plan.backward_usage
            or Usage.COLUMNWISE in plan.forward_usage
            or ctx.capabilities.columnwise_derivable,
            "saves a rowwise-only workspace for dgrad on a format that cannot derive columnwise data",
        )
        return
    # Any other source that reads quantized data is a saved parameter, a
    # rebuild or a re-gather (WorkspacePlan rejects the rest); a rebuild needs
    # a high-precision weight to rebuild from.
    if plan.backward_source is BackwardSource.REQUANTIZE:
        _require(not ctx.is_quantized_param, "requantizes a quantized parameter: nothing high precision to requantize from")


def recompute_passes_never_write_a_cache(policy: Policy, ctx: WorkspaceContext, plan: WorkspacePlan) -> None:
    """The recompute pass reads the cache but never writes it."""
    if ctx.recompute is RecomputePass.RECOMPUTE:
        _require(not plan.cache.writes, f"recompute pass planned cache={plan.cache.value}")


def recompute_passes_quantize_once(policy: Policy, ctx: WorkspaceContext, plan: WorkspacePlan) -> None:
    """The recompute pass's workspace feeds the backward that follows at once,
    so it is not requantized there. Two exceptions: backward gathers the
    weight anyway, or a region's recompute pass whose inner policy rebuilds
    in backward (FSDP2) leaves dgrad's copy to that rebuild, as TE does
    (:func:`region_recompute_rebuilds_as_te_unless_asked_to_build_once`)."""
    if ctx.recompute is not RecomputePass.RECOMPUTE or ctx.sharding is Sharding.DISTRIBUTED_WEIGHT:
        return
    if _region_pass_of_an_inner_rebuild(policy, ctx):
        return
    _require(plan.backward_source is not BackwardSource.REQUANTIZE, "recompute pass requantizes in backward")


def _region_pass_of_an_inner_rebuild(policy: Policy, ctx: WorkspaceContext) -> bool:
    """A ``te.checkpoint`` recompute pass planned by a recompute wrapper
    whose inner policy quantizes again in backward for this call."""
    if not isinstance(policy, RecomputeWorkspacePolicy) or ctx.recompute is not RecomputePass.RECOMPUTE:
        return False
    if ctx.recompute_scope is not RecomputeScope.REGION:
        return False
    # A recompute pass always has grad: its plain forward is the step's real one.
    return policy.inner.plan(ctx.as_plain_forward()).backward_source is BackwardSource.REQUANTIZE


def inexact_region_recompute_rebuilds_as_the_inner_policy(
    policy: Policy, ctx: WorkspaceContext, plan: WorkspacePlan
) -> None:
    """Identical numerics: a region's recompute pass quantizes with the first
    pass's scale, so with a quantizer that does not requantize exactly it
    cannot stand in for a backward rebuild that the inner policy does,
    whatever the ``recompute_copy`` option says."""
    if ctx.capabilities.requantization_safe or not _region_pass_of_an_inner_rebuild(policy, ctx):
        return
    _require(
        plan.backward_source is BackwardSource.REQUANTIZE,
        f"the inner policy rebuilds in backward, but the recompute pass gives backward "
        f"backward_source={plan.backward_source.value} made with the first pass's scale",
    )


def region_recompute_rebuilds_as_te_unless_asked_to_build_once(
    policy: Policy, ctx: WorkspaceContext, plan: WorkspacePlan
) -> None:
    """No memory over stock by default: where the inner policy rebuilds in
    backward (FSDP2), a region's recompute pass saves no copy for backward,
    as TE's does, unless ``RecomputeCopy.BUILD_ONCE`` asks for it (a copy
    held from the pass to backward, for one quantization less)."""
    if not _region_pass_of_an_inner_rebuild(policy, ctx):
        return
    if isinstance(policy, RecomputeWorkspacePolicy) and policy.recompute_copy is RecomputeCopy.BUILD_ONCE:
        return
    _require(
        plan.backward_source is BackwardSource.REQUANTIZE and Usage.COLUMNWISE not in plan.forward_usage,
        f"the inner policy rebuilds in backward and recompute_copy is {RecomputeCopy.AS_TE}, but the recompute "
        f"pass builds {plan.forward_usage.label} and gives backward backward_source={plan.backward_source.value}",
    )


def no_grad_builds_no_columnwise_unless_a_first_pass_fills_a_cache(
    policy: Policy, ctx: WorkspaceContext, plan: WorkspacePlan
) -> None:
    """Without grad, columnwise data is built only to fill a cache the recompute pass reads."""
    if not ctx.grad_enabled and Usage.COLUMNWISE in plan.forward_usage:
        _require(
            ctx.recompute is RecomputePass.FIRST and plan.cache.writes,
            "builds columnwise data in a no-grad forward that fills no cache",
        )


def columnwise_built_in_forward_is_used(policy: Policy, ctx: WorkspaceContext, plan: WorkspacePlan) -> None:
    """No waste: columnwise data built in forward is saved for dgrad or kept in a cache."""
    if Usage.COLUMNWISE in plan.forward_usage:
        _require(
            plan.columnwise_source is ColumnwiseSource.FORWARD or plan.cache.writes,
            "builds columnwise data in forward that dgrad never reads and no cache keeps",
        )


def plans_are_deterministic_and_hashable(policy: Policy, ctx: WorkspaceContext, plan: WorkspacePlan) -> None:
    """Planning the same context again gives an equal plan (bindings memoize
    plans per call shape). Equal plans hash alike: WorkspacePlan is a frozen
    dataclass of enums, so that needs no check here."""
    again = policy.plan(ctx)
    _require(plan == again, f"two plans of one context differ: {plan.summary()} vs {again.summary()}")


def quantized_parameters_are_never_cached_or_requantized(
    policy: Policy, ctx: WorkspaceContext, plan: WorkspacePlan
) -> None:
    """A quantized parameter is its own workspace."""
    if ctx.weight is WeightSource.QUANTIZED_PARAM:
        _require(plan.cache is CacheAction.BYPASS, f"caches a quantized parameter (cache={plan.cache.value})")
        _require(plan.backward_source is not BackwardSource.REQUANTIZE, "requantizes a quantized parameter")


def sharded_caches_do_not_outlive_the_step(policy: Policy, ctx: WorkspaceContext, plan: WorkspacePlan) -> None:
    """A cached workspace of a sharded weight is dropped after the step."""
    if ctx.sharding is not Sharding.NONE and plan.cache is not CacheAction.BYPASS and ctx.recompute is not RecomputePass.FIRST:
        _require(Release.CACHED_WORKSPACE in plan.release, "caches a sharded weight without releasing the cache")


def fsdp2_derived_data_is_released_whenever_backward_runs(
    policy: Policy, ctx: WorkspaceContext, plan: WorkspacePlan
) -> None:
    """TE#2717: the backward gather derives columnwise data in memory FSDP2
    cannot free, so quantized FSDP2 parameters of formats with derived
    caches, and workspaces made from the shard (which arrive as such a
    parameter), release it whenever backward runs (and only then)."""
    arrives_quantized = ctx.weight is WeightSource.QUANTIZED_PARAM or plan.workspace_origin is WorkspaceOrigin.SHARD
    if not (ctx.sharding.is_fsdp2 and arrives_quantized):
        return
    # A reentrant first pass runs without grad; a non-reentrant one (grad on)
    # is the pass whose autograd nodes backward runs.
    backward_runs = ctx.grad_enabled
    expected = backward_runs and ctx.capabilities.derived_caches
    _require(
        (Release.DERIVED_COLUMNWISE in plan.release) is expected,
        f"release={plan.release.label}, expected derived_columnwise {'in' if expected else 'not in'} it",
    )


def derived_data_is_released_only_for_formats_that_cache_it(
    policy: Policy, ctx: WorkspaceContext, plan: WorkspacePlan
) -> None:
    """Release.DERIVED_COLUMNWISE appears only for derived_caches=True."""
    if Release.DERIVED_COLUMNWISE in plan.release:
        _require(ctx.capabilities.derived_caches, "releases derived data of a format that keeps none")


def high_precision_override_keeps_no_quantized_weight_for_backward(
    policy: Policy, ctx: WorkspaceContext, plan: WorkspacePlan
) -> None:
    """backward_override="high_precision": backward reads no quantized weight."""
    if ctx.backward_override is not BackwardOverride.HIGH_PRECISION:
        return
    _require(plan.backward_usage is Usage.NONE, f"backward reads {plan.backward_usage.label} data")
    if ctx.recompute is not RecomputePass.FIRST or not plan.cache.writes:
        _require(Usage.COLUMNWISE not in plan.forward_usage, "builds columnwise data nothing reads")


def inference_has_no_backward(policy: Policy, ctx: WorkspaceContext, plan: WorkspacePlan) -> None:
    """Without grad nothing is kept for backward and nothing is released."""
    if not ctx.grad_enabled:
        _require(
            plan.backward_source is BackwardSource.NONE and plan.release is Release.NOTHING,
            f"no-grad call plans backward={plan.backward_source.value} release={plan.release.label}",
        )


def unsafe_requantization_is_noted(policy: Policy, ctx: WorkspaceContext, plan: WorkspacePlan) -> None:
    """A plan that requantizes dgrad's data with a requantization-unsafe format says so in its notes."""
    if plan.columnwise_source is ColumnwiseSource.REQUANTIZED and not ctx.capabilities.requantization_safe:
        _require(
            any(ctx.capabilities.name in n and "requantize exactly" in n for n in plan.notes),
            f"requantizes {ctx.capabilities.name} for dgrad without a note; notes: {plan.notes}",
        )


def a_workspace_is_made_from_the_shard_only_where_that_is_exact(
    policy: Policy, ctx: WorkspaceContext, plan: WorkspacePlan
) -> None:
    """A workspace is made from the shard only where a quantized all-gather
    is set up and the result equals a quantization in the call bit for bit
    (``shard_gather_refusal``); it then reaches the call as the gathered
    parameter, quantized nowhere in forward or backward."""
    if plan.workspace_origin is not WorkspaceOrigin.SHARD:
        return
    refusal = shard_gather_refusal(ctx)
    _require(refusal is None, f"makes the workspace from the shard, but {refusal}")
    _require(plan.backward_source in (BackwardSource.NONE, BackwardSource.SAVED_PARAMETER),
             f"a workspace made from the shard reaches backward as backward_source={plan.backward_source.value}")


def a_quantized_gather_set_up_but_not_used_is_noted(policy: Policy, ctx: WorkspaceContext, plan: WorkspacePlan) -> None:
    """Where a quantized all-gather is set up but the workspace is made in
    the call, the notes say why (a binding sets the gather up only where the
    plan makes the workspace from the shard, so this is a fallback to explain)."""
    if ctx.shard_gather is not ShardGather.NONE and plan.workspace_origin is WorkspaceOrigin.CALL:
        _require(any(n.startswith("made in the call, not from the shard: ") for n in plan.notes),
                 f"a quantized all-gather is set up but the workspace is made in the call, unexplained "
                 f"(notes: {plan.notes})")


# -- context invariants -------------------------------------------------------
def select_policy_covers_every_valid_context(ctx: WorkspaceContext) -> None:
    """select_policy picks a policy that covers the context and plans it without raising."""
    policy = select_policy(ctx)
    _require(policy.covers(ctx), f"select_policy picked {policy!r}, which does not cover the context")
    policy.plan(ctx)  # never raises for a valid context


def a_policy_refuses_exactly_the_contexts_it_does_not_cover(
    ctx: WorkspaceContext, policies: tuple[Policy, ...] = SHIPPED_POLICIES
) -> None:
    """Each policy plans the contexts it covers and raises PolicyMismatchError, naming itself, on the others."""
    for policy in policies:
        if policy.covers(ctx):
            policy.plan(ctx)
            continue
        try:
            policy.plan(ctx)
        except PolicyMismatchError as err:
            _require(type(policy).__name__ in str(err), f"{policy!r}'s PolicyMismatchError does not name it: {err}")
        else:
            raise InvariantViolation(f"{policy!r} planned a context it does not cover")


#: Every plan invariant, run by check_quantizer on each covering (policy, context).
PLAN_INVARIANTS: tuple[PlanInvariant, ...] = (
    fsdp2_resharding_never_caches,
    fsdp2_resharding_keeps_no_quantized_copy_outside_a_recompute_pass,
    never_derives_what_the_format_cannot_derive,
    a_plan_that_does_not_save_leaves_backward_a_way_to_rebuild,
    recompute_passes_never_write_a_cache,
    recompute_passes_quantize_once,
    inexact_region_recompute_rebuilds_as_the_inner_policy,
    region_recompute_rebuilds_as_te_unless_asked_to_build_once,
    no_grad_builds_no_columnwise_unless_a_first_pass_fills_a_cache,
    columnwise_built_in_forward_is_used,
    plans_are_deterministic_and_hashable,
    quantized_parameters_are_never_cached_or_requantized,
    sharded_caches_do_not_outlive_the_step,
    fsdp2_derived_data_is_released_whenever_backward_runs,
    derived_data_is_released_only_for_formats_that_cache_it,
    high_precision_override_keeps_no_quantized_weight_for_backward,
    inference_has_no_backward,
    unsafe_requantization_is_noted,
    a_workspace_is_made_from_the_shard_only_where_that_is_exact,
    a_quantized_gather_set_up_but_not_used_is_noted,
)

#: Every context invariant, run by check_quantizer on each context.
CONTEXT_INVARIANTS: tuple[ContextInvariant, ...] = (
    select_policy_covers_every_valid_context,
    a_policy_refuses_exactly_the_contexts_it_does_not_cover,
)


def check_policy(
    policy: Policy, capabilities: QuantizerCapabilities | Iterable[QuantizerCapabilities]
) -> int:
    """Run every plan invariant on every plan ``policy`` makes: for each
    valid context with ``capabilities`` (one profile or several) whose
    sharding the policy plans, recompute passes included (planned through
    :func:`resolve_policy`, as a binding plans a pinned policy). Returns how
    many plans held. Raises :class:`InvariantViolation` naming the
    invariant, the policy and the context of the first plan that breaks
    one; errors from planning itself (``InvalidPlanError``,
    ``PolicyMismatchError``) pass through. For the policies you write."""
    profiles = [capabilities] if isinstance(capabilities, QuantizerCapabilities) else list(capabilities)
    checked = 0
    for caps in profiles:
        for ctx in all_contexts(caps):
            if ctx.sharding not in policy.shardings:
                continue
            planner = resolve_policy(ctx, policy)
            plan = planner.plan(ctx)
            for invariant in PLAN_INVARIANTS:
                try:
                    invariant(planner, ctx, plan)
                except InvariantViolation as err:
                    raise InvariantViolation(f"{invariant.__name__}: {planner!r} planned {plan.summary()} for "
                                             f"{ctx}: {err}") from None
            checked += 1
    return checked
