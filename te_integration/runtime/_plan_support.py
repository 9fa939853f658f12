"""Which valid plans TE 2.20 can carry out, and the error for the rest.

A :class:`WorkspacePlan` is valid on its own terms (``_plan.py`` refuses
contradictions). Whether TE can carry it out depends on the call too, and on
the levers TE's code offers: the forward quantizer's usages, the cache, TE's
``is_fsdp2`` switch (save the workspace or not), the rebuild quantizer in
backward, the in-backward clear, and what the binding releases afterwards
(see ``_state.levers_from_plan``). Every plan these levers can express runs;
for any other, planning raises :class:`UnsupportedPlanError` before TE runs,
naming the field, the context and what to change. Nothing is carried out
differently from what the plan says.

The rules, each tied to what TE's backward reads (``module/linear.py``'s
``_linear_backward_impl``, and the same blocks in ``layernorm_linear.py``
and ``layernorm_mlp.py``):

* No backward follows (grad off): nothing is kept for it, so
  ``backward_source`` is ``none``. A non-reentrant checkpoint's first pass
  (grad on) is checked against its recompute pass (the last rule); the
  backward fields of the recompute pass are checked there.
* dgrad under ``backward_override="high_precision"`` reads the
  high-precision weight; otherwise it reads a quantized one, with the usages
  the context implies (columnwise; rowwise for ``"dequantized"``).
* A high-precision weight's backward gets a saved workspace or a rebuild;
  a quantized parameter's is the parameter itself; a distributed weight's
  is re-gathered (TE's ``DistributedWeight`` path has no other lever).
* Columnwise data derived from rowwise data needs a derivable format.
* A fresh saved workspace keeps what forward built, less its rowwise data
  where backward reads columnwise data only (D11); columnwise data that
  backward does not read cannot be left out.
* A non-reentrant checkpoint's two passes keep the same things. Its first
  pass runs with grad on, so TE saves for backward as usual; the checkpoint
  keeps only the position of each saved tensor, and backward runs on the
  first pass's ``ctx`` with the recompute pass's tensors put back by
  position (``transformer_engine/pytorch/distributed.py``,
  ``_checkpoint_hook`` and ``_recomputation_hook``). A first pass that
  saves a workspace and a recompute pass that saves the weight (or the
  other way round) do not line up, and TE's backward fails on them. So the
  first pass's ``backward_source``, ``backward_usage``, ``forward_usage``
  and ``release`` must equal those the same policy gives the recompute
  pass; and where a saved workspace's columnwise data is read in backward
  but not built in forward, both passes bypass the cache or neither does (a cache entry is saved
  with columnwise data derived for it, a fresh workspace without)
  (:func:`recompute_mismatch_reason`). A reentrant checkpoint's first pass
  runs with grad off and saves nothing, so the rule never applies to it.
"""

from __future__ import annotations

from workspace_manager import (
    BackwardOverride,
    BackwardSource,
    CacheAction,
    ColumnwiseSource,
    Release,
    Sharding,
    UnsupportedPlanError,
    Usage,
    WorkspaceContext,
    WorkspacePlan,
)

__all__ = ["unsupported_reason", "require_supported", "plan_refusal", "recompute_mismatch_reason", "require_same_passes"]

_HIGH_PRECISION_SOURCES = (BackwardSource.SAVED_WORKSPACE, BackwardSource.REQUANTIZE)


def unsupported_reason(context: WorkspaceContext, plan: WorkspacePlan) -> str | None:
    """Why TE 2.20 cannot carry out ``plan`` for ``context`` (naming the
    field), or None when it can. Pure: a function of its two arguments."""
    for rule in (_backward_rule, _weight_rule, _columnwise_rule, _saved_rule):
        reason = rule(context, plan)
        if reason is not None:
            return reason
    return None


def require_supported(key: str, context: WorkspaceContext, plan: WorkspacePlan) -> None:
    """Raise :class:`UnsupportedPlanError` when ``plan`` cannot run for ``context``."""
    reason = unsupported_reason(context, plan)
    if reason is not None:
        raise plan_refusal(key, reason, context, plan)


