"""invariants.check_policy: every plan invariant on every plan of a policy
someone wrote, with the failing invariant and context named."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from workspace_manager import (
    BackwardSource,
    CacheAction,
    FSDP2WorkspacePolicy,
    Sharding,
    WorkspaceContext,
    WorkspacePolicy,
)
from workspace_manager.extending import PROFILES
from workspace_manager.testing import invariants as inv

CURRENT = PROFILES["float8_current_scaling"]


@dataclass(frozen=True)
class _RebuildsButBuildsColumnwise(WorkspacePolicy):
    """Requantizes in backward, yet forward still builds columnwise data: waste."""

    def backward_source(self, ctx: WorkspaceContext, cache: CacheAction) -> BackwardSource:
        source = super().backward_source(ctx, cache)
        return BackwardSource.REQUANTIZE if source is BackwardSource.SAVED_WORKSPACE else source

    def cache_action(self, ctx: WorkspaceContext) -> CacheAction:
        return CacheAction.BYPASS


def test_it_counts_the_plans_of_the_shardings_the_policy_plans():
    # Recompute passes are counted too: planned by the policy itself, they
    # would raise PolicyMismatchError, so they go through the wrapper.
    def of(sharding):
        return sum(c.sharding is sharding for c in inv.all_contexts(CURRENT))

    assert of(Sharding.NONE) > 0
    assert inv.check_policy(WorkspacePolicy(), CURRENT) == of(Sharding.NONE)
    fsdp2 = of(Sharding.FSDP2_RESHARD) + of(Sharding.FSDP2_KEEP)  # with and without a quantized all-gather
    assert inv.check_policy(FSDP2WorkspacePolicy(), [CURRENT, PROFILES["mxfp8"]]) == 2 * fsdp2


def test_a_broken_policy_fails_with_the_invariant_and_the_context_named():
    with pytest.raises(inv.InvariantViolation) as info:
        inv.check_policy(_RebuildsButBuildsColumnwise(), CURRENT)
    message = str(info.value)
    assert message.startswith("columnwise_built_in_forward_is_used: _RebuildsButBuildsColumnwise()")
    assert "forward=rowwise+columnwise backward=requantize" in message and "sharding=<Sharding.NONE" in message
