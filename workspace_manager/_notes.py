"""Plan notes: why a plan is what it is, in words.

Notes are presentation, derived from the context and the decisions alone.
They live apart from the policies (which attach them to every plan) and from
the decision table (which prints them), so that neither imports the other.
"""

from __future__ import annotations

from ._context import Microbatch, RecomputePass, ShardGather, Sharding, WorkspaceContext
from ._plan import BackwardSource, CacheAction, ColumnwiseSource, Release, Usage, WorkspaceOrigin

__all__ = ["plan_notes"]


def plan_notes(
    ctx: WorkspaceContext,
    cache: CacheAction,
    forward: Usage,
    source: BackwardSource,
    columnwise: ColumnwiseSource,
    release: Release,
    keeps: Usage = Usage.NONE,
    origin: WorkspaceOrigin = WorkspaceOrigin.CALL,
    gather_refusal: str | None = None,
) -> tuple[str, ...]:
    """Why a plan is what it is, one short sentence per decision that needs
    one. ``gather_refusal``: why the policy makes the workspace in the call
    although a quantized all-gather is set up (``ctx.shard_gather``)."""
    notes = [_origin_note(ctx, origin, gather_refusal)]
    if origin is WorkspaceOrigin.CALL:  # a workspace made from the shard is cached by no module
        notes.append(_cache_note(ctx, cache))
    if source is BackwardSource.REGATHER:
        notes.append("nothing is saved; backward gathers the distributed weight again")
    elif source is BackwardSource.REQUANTIZE:
        notes.append("nothing quantized is saved; backward quantizes the weight it has again")
        if ctx.recompute is RecomputePass.RECOMPUTE:
            notes.append(_recompute_rebuild_note(ctx))
    elif source is BackwardSource.SAVED_WORKSPACE and _kept_under_fsdp2(ctx, cache):
        notes.append("forward's copy is kept for this layer's backward, which quantizes nothing: "
                     "memory from forward to backward for one quantization less")
    elif source is BackwardSource.SAVED_WORKSPACE and ctx.recompute is RecomputePass.RECOMPUTE and ctx.sharding.is_fsdp2:
        notes.append("this pass's copy is kept for the backward that follows at once, which quantizes nothing")
    if columnwise is ColumnwiseSource.REQUANTIZED and not ctx.capabilities.requantization_safe:
        notes.append(
            f"{ctx.capabilities.name} does not requantize exactly: dgrad may see another "
            "quantization than fprop (TE 2.20 does the same)"
        )
    if source is BackwardSource.NONE and ctx.training and not ctx.input_requires_grad:
        notes.append("no dgrad: nothing is kept for backward")
    if columnwise is ColumnwiseSource.DERIVED:
        notes.append(f"columnwise derived from rowwise ({ctx.capabilities.name} allows it)")
    if Release.DERIVED_COLUMNWISE in release:
        notes.append("derived columnwise data cleared after backward; FSDP2 cannot free it (TE#2717)")
    if Release.CACHED_WORKSPACE in release:
        notes.append("cached workspace dropped after the step's last backward")
    if keeps is Usage.ROWWISE:
        notes.append("the sharded parameter keeps rowwise data only: its all-gather sends no more")
    return tuple(n for n in notes if n)


def _origin_note(ctx: WorkspaceContext, origin: WorkspaceOrigin, refusal: str | None) -> str:
    """Where the workspace is made, where a quantized all-gather is set up."""
    if origin is WorkspaceOrigin.SHARD:
        return ("made from the shard before FSDP2's all-gather, once per optimizer step: the gather sends "
                "1 byte per parameter and the call quantizes nothing")
    if ctx.shard_gather is ShardGather.NONE:
        return ""
    return f"made in the call, not from the shard: {refusal or 'the policy makes every workspace in the call'}"


def _recompute_rebuild_note(ctx: WorkspaceContext) -> str:
    if not ctx.capabilities.requantization_safe:
        return ("this pass quantizes with the first pass's scale, backward with its own: the rebuild "
                "is kept so that dgrad sees TE's bytes")
    return ("this pass builds no copy for backward, as TE does; RecomputeCopy.BUILD_ONCE saves one "
            "instead (one quantization less, more memory)")


def _kept_under_fsdp2(ctx: WorkspaceContext, cache: CacheAction) -> bool:
    """A fresh copy of a gathered weight saved for backward, outside a
    recompute pass (which hands its copy to backward anyway): the choice of
    KeepForBackwardWorkspacePolicy, where FSDP2's default rebuilds."""
    return ctx.sharding.is_fsdp2 and cache is CacheAction.BYPASS and ctx.recompute is RecomputePass.NONE


def _cache_note(ctx: WorkspaceContext, cache: CacheAction) -> str:
    if cache is CacheAction.FILL:
        return "first microbatch: quantize into the cache"
    if cache is CacheAction.REUSE:
        return "later microbatch: weight unchanged, reuse the cache"
    if cache is CacheAction.READ_ONLY:
        return "recompute pass: read the cache, never write it"
    if ctx.is_quantized_param:
        return "quantized parameter: nothing to cache"
    if ctx.sharding is Sharding.FSDP2_RESHARD:
        return "FSDP2 reshards after forward: no cached copy per layer (TE#2681)"
    if ctx.sharding is Sharding.DISTRIBUTED_WEIGHT:
        return "distributed weight: no cached copy of the gathered weight"
    if ctx.microbatch is Microbatch.NONE:
        return "no microbatch position: not cached"
    if ctx.grad_enabled and not ctx.capabilities.requantization_safe:
        return f"{ctx.capabilities.name} does not requantize exactly: reusing would differ from TE, not cached"
    if ctx.grad_enabled and ctx.sharding.is_fsdp2:
        return ("FSDP2: every microbatch quantizes again, as TE does; MicrobatchCache.EXACT_FORMATS "
                "caches instead (one copy per weight for the step)")
    return "no backward to drop a cache after: not cached"
