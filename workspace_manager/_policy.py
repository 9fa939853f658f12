"""Workspace policies: one pure ``plan(context)`` per policy.

[Note: workspace lifetime]
A "workspace" is the quantized copy of a high-precision weight. Four
decisions govern its life. A WorkspacePlan answers the four decisions in
eight fields:

  1. cache:          ``cache``, and where the workspace is made
                     (``workspace_origin``: in the call, or under FSDP2
                     from the shard once per step, before the all-gather)
  2. forward usage:  ``forward_usage``; for a quantized parameter also
                     ``parameter_keeps``
  3. backward:       ``backward_source``, ``columnwise_source``, and
                     ``backward_usage`` (which follows from the source)
  4. release:        ``release``

``notes`` says why, in words. What every policy provides is
:class:`Policy`: ``plan(ctx)``, ``covers(ctx)``, ``check_context(ctx)``
and the settings it plans (``shardings``, ``recompute_passes``); bindings,
selection and ``explain`` ask nothing else. :class:`WorkspacePolicy`, the
plain policy, and its subclasses answer the four decisions through
seven methods, one per chosen field: ``workspace_origin``, ``cache_action``,
``forward_usage``, ``parameter_keeps``, ``backward_source``,
``columnwise_source``, ``release``.
A recompute pass is not a seventh policy but a transform:
``recompute_pass_plan`` turns the plan the inner policy makes for the
step's real forward (``inner_policy_context``) into the pass's plan;
``RecomputeWorkspacePolicy(inner)`` applies it, a :class:`Policy` that asks
none of the seven methods.

The life per policy, for one training step (F = forward, B = backward,
layer i of n; "row" and "col" are the rowwise and columnwise data)::

  WorkspacePolicy (plain; whole weights)
    F_i: quantize row+col ──► saved for B_i ──► B_i: dgrad reads col ──► freed with the autograd graph
    with microbatches: FILL on the first, REUSE on later ones; the cache
    keeps row+col of every layer from step to step (refreshed in place).

  FSDP2WorkspacePolicy, reshard_after_forward=True (TE#2681, TE#2717)
    F_i: gather W ─► quantize row ─► GEMM ─► freed at once (nothing saved)
    B_i: gather W ─► quantize col (REQUANTIZE) ─► dgrad ─► freed
    quantized parameters: saved as the gathered parameter; B_i's gather
    derives col in quantizer-owned memory ─► cleared after B_i
    (Release.DERIVED_COLUMNWISE); FSDP2 frees only what it allocated.

  FSDP2WorkspacePolicy, reshard_after_forward=False
    as reshard_after_forward=True, microbatches or not: every microbatch
    quantizes again (TE's behaviour).

  FSDP2WorkspacePolicy, a quantized all-gather set up (ShardGather), at
  world size > 1 (QuantizedGather.ON: at one rank too); formats that
  quantize a shard exactly (current scaling, 2D block scaling)
    optimizer step: each rank quantizes its shard row ─► held for the step
    F_i: gather the quantized shards (the workspace) ─► GEMM ─► saved as
    the gathered parameter (both reshard modes: FSDP2 refills it)
    B_i: columnwise derived from the gathered rowwise data ─► dgrad ─►
    derived data cleared (Release.DERIVED_COLUMNWISE); nothing quantized
    in any forward or backward, for any number of microbatches
    option microbatch_cache=MicrobatchCache.EXACT_FORMATS, with microbatches
    (quantizers that requantize exactly; others as without the option)
    first F_i: FILL row+col ─► saved ─► reused by every later microbatch
    the step's last B_i done ─► cache dropped (Release.CACHED_WORKSPACE)

  RecomputeWorkspacePolicy(inner) (te.checkpoint, LayerNormMLP(checkpoint=True))
    first pass F_i (reentrant, no grad): quantize row (row+col only when
    filling a cache the recompute pass will read) ─► nothing saved
    first pass F_i (non-reentrant, grad on): the recompute pass's plan, so
    that both passes save the same tensors (backward matches them by position)
    recompute pass F_i: cache READ_ONLY, never written ─► quantize row+col
    ─► saved ─► B_i follows at once ─► freed; the inner plan decides
    caching and what is released.
    te.checkpoint (RecomputeScope.REGION) with an inner plan that
    requantizes in backward (FSDP2): recompute pass F_i quantizes row ─►
    nothing saved; B_i quantizes col as the inner plan does, as TE does.
    option recompute_copy=RecomputeCopy.BUILD_ONCE (quantizers that
    requantize exactly): that pass too quantizes row+col ─► saved ─► B_i
    quantizes nothing.

  DistributedWeightWorkspacePolicy
    F_i: quantize row of the gathered weight ─► freed (nothing saved)
    B_i: gather again ─► quantize col ─► dgrad ─► freed

  LeanWorkspacePolicy (an option for whole weights; quantizers that
  requantize exactly; other calls as WorkspacePolicy)
    F_i: quantize row ─► GEMM ─► freed at once (nothing saved, no cache)
    B_i: quantize col (REQUANTIZE) ─► dgrad ─► freed

  KeepForBackwardWorkspacePolicy (an option under FSDP2, pinned per layer;
  quantizers that requantize exactly; other calls as FSDP2WorkspacePolicy)
    F_i: gather W ─► quantize row+col ─► GEMM ─► row freed, col saved
    B_i: FSDP2 gathers W as ever ─► dgrad reads the saved col, nothing is
    quantized ─► freed with the autograd graph

Bindings cite this note by its title where they act on a plan.

[Note: where the policies are described]
The docstrings of this module are the normative description of the
shipped policies: the note above for the four decisions, each policy
class for its policy, each option enum for its option. The other texts
derive from them or link them, and say nothing of their own: the one-line
summaries ``explain`` prints and the README's policy table is made of
(``_summary.py``, a digest whose constructors come from the policies
themselves), the words of ``explain``'s table (``_explain_layout.LEGEND``,
short names of the plan values of ``_plan.py`` and of the call settings of
``_context.py``), and ``docs/decisions.md``, which says where and why a
policy's plans differ from TE's, with the figures measured.

Which policy plans a call (``select_policy``, ``resolve_policy``) and the
bindings' path to a plan (``plan_call``) live in ``_selection.py``; plan
notes, which are presentation, in ``_notes.py``.
"""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass, field, replace
from typing import ClassVar

