"""Hypothesis strategies for contexts, capabilities and policies.

Shipped with the package so that quantizer authors can property-test their
own capability entries against every policy.
"""

from __future__ import annotations

from ._needs import require_hypothesis

require_hypothesis(__name__)

from hypothesis import strategies as st

from .._context import (
    BackwardOverride,
    Microbatch,
    QuantizerCapabilities,
    RecomputePass,
    RecomputeScope,
    Sharding,
    WeightSource,
    WorkspaceContext,
)
from .._policy import Policy, WorkspacePolicy
from .._selection import select_policy
from .._profiles import PROFILES
from .invariants import SHIPPED_POLICIES
from .plans import meaningful_plans

__all__ = [
    "capabilities", "contexts", "policies", "covering_policies", "valid_plans", "BASE_POLICIES", "ALL_POLICIES",
]

#: One instance of each non-recompute policy.
BASE_POLICIES: tuple[WorkspacePolicy, ...] = SHIPPED_POLICIES[:3]
#: Every policy the core ships, recompute wrappers included.
ALL_POLICIES: tuple[Policy, ...] = SHIPPED_POLICIES


@st.composite
def capabilities(draw, names=st.sampled_from(["fake_a", "fake_b", "fake_c"])) -> QuantizerCapabilities:
    """Any combination of the three capability facts, plus the real TE profiles."""
    invented = st.builds(
        QuantizerCapabilities,
        name=names,
        columnwise_derivable=st.booleans(),
        derived_caches=st.booleans(),
        requantization_safe=st.booleans(),
    )
    return draw(st.one_of(invented, st.sampled_from(sorted(PROFILES.values(), key=lambda p: p.name))))


@st.composite
def contexts(
    draw,
    capabilities=capabilities(),
    sharding=st.sampled_from(list(Sharding)),
    recompute=st.sampled_from(list(RecomputePass)),
    scope=st.sampled_from(list(RecomputeScope)),
    weight=st.sampled_from(list(WeightSource)),
    grad_enabled=st.booleans(),
    microbatch=st.sampled_from(list(Microbatch)),
    backward_override=st.sampled_from(list(BackwardOverride)),
) -> WorkspaceContext:
    """Every valid call context (the recompute pass always has grad enabled;
    a module's own recompute scope only with a recompute pass)."""
    rpass = draw(recompute)
    grad = True if rpass is RecomputePass.RECOMPUTE else draw(grad_enabled)
    region = rpass is RecomputePass.NONE
    rscope = RecomputeScope.REGION if region else draw(scope)
    return WorkspaceContext(
        capabilities=draw(capabilities),
        sharding=draw(sharding),
        recompute=rpass,
        recompute_scope=rscope,
        grad_enabled=grad,
        input_requires_grad=draw(st.booleans()),
        weight=draw(weight),
        microbatch=draw(microbatch),
        backward_override=draw(backward_override),
    )


def policies() -> st.SearchStrategy[Policy]:
    return st.sampled_from(ALL_POLICIES)


@st.composite
def covering_policies(draw, contexts=contexts()) -> tuple[Policy, WorkspaceContext]:
    """A context and a policy that plans it: the selected one, or any shipped
    policy that covers the context."""
    ctx = draw(contexts)
    candidates = [p for p in ALL_POLICIES if p.covers(ctx)]
    candidates.append(select_policy(ctx))
    return draw(st.sampled_from(candidates)), ctx


def valid_plans(context: WorkspaceContext, *, cache_filled: bool | None = None) -> st.SearchStrategy:
    """Plans that WorkspacePlan accepts and that mean something for
    ``context``: drawn from :func:`workspace_manager.testing.plans.meaningful_plans`,
    whose docstring states the rules. ``cache_filled`` says whether a cache
    entry filled since the last weight update may exist."""
    return st.sampled_from(meaningful_plans(context, cache_filled=cache_filled))
