"""Which valid plans TE 2.20's ``te.ops.BasicLinear`` can carry out.

The ops' levers are fewer than the modules' (``_plan_support``, whose rules
apply too): ``te.ops`` has no weight cache and no ``is_first_microbatch``;
its forward builds a weight's columnwise data exactly when it saves the
workspace for dgrad, and then saves only that columnwise data
(``update_usage(rowwise_usage=False, columnwise_usage=True)`` in
``BasicLinear._functional_forward``); the binding's one lever there makes it
build rowwise data only and save the high-precision weight, which backward
quantizes again with the op's weight quantizer (``_functional_backward``).
Under ``backward_override="dequantized"`` that backward dequantizes what it
is given; the binding's ``_functional_backward`` seam quantizes a weight
planned ``requantize`` first (``kinds/ops_linear``).
"""

from __future__ import annotations

from workspace_manager import (BackwardOverride, BackwardSource, CacheAction, Release, Usage, WorkspaceContext,
                               WorkspacePlan)

__all__ = ["ops_unsupported_reason"]


def ops_unsupported_reason(context: WorkspaceContext, plan: WorkspacePlan) -> str | None:
    """Why ``te.ops.BasicLinear`` cannot carry out ``plan`` for ``context``
    (naming the field), or None. Pure."""
    if plan.cache is not CacheAction.BYPASS or Release.CACHED_WORKSPACE in plan.release:
        return (f"cache={plan.cache.value}: te.ops keeps no weight cache (it takes no is_first_microbatch); "
                "use cache=bypass")
    if context.is_quantized_param:
        return None  # the parameter is its own workspace, as for the modules
    # A non-reentrant checkpoint's first pass runs with grad on and te.ops
    # saves as for any training call (the recompute pass's plan, which it takes).
    source, dgrad = plan.backward_source, context.grad_enabled and context.input_requires_grad
    if source is BackwardSource.SAVED_WORKSPACE:
        if not dgrad:
            return ("backward_source=saved_workspace, but te.ops saves no weight workspace for a call whose "
                    "input needs no grad: use backward_source=none")
        dequantized = context.backward_override is BackwardOverride.DEQUANTIZED
        wanted = (Usage.ROWWISE, Usage.ROWWISE) if dequantized else (Usage.BOTH, Usage.COLUMNWISE)
        if (plan.forward_usage, plan.backward_usage) != wanted:
            return (f"forward_usage={plan.forward_usage.label} with backward_usage={plan.backward_usage.label} "
                    "for a saved workspace: te.ops builds and saves "
                    f"{wanted[0].label} then {wanted[1].label} in this context and offers no other choice")
        return None
    if plan.forward_usage is not Usage.ROWWISE:
        return (f"forward_usage={plan.forward_usage.label} with backward_source={source.value}: te.ops's forward "
                "builds columnwise data only for a workspace it saves; use forward_usage=rowwise")
    return None
