"""Which policy plans a call, and the bindings' path to its plan.

Separate from ``_policy.py``, which holds only the decisions: choosing a
policy (by the weight's sharding, or the one a user pinned) is a job around
the policies, not a decision about a workspace.
"""

from __future__ import annotations

import difflib

from ._context import RecomputePass, WorkspaceContext
from ._errors import ContextTypeError, InvalidPlanError, UnknownPolicyError
from ._plan import WorkspaceOrigin, WorkspacePlan
from ._policy import (
    DistributedWeightWorkspacePolicy,
    FSDP2WorkspacePolicy,
    KeepForBackwardWorkspacePolicy,
    LeanWorkspacePolicy,
    MicrobatchCache,
    Policy,
    RecomputeCopy,
    RecomputeWorkspacePolicy,
    WorkspacePolicy,
    QuantizedGather,
    base_policy_for,
    shard_gather_refusal,
)

__all__ = ["select_policy", "resolve_policy", "plan_call", "named_policy", "POLICY_NAMES"]

#: The shipped policies by name: with their defaults, then with an option
#: switched on (off by default: docs/decisions.md, D3 and D4). ``explain
#: --policy NAME`` shows them; tools pin one by name (``named_policy``).
_NAMED: dict[str, Policy] = {
    "plain": WorkspacePolicy(),
    "fsdp2": FSDP2WorkspacePolicy(),
    "recompute": RecomputeWorkspacePolicy(inner=WorkspacePolicy()),
    "fsdp2_recompute": RecomputeWorkspacePolicy(inner=FSDP2WorkspacePolicy()),
    "distributed_weight": DistributedWeightWorkspacePolicy(),
    "lean": LeanWorkspacePolicy(),
    "keep_for_backward": KeepForBackwardWorkspacePolicy(),
    "fsdp2_microbatch_cache": FSDP2WorkspacePolicy(microbatch_cache=MicrobatchCache.EXACT_FORMATS),
    "fsdp2_recompute_build_once": RecomputeWorkspacePolicy(
        inner=FSDP2WorkspacePolicy(), recompute_copy=RecomputeCopy.BUILD_ONCE),
    "fsdp2_quantized_gather_on": FSDP2WorkspacePolicy(quantized_gather=QuantizedGather.ON),
}

#: The names :func:`named_policy` knows, in the order ``explain`` shows them.
POLICY_NAMES: tuple[str, ...] = tuple(_NAMED)


def named_policy(name: str) -> Policy:
    """The shipped policy called ``name`` (one of :data:`POLICY_NAMES`, in
    any case, as ``explain --policy`` takes it), e.g.
    ``named_policy("fsdp2_microbatch_cache")`` to pin an option by name.
    Any other name raises :class:`UnknownPolicyError` (a ValueError and a
    KeyError) naming the choices and the closest one."""
    if not isinstance(name, str):
        raise UnknownPolicyError(f"named_policy expects a policy name (a str); received {name!r} "
                                 f"({type(name).__name__}); choose from {', '.join(POLICY_NAMES)}")
    policy = _NAMED.get(name.lower())
    if policy is None:
        close = difflib.get_close_matches(name.lower(), POLICY_NAMES, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise UnknownPolicyError(f"no shipped policy is named {name!r}; choose from {', '.join(POLICY_NAMES)}{hint}")
    return policy


def select_policy(ctx: WorkspaceContext) -> Policy:
    """The policy the manager uses for a call when none is pinned: by the
    weight's sharding, wrapped for recompute passes."""
    if not isinstance(ctx, WorkspaceContext):
        raise ContextTypeError(f"select_policy expects a WorkspaceContext; received {type(ctx).__name__}")
    base = base_policy_for(ctx.sharding)()
    if ctx.recompute is RecomputePass.NONE:
        return base
    return RecomputeWorkspacePolicy(inner=base)


def resolve_policy(ctx: WorkspaceContext, pinned: Policy | None = None) -> Policy:
    """The policy for a call: ``pinned`` if given (wrapped in a
    RecomputeWorkspacePolicy for a recompute pass it does not plan itself,
    see ``Policy.recompute_passes``), else :func:`select_policy`.

    A pinned policy is not second-guessed: if it does not cover the call's
    setting, planning raises :class:`PolicyMismatchError`.
    """
    if pinned is None:
        return select_policy(ctx)
    if not isinstance(ctx, WorkspaceContext):
        raise ContextTypeError(f"resolve_policy expects a WorkspaceContext; received {type(ctx).__name__}")
    if not isinstance(pinned, Policy):
        raise ContextTypeError(f"a pinned policy must be a Policy instance (e.g. FSDP2WorkspacePolicy()); "
                               f"received {pinned!r} ({type(pinned).__name__}){_by_name_hint(pinned)}")
    if ctx.recompute not in pinned.recompute_passes:
        return RecomputeWorkspacePolicy(inner=pinned)
    return pinned


def _by_name_hint(pinned: object) -> str:
    """For a policy's name given where a policy belongs: how to get the policy."""
    if not isinstance(pinned, str):
        return ""
    return f"; for a shipped policy by its name, pass named_policy({pinned!r})"


def plan_call(ctx: WorkspaceContext, pinned: Policy | None = None) -> WorkspacePlan:
    """The plan of one module call: :func:`resolve_policy`'s policy asked
    about ``ctx``. What a binding calls when a call is not in its memo.

    Not memoized here: the one memo of plans is the binding's, per module,
    keyed by the values it reads from the call (``te_integration/_state.py``
    says why that key is not a WorkspaceContext). A policy is frozen and
    pure, so its plan depends on ``ctx`` alone and may be kept for every
    later call of the same description. Errors are raised on every call.

    A plan that makes the workspace from the shard where that cannot be
    done, or not exactly (``shard_gather_refusal``), raises
    :class:`InvalidPlanError` naming why: a policy of one's own may return one.
    """
    policy = resolve_policy(ctx, pinned)
    plan = policy.plan(ctx)
    if plan.workspace_origin is WorkspaceOrigin.SHARD:
        refusal = shard_gather_refusal(ctx)
        if refusal is not None:
            raise InvalidPlanError(
                f"{policy!r} makes the workspace from the shard (workspace_origin=shard), but {refusal}. "
                "Plan workspace_origin=WorkspaceOrigin.CALL for this call."
            )
    return plan
