"""Every plan a policy may meaningfully return for a call, and a policy that
returns chosen ones: for policy writers who want to test a binding against
plans no shipped policy makes.

:func:`meaningful_plans` lists, for one :class:`WorkspaceContext`, the
plans that :class:`WorkspacePlan` accepts and that make sense for the call.
``workspace_manager.testing.strategies.valid_plans`` draws from this list
with Hypothesis. :class:`DrawnPlanPolicy` returns, for each context, a plan
picked from that list by a function the caller gives, once per context.

The rules, per decision (WorkspacePlan's own checks come on top):

* Backward source. Backward reads the weight only for dgrad, so a call
  without dgrad (no grad, a reentrant first recompute pass, an input that
  needs no gradient) gets ``NONE``. With ``backward_override="high_precision"``
  dgrad reads the high-precision weight: ``HIGH_PRECISION``. A distributed
  weight is gathered again by backward: ``REGATHER``. A quantized parameter
  is the weight backward reads: ``SAVED_PARAMETER``. A high-precision
  weight may be saved (``SAVED_WORKSPACE``) or quantized again
  (``REQUANTIZE``).
* A non-reentrant first recompute pass (``FIRST`` with grad enabled) is planned as its recompute pass: backward matches the tensors the
  two passes save by position, so both must save the same ones. Only its
  cache action is its own. :class:`DrawnPlanPolicy` ties the two plans.
* Cache. A quantized parameter is never cached. A call may always bypass
  or fill the cache. It may read an entry (``REUSE``, ``READ_ONLY``) only
  where no weight update can have happened since the entry was filled: a
  later microbatch whose first microbatch filled, or a recompute pass whose
  first pass filled (``cache_filled``).
* Forward usage. A quantized parameter's forward reads rowwise data. A
  high-precision weight may be quantized rowwise or with both usages; a
  workspace saved for quantized dgrad of a format that cannot derive
  columnwise data must be built with both.
* Columnwise source follows from the rest: ``FORWARD`` when a saved
  workspace was built with columnwise data, ``DERIVED`` when it was not;
  ``REQUANTIZED`` for a rebuild; for a saved parameter, what FSDP2's gather
  gives (derived or gathered) or, unsharded, the parameter's own
  columnwise data (``PARAMETER``), derived if it keeps rowwise data only.
* Parameter keeps (quantized parameters). Both usages, or rowwise only for
  formats that can derive columnwise data when needed.
* Release. ``CACHED_WORKSPACE`` needs a cache entry (not ``BYPASS``) and a
  backward that marks it. ``DERIVED_COLUMNWISE`` needs a quantized
  parameter whose format keeps derived data, in a call with a backward, and
  columnwise data that is derived (FSDP2's gather, or a parameter that
  keeps rowwise data only).
* Where the workspace is made. In the call, always (a policy may fall back
  to it where a quantized all-gather is set up). From the shard
  (``WorkspaceOrigin.SHARD``) only where a quantized all-gather is set up
  and ``shard_gather_refusal`` finds nothing against it: then any plan of
  the call as the weight arrives (a quantized parameter) is meaningful,
  with ``parameter_keeps`` none (the parameter is high precision).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import ClassVar

from .._context import (
    BackwardOverride,
    Microbatch,
    RecomputePass,
    ShardGather,
    Sharding,
    WeightSource,
    WorkspaceContext,
)
from .._errors import ContextTypeError, InvalidPlanError
from .._plan import BackwardSource, CacheAction, ColumnwiseSource, Release, Usage, WorkspaceOrigin, WorkspacePlan
from .._policy import Policy, _require_context, backward_usage, shard_gather_refusal

__all__ = ["meaningful_plans", "DrawnPlanPolicy", "replay_context", "PlanChooser", "PickedPlans", "FixedSharding"]

#: ``chooser(context, candidates) -> one of candidates``.
PlanChooser = Callable[[WorkspaceContext, tuple], object]


class FixedSharding:
    """A sharding probe that always reads ``sharding``, for a binding's
    module state (``ModuleWorkspaceState(..., probe=FixedSharding(...))``):
    the policy sees that sharding where FSDP2's state would be read.

    ``is_fsdp2`` is what TE's own ``is_fsdp2`` flag then says; by default
    whether ``sharding`` is an FSDP2 one. Pass False to plan for an FSDP2
    sharding while TE sees the whole weight it really has (a test on one
    GPU without FSDP2)."""

    def __init__(self, sharding: Sharding, *, is_fsdp2: bool | None = None) -> None:
        if not isinstance(sharding, Sharding):
            raise ContextTypeError(f"FixedSharding needs a Sharding; received {sharding!r}")
        self.sharding = sharding
        self.is_fsdp2 = sharding.is_fsdp2 if is_fsdp2 is None else bool(is_fsdp2)

    def read(self) -> Sharding:
        return self.sharding

    def current(self) -> Sharding:
        return self.sharding

    def stale(self) -> bool:
        return False


class PickedPlans:
    """A chooser for :class:`DrawnPlanPolicy` that picks by numbers drawn
    up front (``picks``, reused in turn), so it can be asked on any thread.

    A drawing chooser (``data.draw`` inside the chooser) works only on the
    test's own thread. On a GPU, autograd runs backward, and with it every
    recompute pass a checkpoint plans there, on a thread of its own, where
    Hypothesis refuses to draw ("Cannot make notes outside of a test").
    Picks drawn as integers still shrink toward each context's first
    candidate. ``chosen`` lists ``(context, plan)`` in the order asked, for
    the test's failure message."""

    def __init__(self, picks: list[int]) -> None:
        if not picks or not all(isinstance(p, int) and p >= 0 for p in picks):
            raise ContextTypeError(f"PickedPlans needs a non-empty list of non-negative ints; received {picks!r}")
        self.picks = list(picks)
        self.chosen: list[tuple[WorkspaceContext, WorkspacePlan]] = []

    def __call__(self, ctx: WorkspaceContext, candidates: tuple) -> WorkspacePlan:
        plan = candidates[self.picks[len(self.chosen) % len(self.picks)] % len(candidates)]
        self.chosen.append((ctx, plan))
        return plan

    def describe(self) -> str:
        """The plans chosen, one line per context, in the order asked."""
        return "\n".join(f"{ctx}: {plan.summary()}" for ctx, plan in self.chosen)


