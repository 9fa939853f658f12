"""Which policy plans a call, and the bindings' memoized path to its plan.

Separate from ``_policy.py``, which holds only the decisions: choosing a
policy (by the weight's sharding, or the one a user pinned) and remembering
plans per call shape are jobs around the policies, not decisions about a
workspace.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ._context import (
    BackwardOverride,
    Microbatch,
    QuantizerCapabilities,
    RecomputePass,
    RecomputeScope,
    Sharding,
    WeightSource,
    WorkspaceContext,
)
from ._errors import ContextTypeError
from ._plan import WorkspacePlan
from ._policy import (
    DistributedWeightWorkspacePolicy,
    FSDP2WorkspacePolicy,
    KeepForBackwardWorkspacePolicy,
    LeanWorkspacePolicy,
    MicrobatchCache,
    RecomputeCopy,
    RecomputeWorkspacePolicy,
    WorkspacePolicy,
    base_policy_for,
)

__all__ = [
    "select_policy", "resolve_policy", "plan_call", "CallShape", "PlannedCall", "named_policy", "POLICY_NAMES",
]

#: The shipped policies by name: with their defaults, then with an option
#: switched on (off by default: docs/decisions.md, D3 and D4). ``explain
#: --policy NAME`` shows them; tools pin one by name (``named_policy``).
_NAMED: dict[str, WorkspacePolicy] = {
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
}

#: The names :func:`named_policy` knows, in the order ``explain`` shows them.
POLICY_NAMES: tuple[str, ...] = tuple(_NAMED)


def named_policy(name: str) -> WorkspacePolicy:
    """The shipped policy called ``name`` (one of :data:`POLICY_NAMES`), e.g.
    ``named_policy("fsdp2_microbatch_cache")`` to pin an option by name.
    Raises ValueError naming the choices for any other name."""
    try:
        return _NAMED[name]
    except (KeyError, TypeError):
        raise ValueError(f"no shipped policy is named {name!r}; choose from {', '.join(POLICY_NAMES)}") from None


def select_policy(ctx: WorkspaceContext) -> WorkspacePolicy:
    """The policy the manager uses for a call when none is pinned: by the
    weight's sharding, wrapped for recompute passes."""
    if not isinstance(ctx, WorkspaceContext):
        raise ContextTypeError(f"select_policy expects a WorkspaceContext; received {type(ctx).__name__}")
    base = base_policy_for(ctx.sharding)()
    if ctx.recompute is RecomputePass.NONE:
        return base
    return RecomputeWorkspacePolicy(inner=base)


def resolve_policy(ctx: WorkspaceContext, pinned: WorkspacePolicy | None = None) -> WorkspacePolicy:
    """The policy for a call: ``pinned`` if given (wrapped for recompute
    passes when it is not a recompute policy itself), else :func:`select_policy`.

    A pinned policy is not second-guessed: if it does not cover the call's
    setting, planning raises :class:`PolicyMismatchError`.
    """
    if pinned is None:
        return select_policy(ctx)
    if not isinstance(pinned, WorkspacePolicy):
        raise ContextTypeError(
            f"a pinned policy must be a WorkspacePolicy instance (e.g. FSDP2WorkspacePolicy()); "
            f"received {pinned!r} ({type(pinned).__name__})"
        )
    if ctx.recompute is not RecomputePass.NONE and not isinstance(pinned, RecomputeWorkspacePolicy):
        return RecomputeWorkspacePolicy(inner=pinned)
    return pinned


@dataclass(frozen=True, slots=True)
class CallShape:
    """One module call's shape: the arguments of its :class:`WorkspaceContext`,
    by name, with the same defaults, as :func:`plan_call` takes them.

    Frozen and hashable, so that it keys the memo of plans; it checks
    nothing itself (the context built from it does, on every call that is
    not memoized)."""

    capabilities: QuantizerCapabilities
    sharding: Sharding = Sharding.NONE
    recompute: RecomputePass = RecomputePass.NONE
    recompute_scope: RecomputeScope = RecomputeScope.REGION
    grad_enabled: bool = True
    input_requires_grad: bool = True
    weight: WeightSource = WeightSource.HIGH_PRECISION
    microbatch: Microbatch = Microbatch.NONE
    backward_override: BackwardOverride = BackwardOverride.NONE


@dataclass(frozen=True, slots=True)
class PlannedCall:
    """What :func:`plan_call` returns: the call's context and its plan."""

    context: WorkspaceContext
    plan: WorkspacePlan


@functools.lru_cache(maxsize=4096)
def plan_call(pinned: WorkspacePolicy | None, shape: CallShape) -> PlannedCall:
    """The context and plan of one module call, memoized per ``(pinned,
    shape)``; ``pinned`` as for :func:`resolve_policy`.

    Bindings call this on every weight of every call. Building and checking
    a :class:`WorkspaceContext` costs more than the lookup of a memo, and a
    training step repeats a handful of shapes, so each shape is described
    and planned once per process. Sound because contexts are built from
    the shape alone and policies are frozen and pure (a policy's plan
    depends on nothing but the context). Errors are not memoized: a call
    that fails fails again.
    """
    if not isinstance(shape, CallShape):
        raise ContextTypeError(f"plan_call expects a CallShape; received {type(shape).__name__}")
    ctx = WorkspaceContext(
        capabilities=shape.capabilities,
        sharding=shape.sharding,
        recompute=shape.recompute,
        recompute_scope=shape.recompute_scope,
        grad_enabled=shape.grad_enabled,
        input_requires_grad=shape.input_requires_grad,
        weight=shape.weight,
        microbatch=shape.microbatch,
        backward_override=shape.backward_override,
    )
    return PlannedCall(context=ctx, plan=resolve_policy(ctx, pinned).plan(ctx))