from ._context import (
    BackwardOverride,
    Microbatch,
    RecomputePass,
    RecomputeScope,
    ShardGather,
    Sharding,
    WeightSource,
    WorkspaceContext,
)
from ._errors import ContextTypeError, InvalidContextError, PolicyMismatchError
from ._notes import plan_notes
from ._plan import BackwardSource, CacheAction, ColumnwiseSource, Release, Usage, WorkspaceOrigin, WorkspacePlan

__all__ = [
    "Policy",
    "MicrobatchCache",
    "QuantizedGather",
    "RecomputeCopy",
    "LeanWorkspacePolicy",
    "KeepForBackwardWorkspacePolicy",
    "WorkspacePolicy",
    "FSDP2WorkspacePolicy",
    "RecomputeWorkspacePolicy",
    "DistributedWeightWorkspacePolicy",
    "backward_usage",
    "base_policy_for",
    "shard_gather_refusal",
    "inner_policy_context",
    "recompute_pass_plan",
]


class MicrobatchCache(enum.Enum):
    """Option of :class:`FSDP2WorkspacePolicy` (and its subclasses): whether
    one workspace per weight serves every microbatch of a step under FSDP2
    with ``reshard_after_forward=False`` (docs/decisions.md, D4)."""

    #: The default, as TE: every microbatch quantizes every weight again and
    #: no quantized copy outlives its microbatch's backward.
    OFF = "off"
    #: For quantizers that requantize exactly (``requantization_safe``):
    #: the first microbatch fills one workspace per weight, later ones reuse
    #: it, and it is dropped after the step's last backward. Costs one
    #: quantized copy per weight for the whole step, for fewer quantizations.
    EXACT_FORMATS = "exact_formats"


class QuantizedGather(enum.Enum):
    """Option of :class:`FSDP2WorkspacePolicy` (and its subclasses): where a
    quantized all-gather is set up for a weight (``ShardGather``), whether
    its workspace is made from the shard before the all-gather, once per
    optimizer step (docs/decisions.md, D13). Only ever for formats that
    quantize a shard exactly, requantize exactly and derive columnwise data
    (:func:`shard_gather_refusal`); other calls are planned as with ``OFF``."""

    #: The rule: from the shard where FSDP2 shards the weight over two ranks
    #: or more (the all-gather moves half the bytes, and each rank quantizes
    #: its shard once per step instead of the whole weight in every forward
    #: and backward of every microbatch); in the call at one rank, where no
    #: byte moves and the shard held for the step (1 byte per parameter)
    #: would buy only the quantizations of later microbatches, which a policy
    #: cannot count before the step's first all-gather fixes what FSDP2 gathers.
    AUTO = "auto"
    #: From the shard wherever the format allows it, one rank included: for
    #: gradient accumulation on one GPU (the shard is then a copy of the
    #: whole weight held for the step, in place of every microbatch's
    #: quantizations).
    ON = "on"
    #: Never: every workspace is made in the call, as TE does.
    OFF = "off"


class RecomputeCopy(enum.Enum):
    """Option of :class:`RecomputeWorkspacePolicy`: in a ``te.checkpoint``
    recompute pass whose inner policy quantizes again in backward (FSDP2),
    who builds the copy dgrad reads (docs/decisions.md, D3)."""

    #: The default, as TE: the pass quantizes rowwise data only and saves
    #: nothing; backward quantizes the weight it gathers again.
    AS_TE = "as_te"
    #: For quantizers that requantize exactly (``requantization_safe``): the
    #: pass builds the usages backward reads and saves them for the backward
    #: that follows at once, so the weight is quantized once instead of twice.
    #: Costs the pass's columnwise copy from the pass to that backward.
    BUILD_ONCE = "build_once"


def _require_option(policy: object, name: str, value: object, kind: type[enum.Enum]) -> None:
    """A policy option must be a member of its enum: a bool or a string
    would silently select a branch."""
    if not isinstance(value, kind):
        choices = ", ".join(f"{kind.__name__}.{m.name}" for m in kind)
        raise ContextTypeError(
            f"{type(policy).__name__}({name}=...) expects one of {choices}; received {value!r}"
        )


def backward_usage(ctx: WorkspaceContext, source: BackwardSource) -> Usage:
    """The usages backward reads on the weight it gets (not a policy choice)."""
    if source in (BackwardSource.NONE, BackwardSource.HIGH_PRECISION):
        return Usage.NONE
    if ctx.backward_override is BackwardOverride.DEQUANTIZED:
        return Usage.ROWWISE
    return Usage.COLUMNWISE


def _source_without_rebuild(ctx: WorkspaceContext) -> BackwardSource:
    """What backward gets when forward keeps what it quantized."""
    if not ctx.needs_dgrad:
        # wgrad reads the input and grad_output only: keeping the weight's
        # workspace for a backward without dgrad holds memory for nothing.
        return BackwardSource.NONE
    if ctx.backward_override is BackwardOverride.HIGH_PRECISION:
        return BackwardSource.HIGH_PRECISION
    if ctx.is_quantized_param:
        return BackwardSource.SAVED_PARAMETER
    return BackwardSource.SAVED_WORKSPACE


def _requantizes_exactly(ctx: WorkspaceContext) -> bool:
    """Quantizing this call's weight again reproduces the first quantization
    bit for bit (the capability ``requantization_safe``). The gate of every
    plan in which one quantization stands in for another: a microbatch cache
    under FSDP2 (D4), a recompute pass's copy kept for backward (D3), a
    cache a module's own recompute reads, and the lean and keep-for-backward
    options."""
    return ctx.capabilities.requantization_safe