def replay_context(ctx: WorkspaceContext) -> WorkspaceContext | None:
    """The recompute pass a non-reentrant first pass must save like, or None."""
    if ctx.recompute is RecomputePass.FIRST and ctx.grad_enabled:
        return ctx.as_recompute_pass()
    return None


def _cache_choices(ctx: WorkspaceContext, cache_filled: bool) -> tuple[CacheAction, ...]:
    if ctx.is_quantized_param:
        return (CacheAction.BYPASS,)
    reads = (CacheAction.REUSE, CacheAction.READ_ONLY) if cache_filled else ()
    return (CacheAction.BYPASS, CacheAction.FILL) + reads


def _sources(ctx: WorkspaceContext) -> tuple[BackwardSource, ...]:
    if not ctx.needs_dgrad:
        return (BackwardSource.NONE,)
    if ctx.backward_override is BackwardOverride.HIGH_PRECISION:
        return (BackwardSource.HIGH_PRECISION,)
    if ctx.sharding is Sharding.DISTRIBUTED_WEIGHT:
        return (BackwardSource.REGATHER,)
    if ctx.is_quantized_param:
        return (BackwardSource.SAVED_PARAMETER,)
    return (BackwardSource.SAVED_WORKSPACE, BackwardSource.REQUANTIZE)