def plan_refusal(key: str, reason: str, context: WorkspaceContext, plan: WorkspacePlan) -> UnsupportedPlanError:
    """The error for a plan TE cannot carry out for ``key``, ``reason`` naming the field."""
    return UnsupportedPlanError(
        f"TE 2.20 cannot carry out the plan for {key}: {reason}. Plan: {plan.summary()}. Context: {context}. "
        "Change the policy so that it plans this context differently (te_integration.debug.unsupported_reason "
        "checks a plan without running TE)."
    )


def recompute_mismatch_reason(first: WorkspacePlan, recompute: WorkspacePlan) -> str | None:
    """Why a non-reentrant checkpoint cannot run a first pass planned
    ``first`` whose recompute pass is planned ``recompute`` (naming the
    field), or None when the two keep the same things for backward."""
    for field in _SAVE_FIELDS:
        mine, theirs = getattr(first, field), getattr(recompute, field)
        if mine != theirs:
            return (f"{field} is {_label(mine)} in a non-reentrant checkpoint's first pass but {_label(theirs)} in "
                    "its recompute pass; backward reads the first pass's record with the recompute pass's tensors "
                    f"put back by position, so both passes must plan the same {field}")
    derived_later = Usage.COLUMNWISE in first.backward_usage and Usage.COLUMNWISE not in first.forward_usage
    if (first.backward_source is BackwardSource.SAVED_WORKSPACE and derived_later
            and (first.cache is CacheAction.BYPASS) != (recompute.cache is CacheAction.BYPASS)):
        # Found by the GPU drawn-plan test: bypass in the first pass, fill in the recompute pass.
        return (f"cache is {first.cache.value} in a non-reentrant checkpoint's first pass but {recompute.cache.value} "
                "in its recompute pass, for a saved workspace whose columnwise data backward reads but forward does "
                "not build: a fresh workspace is saved with its rowwise data only, a cache entry with the columnwise "
                "data derived for it, so the two "
                "passes would save different tensors, which backward matches by position: bypass the cache in both "
                "passes or in neither, or build both usages in forward")
    return None


#: The plan fields that decide which tensors a call saves for backward.
_SAVE_FIELDS = ("backward_source", "backward_usage", "forward_usage", "release")


def require_same_passes(key: str, context: WorkspaceContext, first: WorkspacePlan,
                        recompute: WorkspacePlan) -> None:
    """Raise :class:`UnsupportedPlanError` when a non-reentrant first pass
    (``context``, planned ``first``) and its recompute pass disagree."""
    reason = recompute_mismatch_reason(first, recompute)
    if reason is not None:
        raise UnsupportedPlanError(
            f"TE 2.20 cannot carry out the plans for {key}: {reason}. First pass: {first.summary()}. Recompute "
            f"pass: {recompute.summary()}. Context of the first pass: {context}. Make the policy plan both "
            "passes alike, or use a reentrant checkpoint (its first pass saves nothing)."
        )


def _label(value) -> str:
    """How plans print a field's value (flags have a label, enums a value)."""
    label = getattr(value, "label", None)
    return label if isinstance(label, str) else str(value.value)


def _backward_rule(context: WorkspaceContext, plan: WorkspacePlan) -> str | None:
    """What backward reads, given the call."""
    source = plan.backward_source
    if not context.grad_enabled:
        if source is not BackwardSource.NONE:
            return (f"backward_source={source.value}, but grad is off, so no backward follows this call and "
                    "nothing can be kept for it: use backward_source=none")
        return None
    if not context.training:
        # A non-reentrant checkpoint's first pass: backward reads the
        # recompute pass's tensors, planned and checked at that pass; the
        # binding checks that both passes keep the same things.
        return None
    override = context.backward_override
    if source is BackwardSource.HIGH_PRECISION and override is not BackwardOverride.HIGH_PRECISION:
        return ("backward_source=high_precision needs backward_override='high_precision' (TE's dgrad reads a "
                "quantized weight otherwise)")
    if not context.needs_dgrad:
        return None  # wgrad only: whatever is kept goes unread, but is kept as planned
    if override is BackwardOverride.HIGH_PRECISION:
        if source is not BackwardSource.HIGH_PRECISION:
            return (f"backward_source={source.value}, but under backward_override='high_precision' TE's dgrad "
                    "reads the high-precision weight: use backward_source=high_precision")
        return None
    if source is BackwardSource.NONE:
        return "backward_source=none, but dgrad reads this weight (the input requires grad)"
    needed = Usage.ROWWISE if override is BackwardOverride.DEQUANTIZED else Usage.COLUMNWISE
    if needed not in plan.backward_usage:
        return (f"backward_usage={plan.backward_usage.label}, but TE's dgrad reads {needed.label} data in this "
                "context")
    return None


