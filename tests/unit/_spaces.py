"""The finite spaces the policy tests enumerate instead of drawing from.

Every field of a :class:`WorkspaceContext` is an enum or a bool, and of a
quantizer's capabilities the plans read four booleans (the name is only
printed, in notes). So the contexts a property of the plans must hold on
are finitely many: every valid context (``valid_contexts``) with each
capability set below, 1,728 per set. Checking a property on all of them
takes seconds and cannot miss the one context a hundred drawn examples
would, so the tests of plans loop over these instead of asking Hypothesis.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterable, Iterator

from workspace_manager import QuantizerCapabilities, WorkspaceContext, WorkspacePlan, select_policy
from workspace_manager.extending import PROFILES
from workspace_manager.testing.invariants import all_contexts, covering

#: One capability set per combination of the first three facts, under one
#: invented name, none claiming ``shard_quantization_exact``...
FLAG_SETS: tuple[QuantizerCapabilities, ...] = tuple(
    QuantizerCapabilities(name="fake_a", columnwise_derivable=a, derived_caches=b, requantization_safe=c)
    for a, b, c in itertools.product([False, True], repeat=3)
)
#: ... and each of them claiming it, under another: with :data:`FLAG_SETS`,
#: every set planning can tell apart (the claim counts only where a
#: quantized all-gather is set up, ``ShardGather``).
SHARD_FLAG_SETS: tuple[QuantizerCapabilities, ...] = tuple(
    QuantizerCapabilities(name="fake_s", columnwise_derivable=f.columnwise_derivable, derived_caches=f.derived_caches,
                          requantization_safe=f.requantization_safe, shard_quantization_exact=True)
    for f in FLAG_SETS
)
#: The TE profiles (whose names the notes print), then :data:`FLAG_SETS`
#: and :data:`SHARD_FLAG_SETS`.
CAPABILITIES: tuple[QuantizerCapabilities, ...] = (*sorted(PROFILES.values(), key=lambda c: c.name), *FLAG_SETS,
                                                   *SHARD_FLAG_SETS)


def every_context(capabilities: Iterable[QuantizerCapabilities] = CAPABILITIES) -> Iterator[WorkspaceContext]:
    """Every valid context with each of ``capabilities``, in a fixed order."""
    for caps in capabilities:
        yield from all_contexts(caps)


@functools.cache
def covering_plans() -> tuple[tuple[object, WorkspaceContext, WorkspacePlan], ...]:
    """``(policy, context, plan)`` for every context of :func:`every_context`
    and every shipped policy that plans it, the selected one included
    (``invariants.covering``). Made once per test session (about 3 s)."""
    return tuple((policy, ctx, policy.plan(ctx)) for ctx in every_context() for policy in covering(ctx))


@functools.cache
def selected_plans() -> tuple[tuple[WorkspaceContext, WorkspacePlan], ...]:
    """``(context, plan)`` of the policy ``select_policy`` picks, for every context of :func:`every_context`."""
    return tuple((ctx, select_policy(ctx).plan(ctx)) for ctx in every_context())


def holds_for_each(check: Callable[..., None], cases: Iterable[tuple]) -> int:
    """Run ``check(*case)`` on every case; a failed assertion fails with the
    case it failed on (the first), since a loop's assertion alone does not
    say which of thousands of contexts broke it. Returns how many cases ran."""
    ran = 0
    for case in cases:
        try:
            check(*case)
        except AssertionError as err:
            raise AssertionError(f"{err}\n  failed for: {_describe(case)}") from err
        ran += 1
    return ran


def _describe(case: tuple) -> str:
    return ", ".join(item.summary() if isinstance(item, WorkspacePlan) else repr(item) for item in case)