def _keeps_choices(ctx: WorkspaceContext) -> tuple[Usage, ...]:
    if not ctx.is_quantized_param:
        return (Usage.NONE,)
    if ctx.capabilities.columnwise_derivable:
        return (Usage.BOTH, Usage.ROWWISE)
    return (Usage.BOTH,)


def _columnwise(ctx: WorkspaceContext, source: BackwardSource, forward: Usage, keeps: Usage) -> ColumnwiseSource:
    if Usage.COLUMNWISE not in backward_usage(ctx, source):
        return ColumnwiseSource.NOT_NEEDED
    derived = ColumnwiseSource.DERIVED if ctx.capabilities.columnwise_derivable else None
    if source is BackwardSource.SAVED_WORKSPACE:
        return ColumnwiseSource.FORWARD if Usage.COLUMNWISE in forward else derived
    if source is BackwardSource.SAVED_PARAMETER:
        if ctx.sharding.is_fsdp2:
            return derived or ColumnwiseSource.GATHERED
        return ColumnwiseSource.PARAMETER if Usage.COLUMNWISE in keeps else derived
    if source is BackwardSource.REGATHER and ctx.is_quantized_param:
        return ColumnwiseSource.GATHERED
    return ColumnwiseSource.REQUANTIZED


def _release_choices(ctx: WorkspaceContext, cache: CacheAction, keeps: Usage) -> tuple[Release, ...]:
    flags = []
    if cache is not CacheAction.BYPASS and ctx.training:
        flags.append(Release.CACHED_WORKSPACE)
    derived = ctx.sharding.is_fsdp2 or Usage.COLUMNWISE not in keeps
    if ctx.is_quantized_param and ctx.capabilities.derived_caches and ctx.training and derived:
        flags.append(Release.DERIVED_COLUMNWISE)
    choices = []
    for n in range(len(flags) + 1):
        for combo in itertools.combinations(flags, n):
            release = Release.NOTHING
            for flag in combo:
                release |= flag
            choices.append(release)
    return tuple(choices)


def _forward_choices(ctx: WorkspaceContext) -> tuple[Usage, ...]:
    return (Usage.ROWWISE,) if ctx.is_quantized_param else (Usage.ROWWISE, Usage.BOTH)


def meaningful_plans(ctx: WorkspaceContext, *, cache_filled: bool | None = None) -> tuple[WorkspacePlan, ...]:
    """Every plan for ``ctx`` that WorkspacePlan accepts and the rules in
    this module's docstring allow, in a fixed order. ``cache_filled``: an
    entry filled since the last weight update may exist (default: for a
    later microbatch or a recompute pass)."""
    if not isinstance(ctx, WorkspaceContext):
        raise ContextTypeError(f"meaningful_plans expects a WorkspaceContext; received {type(ctx).__name__}")
    if cache_filled is None:
        cache_filled = ctx.microbatch is Microbatch.LATER or ctx.recompute is RecomputePass.RECOMPUTE
    shape = replay_context(ctx) or ctx  # what the plan's backward decisions follow
    plans = []
    for cache, source, forward, keeps in itertools.product(
        _cache_choices(ctx, cache_filled), _sources(shape), _forward_choices(ctx), _keeps_choices(ctx)
    ):
        columnwise = _columnwise(shape, source, forward, keeps)
        if columnwise is None:
            continue
        for release in _release_choices(shape, cache, keeps):
            try:
                plans.append(WorkspacePlan(
                    cache=cache, forward_usage=forward, backward_source=source,
                    backward_usage=backward_usage(shape, source), columnwise_source=columnwise,
                    release=release, parameter_keeps=keeps, notes=("drawn",),
                ))
            except InvalidPlanError:
                continue
    if ctx.shard_gather is not ShardGather.NONE and shard_gather_refusal(ctx) is None:
        plans += [p for p in _plans_from_the_shard(ctx) if p not in plans]
    return tuple(plans)


