"""What one weight's plan turns into for TE: its :class:`Levers`.

TE 2.20's code offers a handful of levers per weight and call: the usages
the forward quantizer builds, the module's workspace cache, its ``is_fsdp2``
switch (save the workspace for backward or not), the weight quantizer
backward rebuilds with, its in-backward ``clear_columnwise_cache``, and what
the binding releases afterwards. :func:`levers_from_plan` is the one pure
map from a plan to those levers; ``_plan_support`` refuses the plans the
levers cannot express.
"""

from __future__ import annotations

from dataclasses import dataclass

from workspace_manager import (
    BackwardSource,
    CacheAction,
    RecomputePass,
    Release,
    Usage,
    WorkspaceContext,
    WorkspacePlan,
)

__all__ = ["Levers", "levers_from_plan"]


@dataclass(frozen=True, slots=True)
class Levers:
    """What one weight's plan turns into for TE, for one call shape."""

    key: str
    context: WorkspaceContext
    plan: WorkspacePlan
    is_quantized_param: bool
    #: Forward quantizes columnwise data too (high-precision weights).
    forward_columnwise: bool
    cache: CacheAction
    #: TE's ``is_fsdp2`` in forward: True makes TE save no workspace.
    saves_no_workspace: bool
    #: TE's in-backward ``clear_columnwise_cache`` on the weight dgrad read.
    clears_in_backward: bool
    #: ``backward_override="high_precision"``: TE must not rebuild a quantized weight.
    dgrad_reads_high_precision: bool
    #: After backward: clear the quantized parameter's derived columnwise data.
    release_columnwise: bool
    #: After backward: mark the cached workspace for release after the step.
    release_cache: bool
    #: Either release: the call's backward has something to do.
    releases: bool
    #: A cache entry is stale once the weight's version counter moved, not
    #: only after a step: false under FSDP2, where every all-gather moves
    #: the gathered weight's counter and the weight changes only at the step.
    cache_tracks_version: bool
    #: The workspace saved for backward keeps only its columnwise data; the
    #: rowwise data is dropped once the forward GEMM has read it
    #: (docs/decisions.md, D11).
    saves_columnwise_only: bool
    #: The usages a backward rebuild builds where they are fewer than the
    #: both usages TE's rebuild asks for (docs/decisions.md, D9); None: TE's
    #: own rebuild, or no rebuild.
    rebuild_usage: Usage | None


def levers_from_plan(key: str, context: WorkspaceContext, plan: WorkspacePlan) -> Levers:
    """The TE levers that carry out ``plan`` (a pure function of the plan)."""
    is_qp = context.is_quantized_param
    source = plan.backward_source
    rebuilds = source is BackwardSource.REQUANTIZE
    release_columnwise = is_qp and Release.DERIVED_COLUMNWISE in plan.release
    release_cache = Release.CACHED_WORKSPACE in plan.release
    return Levers(
        key=key,
        context=context,
        plan=plan,
        is_quantized_param=is_qp,
        forward_columnwise=Usage.COLUMNWISE in plan.forward_usage,
        cache=plan.cache,
        saves_no_workspace=not is_qp and source in _SOURCES_WITHOUT_SAVED_WORKSPACE,
        # A rebuilt temporary is freed early (lower backward peak); a derived
        # cache on a quantized parameter is cleared by TE; never a cached workspace.
        clears_in_backward=rebuilds or (is_qp and Release.DERIVED_COLUMNWISE in plan.release),
        dgrad_reads_high_precision=source is BackwardSource.HIGH_PRECISION,
        release_columnwise=release_columnwise,
        release_cache=release_cache,
        releases=release_columnwise or release_cache,
        cache_tracks_version=not context.sharding.is_fsdp2,
        saves_columnwise_only=_saves_columnwise_only(context, plan),
        rebuild_usage=plan.backward_usage if rebuilds and plan.backward_usage is not Usage.BOTH else None,
    )


#: Backward sources for which TE must not save the forward's workspace.
_SOURCES_WITHOUT_SAVED_WORKSPACE = (BackwardSource.REQUANTIZE, BackwardSource.REGATHER, BackwardSource.HIGH_PRECISION,
                     BackwardSource.NONE)


#: Cache actions under which a saved workspace is fresh: always for BYPASS,
#: on a miss for READ_ONLY (a miss is not stored).
_FRESH_WORKSPACE_CACHE_ACTIONS = (CacheAction.BYPASS, CacheAction.READ_ONLY)


def _saves_columnwise_only(context: WorkspaceContext, plan: WorkspacePlan) -> bool:
    """A fresh high-precision-weight workspace saved for a backward that
    reads only its columnwise data (docs/decisions.md, D11). Not a cache entry (later microbatches
    read its rowwise data), not a quantized parameter (it is the weight),
    and not in a recompute pass (TE hands that copy to backward itself)."""
    return (
        not context.is_quantized_param
        and plan.cache in _FRESH_WORKSPACE_CACHE_ACTIONS
        and plan.backward_source is BackwardSource.SAVED_WORKSPACE
        and plan.backward_usage == Usage.COLUMNWISE
        and Usage.COLUMNWISE in plan.forward_usage
        and context.recompute is RecomputePass.NONE
    )