def _copy_and_rebuild_agree(ctx: WorkspaceContext) -> bool:
    """Forward's copy and a backward rebuild are the same bytes, so a policy
    may keep the one or build the other: a high-precision weight (a
    quantized parameter is its own workspace, with nothing to rebuild from)
    whose quantizer requantizes exactly. The predicate of the lean and the
    keep-for-backward options; other calls are planned as without them."""
    return not ctx.is_quantized_param and _requantizes_exactly(ctx)


def shard_gather_refusal(ctx: WorkspaceContext) -> str | None:
    """Why the workspace of ``ctx``'s weight cannot be made from its shard
    bit for bit as a quantization in the call makes it, or None where it
    can: a quantized all-gather is set up (``ctx.shard_gather``), and the
    format quantizes a shard exactly (``shard_quantization_exact``),
    requantizes exactly (one quantization stands in for every call's of the
    step) and derives columnwise data (dgrad's data is derived after the
    gather, which sends rowwise data only); and dgrad does not read the
    high-precision weight, which a quantized gather does not bring."""
    caps = ctx.capabilities
    if ctx.shard_gather is ShardGather.NONE:
        return "no quantized all-gather is set up for this weight"
    if not caps.shard_quantization_exact:
        return f"{caps.name} does not quantize a shard to the whole weight's bytes (shard_quantization_exact=False)"
    if not caps.requantization_safe:
        return f"{caps.name} does not requantize exactly: one copy per step would differ from TE's per call"
    if not caps.columnwise_derivable:
        return f"{caps.name} cannot derive dgrad's columnwise data from the gathered rowwise data"
    if ctx.backward_override is BackwardOverride.HIGH_PRECISION:
        return "backward_override='high_precision': dgrad reads the high-precision weight, which is not gathered"
    return None


def _arrived(ctx: WorkspaceContext) -> WorkspaceContext:
    """The call as the weight reaches it when the workspace is made from the
    shard: FSDP2's all-gather hands it over quantized, as it hands over a
    quantized parameter (``WeightSource.QUANTIZED_PARAM``)."""
    return replace(ctx, weight=WeightSource.QUANTIZED_PARAM, shard_gather=ShardGather.NONE)


def _from_the_shard(ctx: WorkspaceContext, arrived_plan: WorkspacePlan) -> WorkspacePlan:
    """The plan of ``ctx`` whose workspace is made from the shard: the plan
    of the call as the weight arrives (:func:`_arrived`), with the weight's
    own facts: a high-precision parameter (it keeps nothing quantized
    itself; the quantized shard is the workspace's origin) and its notes."""
    p = arrived_plan
    notes = plan_notes(ctx, p.cache, p.forward_usage, p.backward_source, p.columnwise_source, p.release,
                       Usage.NONE, WorkspaceOrigin.SHARD)
    return replace(p, parameter_keeps=Usage.NONE, workspace_origin=WorkspaceOrigin.SHARD, notes=notes)


def _cache_by_microbatch(ctx: WorkspaceContext) -> CacheAction:
    """TE's rule: the cache is used only when the caller says where in the
    microbatch sequence it is, and never for a quantized parameter."""
    if ctx.is_quantized_param or ctx.microbatch is Microbatch.NONE:
        return CacheAction.BYPASS
    return CacheAction.FILL if ctx.microbatch is Microbatch.FIRST else CacheAction.REUSE


#: The recompute passes of a policy of calls outside activation recompute.
_OUTSIDE_RECOMPUTE = frozenset({RecomputePass.NONE})


class Policy(abc.ABC):
    """What every policy provides: what bindings, :func:`resolve_policy`,
    the invariants and ``explain`` ask of one. :class:`WorkspacePolicy`
    (the plain policy, and the base of the policies that answer the six
    questions) and :class:`RecomputeWorkspacePolicy` (a wrapper) are the
    shipped kinds; a policy of your own subclasses one of them, or this.

    A policy is immutable and pure: ``plan(ctx)`` depends on ``ctx`` alone,
    so a binding may keep a plan for every later call of the same context.
    """

    #: Weight distributions the policy plans. Fixed per class for the
    #: policies of calls outside recompute; a recompute wrapper takes its
    #: inner policy's, per instance.
    shardings: frozenset[Sharding]
    #: The recompute passes the policy plans itself. ``{RecomputePass.NONE}``:
    #: calls outside activation recompute only, and :func:`resolve_policy`
    #: wraps a pinned one in :class:`RecomputeWorkspacePolicy` for a pass;
    #: every pass: a policy of recompute passes, which plans the other
    #: calls too (``explain`` shows it with the passes only).
    recompute_passes: ClassVar[frozenset[RecomputePass]]
    #: Short name used by tables, the CLI and error messages.
    label: ClassVar[str]

    def covers(self, ctx: WorkspaceContext) -> bool:
        """Whether the policy plans ``ctx`` (else :meth:`plan` raises PolicyMismatchError)."""
        return ctx.sharding in self.shardings and ctx.recompute in self.recompute_passes

    @abc.abstractmethod
    def check_context(self, ctx: WorkspaceContext) -> None:
        """Raise PolicyMismatchError, saying what to pin instead, if the policy does not plan ``ctx``."""

    @abc.abstractmethod
    def plan(self, ctx: WorkspaceContext) -> WorkspacePlan:
        """Decide the workspace's fate for one call. Pure: the same context
        always gives the same plan."""