def _plans_from_the_shard(ctx: WorkspaceContext) -> list[WorkspacePlan]:
    """The plans of the call as the weight arrives from a quantized
    all-gather (a quantized parameter), made from the shard, each once."""
    arrived = replace(ctx, weight=WeightSource.QUANTIZED_PARAM, shard_gather=ShardGather.NONE)
    found: list[WorkspacePlan] = []
    for plan in meaningful_plans(arrived, cache_filled=False):
        plan = replace(plan, parameter_keeps=Usage.NONE, workspace_origin=WorkspaceOrigin.SHARD)
        if plan not in found:
            found.append(plan)
    return found


@dataclass(frozen=True, eq=False)
class DrawnPlanPolicy(Policy):
    """A policy that returns, for each context, the plan ``chooser`` picks
    from :func:`meaningful_plans`, once: later calls with the same context
    get the same plan, as from any pure policy.

    It plans every sharding and recompute pass itself (its
    ``recompute_passes`` are all of them, so a pinned one is not wrapped in
    a RecomputeWorkspacePolicy). Whether a cache read is meaningful is
    taken from the plans it already returned: a later microbatch may read
    if the first microbatch of the same shape filled, a recompute pass if
    its first pass filled. A non-reentrant first pass takes its recompute
    pass's plan (chosen then) with a cache action of its own.
    """

    chooser: PlanChooser | None = None
    _plans: dict = field(default_factory=dict, repr=False)
    shardings: ClassVar[frozenset[Sharding]] = frozenset(Sharding)
    recompute_passes: ClassVar[frozenset[RecomputePass]] = frozenset(RecomputePass)
    label: ClassVar[str] = "drawn"

    # Its plans are drawn, so two of them are never the same policy.
    __eq__ = object.__eq__
    __hash__ = object.__hash__

    def __post_init__(self) -> None:
        if not callable(self.chooser):
            raise ContextTypeError(f"DrawnPlanPolicy.chooser must be callable; received {self.chooser!r}")

    def check_context(self, ctx: WorkspaceContext) -> None:
        _require_context(self, ctx)

    def plan(self, ctx: WorkspaceContext) -> WorkspacePlan:
        _require_context(self, ctx)
        known = self._plans.get(ctx)
        if known is None:
            known = self._plans[ctx] = self._choose(ctx)
        return known

    def planned(self) -> dict[WorkspaceContext, WorkspacePlan]:
        """The plans returned so far, by context."""
        return dict(self._plans)

    def _choose(self, ctx: WorkspaceContext) -> WorkspacePlan:
        replay = replay_context(ctx)
        if replay is None:
            return self._pick(ctx, meaningful_plans(ctx, cache_filled=self._filled(ctx)))
        caches = {p.cache: p for p in meaningful_plans(ctx, cache_filled=self._filled(ctx))}
        first = self._pick(ctx, tuple(caches.values()))
        if replay not in self._plans:
            filled = first.cache.writes or self._filled(replay)
            self._plans[replay] = self._pick(replay, meaningful_plans(replay, cache_filled=filled))
        return replace(self._plans[replay], cache=first.cache)

    def _pick(self, ctx: WorkspaceContext, candidates: tuple[WorkspacePlan, ...]) -> WorkspacePlan:
        plan = self.chooser(ctx, candidates)
        if plan not in candidates:
            raise InvalidPlanError(f"DrawnPlanPolicy: the chooser returned {plan!r}, not one of the candidates")
        return plan

    def _filled(self, ctx: WorkspaceContext) -> bool:
        """Whether a plan already returned filled the cache since the last
        weight update, for a call of this shape."""
        if ctx.microbatch is Microbatch.LATER:
            first = self._plans.get(replace(ctx, microbatch=Microbatch.FIRST))
            if first is not None and first.cache.writes:
                return True
        if ctx.recompute is RecomputePass.RECOMPUTE:
            for grad in (True, False):
                first = self._plans.get(replace(ctx, recompute=RecomputePass.FIRST, grad_enabled=grad))
                if first is not None and first.cache.writes:
                    return True
        return False