def _weight_rule(context: WorkspaceContext, plan: WorkspacePlan) -> str | None:
    """What each kind of weight can be given."""
    source = plan.backward_source
    if context.sharding is Sharding.DISTRIBUTED_WEIGHT:
        return _distributed_rule(plan)
    if context.is_quantized_param:
        if source in _HIGH_PRECISION_SOURCES or source is BackwardSource.REGATHER:
            return (f"backward_source={source.value} is for high-precision or distributed weights; a quantized "
                    "parameter's backward reads the parameter (saved_parameter)")
        if plan.cache is not CacheAction.BYPASS:
            return f"cache={plan.cache.value}: TE never caches a quantized parameter (it is its own workspace)"
        if not context.sharding.is_fsdp2 and plan.parameter_keeps is not Usage.BOTH:
            # Found by the GPU drawn-plan test: an unsharded parameter kept both after the step.
            return (f"parameter_keeps={plan.parameter_keeps.label}: the binding trims FSDP2 shards only; an unsharded "
                    "quantized parameter keeps the usages TE gives it (rowwise+columnwise)")
        return None
    if source in (BackwardSource.SAVED_PARAMETER, BackwardSource.REGATHER):
        return (f"backward_source={source.value} needs a quantized parameter or a distributed weight; this weight "
                "is high precision: use saved_workspace or requantize")
    if plan.parameter_keeps is not Usage.NONE:
        return f"parameter_keeps={plan.parameter_keeps.label} applies to quantized parameters only; use none"
    if Release.DERIVED_COLUMNWISE in plan.release:
        return "release=derived_columnwise applies to quantized parameters only"
    return None


def _distributed_rule(plan: WorkspacePlan) -> str | None:
    """TE's ``DistributedWeight`` path: gathered per forward, gathered again in backward."""
    if plan.cache is not CacheAction.BYPASS:
        return (f"cache={plan.cache.value}: a distributed weight is gathered for each call, and TE 2.20 keeps no "
                "workspace of it; use cache=bypass")
    if plan.backward_source in _HIGH_PRECISION_SOURCES + (BackwardSource.SAVED_PARAMETER,):
        return (f"backward_source={plan.backward_source.value}: TE re-gathers a distributed weight in backward "
                "(regather)")
    if plan.forward_usage is not Usage.ROWWISE:
        return "forward_usage must be rowwise for a distributed weight (its backward builds its own columnwise data)"
    return None


def _saved_rule(context: WorkspaceContext, plan: WorkspacePlan) -> str | None:
    """What a fresh saved workspace keeps: TE keeps what forward built, and
    the binding can leave out rowwise data only (D11)."""
    # READ_ONLY too: its miss saves a fresh workspace, as a bypass does
    # (found by the CPU drawn-plan test).
    if (not context.is_quantized_param and plan.backward_source is BackwardSource.SAVED_WORKSPACE
            and plan.cache in (CacheAction.BYPASS, CacheAction.READ_ONLY)
            and Usage.COLUMNWISE in plan.forward_usage and Usage.COLUMNWISE not in plan.backward_usage):
        return (f"forward_usage={plan.forward_usage.label} with backward_usage={plan.backward_usage.label}: the saved "
                "workspace would keep columnwise data backward never reads, and TE 2.20 offers no way to drop it; "
                "use forward_usage=rowwise")
    return None


def _columnwise_rule(context: WorkspaceContext, plan: WorkspacePlan) -> str | None:
    if plan.columnwise_source is ColumnwiseSource.DERIVED and not context.capabilities.columnwise_derivable:
        return (f"columnwise_source=derived, but {context.capabilities.name} cannot derive columnwise data from "
                "rowwise data")
    return None