@dataclass(frozen=True)
class WorkspacePolicy(Policy):
    """The plain policy, for whole (unsharded) weights: single GPU, DDP,
    tensor parallel.

    Keeps alive: the workspace, built with rowwise and (when backward runs
    quantized dgrad) columnwise data, from forward until this layer's
    backward; with microbatch positions, one cached workspace per weight
    that lives from step to step and is refreshed in place on each first
    microbatch. Frees: the saved workspace with the autograd graph. Releases
    nothing explicitly. This is TE 2.20.2's behaviour, minus the waste
    listed in ``docs/decisions.md``.

    Subclasses answer the four decisions through the same seven methods,
    one per chosen plan field (``workspace_origin``, ``cache_action``,
    ``forward_usage``, ``parameter_keeps``, ``backward_source``,
    ``columnwise_source``, ``release``); :meth:`plan` asks them in order.
    Where ``workspace_origin`` is ``SHARD``, the other six are asked about
    the call as the weight arrives from the all-gather, quantized.
    [Note: workspace lifetime] in this module says which field answers
    which decision.
    """

    # Not a ClassVar: Policy.shardings is per instance for a recompute wrapper.
    shardings = frozenset({Sharding.NONE})
    recompute_passes: ClassVar[frozenset[RecomputePass]] = _OUTSIDE_RECOMPUTE
    label: ClassVar[str] = "plain"

    def plan(self, ctx: WorkspaceContext) -> WorkspacePlan:
        self.check_context(ctx)
        return _ask(self, ctx)

    def check_context(self, ctx: WorkspaceContext) -> None:
        _require_context(self, ctx)
        if ctx.sharding not in self.shardings:
            raise PolicyMismatchError(_sharding_mismatch(self, ctx))
        if ctx.recompute is not RecomputePass.NONE:
            raise PolicyMismatchError(
                f"{type(self).__name__} does not plan activation-recompute passes; this call has "
                f"recompute=RecomputePass.{ctx.recompute.name}. Wrap it: "
                f"RecomputeWorkspacePolicy(inner={type(self).__name__}()), or let select_policy choose."
            )

    # -- the seven methods, one per chosen plan field -------------------------
    def workspace_origin(self, ctx: WorkspaceContext) -> WorkspaceOrigin:
        """Is the workspace made in the call, or from the FSDP2 shard before
        the all-gather? In the call: the plain policy plans whole weights."""
        return WorkspaceOrigin.CALL

    def gather_refusal(self, ctx: WorkspaceContext) -> str | None:
        """Why the workspace is made in the call where a quantized all-gather
        is set up (the plan's notes say it); None where it is made from the shard."""
        return f"{type(self).__name__} makes every workspace in the call"

    def cache_action(self, ctx: WorkspaceContext) -> CacheAction:
        """Is the workspace cached across calls, and refreshed this call?"""
        return _cache_by_microbatch(ctx)

    def forward_usage(self, ctx: WorkspaceContext, cache: CacheAction) -> Usage:
        """Which usages does the forward quantization build?"""
        if ctx.is_quantized_param:
            return Usage.ROWWISE
        return Usage.BOTH if ctx.quantized_dgrad else Usage.ROWWISE

    def backward_source(self, ctx: WorkspaceContext, cache: CacheAction) -> BackwardSource:
        """What does backward get: a saved workspace, the saved quantized
        parameter, or a rebuild from the high-precision weight?"""
        return _source_without_rebuild(ctx)

    def columnwise_source(self, ctx: WorkspaceContext, source: BackwardSource, forward: Usage) -> ColumnwiseSource:
        """Where does dgrad's columnwise data come from?"""
        return _columnwise_for(ctx, source, forward, parameter=ColumnwiseSource.PARAMETER)

    def release(self, ctx: WorkspaceContext, cache: CacheAction) -> Release:
        """What is released after backward? Whole weights own their caches."""
        return Release.NOTHING

    def parameter_keeps(self, ctx: WorkspaceContext) -> Usage:
        """What does a quantized parameter keep between steps? A whole
        parameter feeds the GEMMs itself, so it keeps both usages (TE's
        behaviour)."""
        return Usage.BOTH


def _require_context(policy: Policy, ctx: object) -> None:
    if not isinstance(ctx, WorkspaceContext):
        raise ContextTypeError(
            f"{type(policy).__name__}.plan expects a WorkspaceContext; received {type(ctx).__name__}"
        )


def _ask(policy: WorkspacePolicy, ctx: WorkspaceContext) -> WorkspacePlan:
    """Call a policy's seven methods about one call, in order, and assemble
    the plan; a workspace made from the shard is planned as the weight
    arrives from the all-gather (:func:`_from_the_shard`)."""
    if policy.workspace_origin(ctx) is WorkspaceOrigin.SHARD:
        return _from_the_shard(ctx, _ask_in_call(policy, _arrived(ctx), None))
    refusal = policy.gather_refusal(ctx) if ctx.shard_gather is not ShardGather.NONE else None
    return _ask_in_call(policy, ctx, refusal)


def _ask_in_call(policy: WorkspacePolicy, ctx: WorkspaceContext, refusal: str | None) -> WorkspacePlan:
    """The six methods besides ``workspace_origin``, for a workspace the
    call makes (or, for :func:`_from_the_shard`, receives)."""
    cache = policy.cache_action(ctx)
    forward = policy.forward_usage(ctx, cache)
    source = policy.backward_source(ctx, cache)
    columnwise = policy.columnwise_source(ctx, source, forward)
    release = policy.release(ctx, cache)
    keeps = policy.parameter_keeps(ctx) if ctx.is_quantized_param else Usage.NONE
    return _assemble(ctx, cache, forward, source, columnwise, release, keeps, refusal)


def _columnwise_for(
    ctx: WorkspaceContext, source: BackwardSource, forward: Usage, *, parameter: ColumnwiseSource
) -> ColumnwiseSource:
    if Usage.COLUMNWISE not in backward_usage(ctx, source):
        return ColumnwiseSource.NOT_NEEDED
    if source is BackwardSource.REQUANTIZE:
        return ColumnwiseSource.REQUANTIZED
    if source is BackwardSource.REGATHER:
        return ColumnwiseSource.GATHERED if ctx.is_quantized_param else ColumnwiseSource.REQUANTIZED
    if source is BackwardSource.SAVED_PARAMETER:
        return parameter
    if Usage.COLUMNWISE in forward:
        return ColumnwiseSource.FORWARD
    if ctx.capabilities.columnwise_derivable:
        return ColumnwiseSource.DERIVED
    raise PolicyMismatchError(
        f"A plan saves a rowwise-only workspace for quantized dgrad, but quantizer "
        f"{ctx.capabilities.name!r} cannot derive columnwise data from rowwise data. "
        "Build columnwise in forward or requantize in backward."
    )


def _sharding_mismatch(policy: WorkspacePolicy, ctx: WorkspaceContext) -> str:
    allowed = ", ".join(f"Sharding.{s.name}" for s in sorted(policy.shardings, key=lambda s: s.name))
    hint = {
        Sharding.NONE: "If the module should be sharded, call fully_shard on it (or an ancestor) "
        "before its first forward; otherwise pin WorkspacePolicy() or let select_policy choose.",
    }.get(ctx.sharding, f"Pin {base_policy_for(ctx.sharding).__name__}() or let select_policy choose.")
    return (
        f"{type(policy).__name__} plans only for weights with sharding in ({allowed}); this call's "
        f"weight has Sharding.{ctx.sharding.name}. {hint}"
    )


@dataclass(frozen=True)
class FSDP2WorkspacePolicy(WorkspacePolicy):
    """For weights sharded by FSDP2 (``fully_shard``).

    Keeps alive: with ``reshard_after_forward=True``, no quantized copy of a
    high-precision weight outlives its GEMM: forward builds rowwise data
    only, nothing is saved, and backward quantizes the weight it gathers
    again (TE#2681). A quantized parameter is saved as the gathered
    parameter; columnwise data its backward gather derives in
    quantizer-owned memory is cleared after that layer's backward (TE#2717).
    With ``reshard_after_forward=False`` the same holds by default: every
    microbatch quantizes every weight again, as TE does.

    Option ``microbatch_cache`` (:class:`MicrobatchCache`, default ``OFF``):
    ``EXACT_FORMATS`` lets the gathered weight that stays between
    microbatches (``reshard_after_forward=False``) be quantized once per
    step: one workspace per weight is filled on the first microbatch, reused
    by the later ones, and dropped after the step's last backward. Only for
    quantizers that requantize exactly, since stock TE quantizes every
    microbatch again. Trade-off: one quantized copy per weight held for the
    whole step, for fewer quantizations; off by default because no
    step-time gain has been measured (docs/decisions.md, D4).

    Option ``quantized_gather`` (:class:`QuantizedGather`, default ``AUTO``):
    where a binding has set up a quantized all-gather for the weight
    (``ctx.shard_gather``), the workspace is made from the shard before the
    all-gather (``WorkspaceOrigin.SHARD``) by this rule: at world size > 1
    with ``AUTO``, at any world size with ``ON``, never with ``OFF``; and
    only where :func:`shard_gather_refusal` finds nothing against it (current
    scaling and 2D block scaling; delayed scaling, MXFP8, NVFP4 and 1D blocks
    fall back to the call, their plans' notes say why). Keeps alive: the
    quantized shard (1 byte per parameter per rank, plus its scales) from the
    optimizer step to the next write of the weight. Every forward and
    backward, of every microbatch, then quantizes nothing; the all-gather
    sends half the bytes of bf16; dgrad's columnwise data is derived after
    the gather and cleared after backward. Trade-off: that held shard, for
    the quantizations and half the gathered bytes (docs/decisions.md, D13,
    says what is measured).
    """

    shardings = frozenset({Sharding.FSDP2_RESHARD, Sharding.FSDP2_KEEP})
    label: ClassVar[str] = "fsdp2"
    microbatch_cache: MicrobatchCache = MicrobatchCache.OFF
    quantized_gather: QuantizedGather = QuantizedGather.AUTO

    def __post_init__(self) -> None:
        _require_option(self, "microbatch_cache", self.microbatch_cache, MicrobatchCache)
        _require_option(self, "quantized_gather", self.quantized_gather, QuantizedGather)

    def workspace_origin(self, ctx: WorkspaceContext) -> WorkspaceOrigin:
        return WorkspaceOrigin.CALL if self.gather_refusal(ctx) else WorkspaceOrigin.SHARD

    def gather_refusal(self, ctx: WorkspaceContext) -> str | None:
        if self.quantized_gather is QuantizedGather.OFF:
            return "QuantizedGather.OFF makes every workspace in the call, as TE does"
        refusal = shard_gather_refusal(ctx)
        if refusal is None and self.quantized_gather is QuantizedGather.AUTO and ctx.shard_gather is ShardGather.ONE_RANK:
            return ("one rank: the all-gather moves no bytes, and a shard held for the step would buy only later "
                    "microbatches' quantizations; QuantizedGather.ON makes it")
        return refusal

    def cache_action(self, ctx: WorkspaceContext) -> CacheAction:
        if self.microbatch_cache is MicrobatchCache.OFF:
            # TE's cache_name is None under FSDP2: nothing is cached.
            return CacheAction.BYPASS
        if ctx.sharding is Sharding.FSDP2_RESHARD or not ctx.grad_enabled:
            # Resharding frees the gathered weight after each forward; a
            # cached quantized copy would keep it alive per layer. Without
            # grad there is no backward to drop the cache after.
            return CacheAction.BYPASS
        if not _requantizes_exactly(ctx):
            # TE quantizes every microbatch again under FSDP2; reusing the
            # first one's workspace is the same only if quantizing again
            # reproduces it (not with delayed scaling, whose scale moves
            # after every forward).
            return CacheAction.BYPASS
        return _cache_by_microbatch(ctx)

    def forward_usage(self, ctx: WorkspaceContext, cache: CacheAction) -> Usage:
        if cache is CacheAction.BYPASS:
            # Nothing built here outlives the call, so columnwise would be waste.
            return Usage.ROWWISE
        return super().forward_usage(ctx, cache)

    def backward_source(self, ctx: WorkspaceContext, cache: CacheAction) -> BackwardSource:
        source = _source_without_rebuild(ctx)
        if source is BackwardSource.SAVED_WORKSPACE and cache is CacheAction.BYPASS:
            return BackwardSource.REQUANTIZE
        return source

    def columnwise_source(self, ctx: WorkspaceContext, source: BackwardSource, forward: Usage) -> ColumnwiseSource:
        # TE's FSDP2 hooks gather rowwise data and derive columnwise where the
        # format allows it; other formats gather the columnwise data itself.
        via_gather = ColumnwiseSource.DERIVED if ctx.capabilities.columnwise_derivable else ColumnwiseSource.GATHERED
        return _columnwise_for(ctx, source, forward, parameter=via_gather)

    def release(self, ctx: WorkspaceContext, cache: CacheAction) -> Release:
        release = Release.NOTHING
        if not ctx.grad_enabled:
            return release
        if ctx.is_quantized_param and ctx.capabilities.derived_caches:
            # Cleared even when dgrad does not run: the backward gather
            # derives columnwise data regardless (TE clears only after dgrad).
            release |= Release.DERIVED_COLUMNWISE
        if cache is not CacheAction.BYPASS:
            release |= Release.CACHED_WORKSPACE
        return release

    def parameter_keeps(self, ctx: WorkspaceContext) -> Usage:
        # The shard never feeds a GEMM: only its all-gather reads it. For
        # formats that can derive columnwise data, TE's FSDP2 hooks gather
        # rowwise data alone (in both reshard modes) and derive columnwise
        # data after the gather, so a columnwise copy on the shard is memory
        # and optimizer writes that buy nothing. Other formats gather the
        # columnwise data itself, so the shard must keep it.
        return Usage.ROWWISE if ctx.capabilities.columnwise_derivable else Usage.BOTH


@dataclass(frozen=True)
class LeanWorkspacePolicy(WorkspacePolicy):
    """For whole weights (single GPU, DDP, tensor parallel) when memory is
    scarcer than time: an option, never selected by default.

    Keeps alive: no quantized copy of a high-precision weight outlives its
    forward GEMM. Forward builds rowwise data only, nothing is saved, and
    backward quantizes the high-precision weight again for dgrad; microbatch
    positions are ignored (no cache). Frees: the rebuilt copy right after
    dgrad. Trade-off: one extra quantization per weight per step buys the
    whole workspace, from forward to backward (2 bytes per parameter under
    per-tensor FP8 with stock TE's saved copy). Only for quantizers that
    requantize exactly (current and block scaling): with delayed scaling the
    rebuilt copy would use a newer scale and change dgrad, so those calls
    are planned as :class:`WorkspacePolicy` plans them. Quantized
    parameters are planned as the plain policy plans them.
    """

    label: ClassVar[str] = "lean"

    def cache_action(self, ctx: WorkspaceContext) -> CacheAction:
        return CacheAction.BYPASS if _copy_and_rebuild_agree(ctx) else super().cache_action(ctx)

    def forward_usage(self, ctx: WorkspaceContext, cache: CacheAction) -> Usage:
        return Usage.ROWWISE if _copy_and_rebuild_agree(ctx) else super().forward_usage(ctx, cache)

    def backward_source(self, ctx: WorkspaceContext, cache: CacheAction) -> BackwardSource:
        source = super().backward_source(ctx, cache)
        if _copy_and_rebuild_agree(ctx) and source is BackwardSource.SAVED_WORKSPACE:
            return BackwardSource.REQUANTIZE
        return source


@dataclass(frozen=True)
class KeepForBackwardWorkspacePolicy(FSDP2WorkspacePolicy):
    """For weights sharded by FSDP2 when time is scarcer than memory: an
    option, never selected by default. Pin it on the layers whose backward
    runs first (the last ones); ``te_integration.apply_workspace_budget``
    does so within a byte budget.

    Keeps alive: forward quantizes the gathered high-precision weight with
    rowwise and columnwise data and saves it for this layer's backward,
    which reads its columnwise data (rowwise data with
    ``backward_override="dequantized"``) instead of quantizing the weight
    FSDP2 gathers again; the binding keeps only the data backward reads
    (D11). Frees: the saved copy with the autograd graph, after this
    layer's backward. Trade-off: one columnwise copy per weight (1 byte per
    parameter under FP8) held from forward to backward buys one
    quantization per weight per step. Only for quantizers that requantize
    exactly (current scaling, block scaling, MXFP8): with delayed scaling
    the kept copy would carry the forward's scale where stock TE's rebuild
    uses the scale of backward time, changing dgrad, so those calls are
    planned as :class:`FSDP2WorkspacePolicy` plans them. Quantized
    parameters, microbatch caches (the inherited ``microbatch_cache``
    option, off by default) and releases are planned as
    FSDP2WorkspacePolicy plans them.
    """

    label: ClassVar[str] = "keep_for_backward"

    def forward_usage(self, ctx: WorkspaceContext, cache: CacheAction) -> Usage:
        if _copy_and_rebuild_agree(ctx) and ctx.quantized_dgrad:
            return Usage.BOTH  # the columnwise data dgrad will read, built once
        return super().forward_usage(ctx, cache)

    def backward_source(self, ctx: WorkspaceContext, cache: CacheAction) -> BackwardSource:
        source = super().backward_source(ctx, cache)
        if _copy_and_rebuild_agree(ctx) and source is BackwardSource.REQUANTIZE:
            return BackwardSource.SAVED_WORKSPACE
        return source


@dataclass(frozen=True)
class DistributedWeightWorkspacePolicy(WorkspacePolicy):
    """For TE distributed weights (``DistributedWeight``, e.g. GTP), which
    backward gathers again.

    Keeps alive: nothing beyond the GEMM. Forward quantizes rowwise data of
    the gathered weight; backward gathers it again and quantizes columnwise
    data (a weight that arrives quantized brings its own). No cache: a
    cached copy would hold the whole gathered weight.
    """

    shardings = frozenset({Sharding.DISTRIBUTED_WEIGHT})
    label: ClassVar[str] = "distributed_weight"

    def cache_action(self, ctx: WorkspaceContext) -> CacheAction:
        return CacheAction.BYPASS

    def forward_usage(self, ctx: WorkspaceContext, cache: CacheAction) -> Usage:
        return Usage.ROWWISE

    def backward_source(self, ctx: WorkspaceContext, cache: CacheAction) -> BackwardSource:
        source = _source_without_rebuild(ctx)
        if source.saves_quantized:
            return BackwardSource.REGATHER
        return source


@dataclass(frozen=True)
class RecomputeWorkspacePolicy(Policy):
    """For modules inside activation recompute (``te.checkpoint``,
    ``LayerNormMLP(checkpoint=True)``), wrapping the policy of the weight's
    sharding (``inner``).

    A wrapper, not a policy of its own: its plans come from ``inner``'s; it
    has none of the six methods a :class:`WorkspacePolicy` answers with.
    Calls outside a recompute region are planned by ``inner`` unchanged; a
    recompute pass's plan is :func:`recompute_pass_plan` of the plan
    ``inner`` makes for the step's real forward (:func:`inner_policy_context`).
    It plans the weight distributions ``inner`` plans (``shardings``).

    Keeps alive: in the first pass, nothing for backward (its saved tensors
    are dropped); columnwise data is built only when the pass fills a cache
    that the recompute pass will read. In the recompute pass the cache is
    only read, never written. Where the inner policy keeps forward's copy
    for backward (whole weights), the pass builds the usages backward needs
    and saves them, since that layer's backward follows at once. Where the
    inner policy quantizes again in backward (FSDP2), a ``te.checkpoint``
    pass does as TE does: rowwise data only, nothing saved, and backward
    quantizes again (see ``_leaves_dgrad_copy_to_inner_rebuild``); a
    module's own recompute (``LayerNormMLP(checkpoint=True)``) hands its
    copy to backward, as TE does. Caching and what is released after
    backward are the inner policy's decisions.

    Option ``recompute_copy`` (:class:`RecomputeCopy`, default ``AS_TE``):
    ``BUILD_ONCE`` makes a ``te.checkpoint`` recompute pass under FSDP2
    build the columnwise data too and save it for the backward that follows,
    so the weight is quantized once instead of twice; only for quantizers
    that requantize exactly (with delayed scaling the pass's copy carries
    the first pass's scale, where TE's rebuild uses backward's). Trade-off:
    more peak memory for one quantization less; docs/decisions.md, D3, has
    the figures measured.
    """

    inner: Policy = field(default_factory=WorkspacePolicy)
    recompute_copy: RecomputeCopy = RecomputeCopy.AS_TE
    recompute_passes: ClassVar[frozenset[RecomputePass]] = frozenset(RecomputePass)
    label: ClassVar[str] = "recompute"

    def __post_init__(self) -> None:
        if not isinstance(self.inner, Policy) or self.inner.recompute_passes != _OUTSIDE_RECOMPUTE:
            raise ContextTypeError(
                "RecomputeWorkspacePolicy.inner must be a non-recompute policy, one whose recompute_passes are "
                f"{{RecomputePass.NONE}} (e.g. FSDP2WorkspacePolicy()); received {self.inner!r}"
            )
        _require_option(self, "recompute_copy", self.recompute_copy, RecomputeCopy)
        # Derived from a field, as a frozen dataclass derives (not a field:
        # equality, hashing and repr stay those of inner and recompute_copy).
        object.__setattr__(self, "shardings", self.inner.shardings)

    def check_context(self, ctx: WorkspaceContext) -> None:
        _require_context(self, ctx)
        self._check_inner(ctx.as_plain_forward())

    def plan(self, ctx: WorkspaceContext) -> WorkspacePlan:
        _require_context(self, ctx)
        if ctx.recompute is RecomputePass.NONE:
            self._check_inner(ctx)
            return self.inner.plan(ctx)
        # The inner policy's view of the call is derived once, here, and
        # serves both the check and the inner plan.
        step_forward = inner_policy_context(ctx)
        self._check_inner(step_forward)
        return recompute_pass_plan(ctx, self.inner.plan(step_forward), self.recompute_copy)

    def _check_inner(self, plain: WorkspaceContext) -> None:
        try:
            self.inner.check_context(plain)
        except PolicyMismatchError as err:
            raise PolicyMismatchError(f"{self!r} cannot plan this call: {err}") from None


def inner_policy_context(ctx: WorkspaceContext) -> WorkspaceContext:
    """The call a recompute pass's inner policy plans: the step's real
    forward, which is the call without its pass, with grad even when a
    reentrant first pass runs without it (a backward follows that pass)."""
    plain = ctx.as_plain_forward()
    return plain if plain.grad_enabled else replace(plain, grad_enabled=True)


def recompute_pass_plan(ctx: WorkspaceContext, inner_plan: WorkspacePlan, recompute_copy: RecomputeCopy) -> WorkspacePlan:
    """The plan of a recompute pass (``ctx.recompute`` is FIRST or
    RECOMPUTE): a pure function of ``inner_plan``, the plan the inner policy
    makes for :func:`inner_policy_context` of ``ctx``, and of the pass's own
    facts (the pass, its scope, the quantizer, ``recompute_copy``).

    The inner plan gives the cache action of the step's forward, whether
    backward gathers the weight again or quantizes it again, what is
    released, and what a quantized parameter keeps; the pass decides what it
    builds and saves. [Note: workspace lifetime] draws both passes."""
    if ctx.recompute is RecomputePass.NONE:
        raise InvalidContextError(
            "recompute_pass_plan plans recompute passes only; this call has recompute=RecomputePass.NONE. "
            "Plan it with the inner policy."
        )
    if inner_plan.workspace_origin is WorkspaceOrigin.SHARD:
        # Every pass receives the workspace made from the shard, as it
        # would receive a quantized parameter: plan the pass as that call.
        as_call = replace(inner_plan, workspace_origin=WorkspaceOrigin.CALL)
        return _from_the_shard(ctx, recompute_pass_plan(_arrived(ctx), as_call, recompute_copy))
    if ctx.recompute is RecomputePass.FIRST and ctx.grad_enabled:
        # Non-reentrant checkpointing: backward runs this pass's autograd
        # nodes with the tensors the recompute pass saves, matched by
        # position, so this pass must save exactly what that pass saves.
        # Only the cache action is its own (it may fill what the recompute
        # pass then reads). Both passes share one inner plan.
        replay = _pass_plan(ctx.as_recompute_pass(), inner_plan, recompute_copy)
        return _assemble(
            ctx, _pass_cache(ctx, inner_plan), replay.forward_usage, replay.backward_source,
            replay.columnwise_source, replay.release, replay.parameter_keeps,
        )
    return _pass_plan(ctx, inner_plan, recompute_copy)


def _pass_plan(ctx: WorkspaceContext, inner_plan: WorkspacePlan, recompute_copy: RecomputeCopy) -> WorkspacePlan:
    """A reentrant first pass's plan, or a recompute pass's."""
    cache = _pass_cache(ctx, inner_plan)
    rebuilds = _leaves_dgrad_copy_to_inner_rebuild(ctx, inner_plan, recompute_copy)
    forward = _pass_forward_usage(ctx, cache, inner_plan, rebuilds)
    source = _pass_backward_source(ctx, inner_plan, rebuilds)
    columnwise = _columnwise_for(ctx, source, forward, parameter=inner_plan.columnwise_source)
    release = Release.NOTHING if ctx.recompute is RecomputePass.FIRST else inner_plan.release
    return _assemble(ctx, cache, forward, source, columnwise, release, inner_plan.parameter_keeps)


def _pass_cache(ctx: WorkspaceContext, inner_plan: WorkspacePlan) -> CacheAction:
    """The first pass caches as the step's forward does; the recompute pass
    only reads what the first pass filled."""
    if ctx.recompute is RecomputePass.RECOMPUTE and inner_plan.cache is not CacheAction.BYPASS:
        if ctx.recompute_scope is RecomputeScope.MODULE and not _requantizes_exactly(ctx):
            # TE's module-own recompute (LayerNormMLP(checkpoint=True))
            # quantizes afresh with the scale current in backward; a
            # cached copy made with an older delayed scale differs.
            return CacheAction.BYPASS
        return CacheAction.READ_ONLY
    return inner_plan.cache


def _regathers(inner_plan: WorkspacePlan) -> bool:
    """Backward obtains the weight again by itself (a distributed weight),
    so nothing a pass builds can serve it."""
    return inner_plan.backward_source is BackwardSource.REGATHER


def _pass_forward_usage(ctx: WorkspaceContext, cache: CacheAction, inner_plan: WorkspacePlan, rebuilds: bool) -> Usage:
    if ctx.is_quantized_param:
        return Usage.ROWWISE
    if _regathers(inner_plan):
        return inner_plan.forward_usage
    if ctx.recompute is RecomputePass.FIRST:
        later_dgrad = ctx.input_requires_grad and ctx.backward_override is BackwardOverride.NONE
        return Usage.BOTH if (cache.writes and later_dgrad) else Usage.ROWWISE
    if rebuilds:
        return inner_plan.forward_usage
    return Usage.BOTH if ctx.quantized_dgrad else Usage.ROWWISE


def _pass_backward_source(ctx: WorkspaceContext, inner_plan: WorkspacePlan, rebuilds: bool) -> BackwardSource:
    if ctx.recompute is RecomputePass.FIRST:
        return BackwardSource.NONE
    if _regathers(inner_plan):
        return inner_plan.backward_source
    if rebuilds:
        return BackwardSource.REQUANTIZE
    return _source_without_rebuild(ctx)


def _leaves_dgrad_copy_to_inner_rebuild(
    ctx: WorkspaceContext, inner_plan: WorkspacePlan, recompute_copy: RecomputeCopy
) -> bool:
    """Whether the recompute pass leaves dgrad's copy to the inner plan's
    backward rebuild instead of saving its own.

    By default (``RecomputeCopy.AS_TE``) it does wherever the inner plan
    rebuilds (FSDP2), as TE's ``te.checkpoint`` pass does: saving the
    pass's copy would hold it from the pass to backward, which costs peak
    memory for a gain not measured. ``BUILD_ONCE`` saves it instead, but
    only for a quantizer that requantizes exactly: TE quantizes a region's
    recompute pass with the first pass's scale (it puts the delayed-scaling
    state back), while its backward rebuild uses the scale current at
    backward, so for the others the saved copy would change dgrad. A
    module's own recompute is exempt: TE hands that pass's copy to backward
    itself.
    """
    if ctx.recompute_scope is RecomputeScope.MODULE:
        return False
    if recompute_copy is RecomputeCopy.BUILD_ONCE and _requantizes_exactly(ctx):
        return False
    return inner_plan.backward_source is BackwardSource.REQUANTIZE


#: The non-recompute policies, one per weight distribution (``shardings``).
_BASE_POLICIES: tuple[type[WorkspacePolicy], ...] = (
    WorkspacePolicy,
    FSDP2WorkspacePolicy,
    DistributedWeightWorkspacePolicy,
)


def base_policy_for(sharding: Sharding) -> type[WorkspacePolicy]:
    """The shipped policy that plans for a weight distribution outside
    recompute passes: the one whose ``shardings`` hold it."""
    return next(policy for policy in _BASE_POLICIES if sharding in policy.shardings)


def _assemble(
    ctx: WorkspaceContext,
    cache: CacheAction,
    forward: Usage,
    source: BackwardSource,
    columnwise: ColumnwiseSource,
    release: Release,
    keeps: Usage,
    gather_refusal: str | None = None,
) -> WorkspacePlan:
    usage = backward_usage(ctx, source)
    notes = plan_notes(ctx, cache, forward, source, columnwise, release, keeps, gather_refusal=gather_refusal)
    return WorkspacePlan(
        cache=cache,
        forward_usage=forward,
        backward_source=source,
        backward_usage=usage,
        columnwise_source=columnwise,
        release=release,
        parameter_keeps=keeps,
        notes=notes,
    )
