"""``check_quantizer``: one call that checks a quantizer against the workspace manager.

It runs, in order:

1. ``protocol``: ``factory()`` returns a :class:`QuantizerUnderTest`;
2. ``usages``: ``quantize`` builds exactly the usages asked for, and
   ``update_usage(...=False)`` frees a usage's bytes;
3. ``columnwise_derivable``, ``derived_caches``, ``requantization_safe``:
   each claim, verified on the quantizer's real data and bytes;
4. ``policy checks (independent of your quantizer)``: every invariant of
   :mod:`workspace_manager.testing.invariants` on every plan of every
   context with these capabilities (exhaustive, not sampled), reported as
   one result and not counted among the checks of the quantizer: they read
   only the capability flags, which the core's own tests cover;
5. ``lifecycle: <setting>``: seeded random walks of forward, backward,
   reshard and weight-write events (an optimizer step, a silent optimizer
   write that moves no version counter, an in-place write) per module
   setting, with live bytes read from the quantizer's ``bytes_held``,
   checking after every event that nothing a plan said to free is alive and
   that no read takes a copy made from older data than the weight's.

Everything is deterministic for a given ``seed``; nothing needs Hypothesis.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._context import QuantizerCapabilities, WorkspaceContext
from .._errors import InvalidCapabilitiesError, KitArgumentError, UnknownQuantizerError
from .._explain_layout import setting_words
from .._plan import WorkspacePlan
from .._policy import WorkspacePolicy
from .._quantizer_registry import QuantizerRegistry, default_registry, qualified_name
from ._claims import claim_checks, protocol_check, sample_weights
from ._protocol import QuantizerUnderTest
from ._report import CheckResult, CheckStatus, QuantizerReport, describe_exception
from ._walks import lifecycle_checks, lifecycle_names
from .reference import Float8PerTensorQuantizer
from .invariants import CONTEXT_INVARIANTS, PLAN_INVARIANTS, all_contexts, covering

__all__ = ["check_quantizer", "policy_checks", "policy_summary", "POLICY_CHECKS", "DEFAULT_SHAPES"]

#: The name of the one result that sums up the policy invariants.
POLICY_CHECKS = "policy checks (independent of your quantizer)"

#: Weight shapes divisible by 16, 32 and 128, so block formats (MXFP8's 1x32,
#: NVFP4's 16x16, FP8's 128x128 blocks) can quantize them.
DEFAULT_SHAPES: tuple[tuple[int, int], ...] = ((128, 256), (256, 128))


def _registered(registry: QuantizerRegistry, quantizer: Any) -> QuantizerCapabilities:
    """The registered capabilities of ``quantizer``; an unregistered one
    raises UnknownQuantizerError that also says how to pass them to the kit."""
    try:
        return registry.lookup(quantizer)
    except UnknownQuantizerError as err:
        cls = type(quantizer).__name__
        hint = (" (the reference quantizer's are workspace_manager.testing.reference.REFERENCE_CAPABILITIES)"
                if isinstance(quantizer, Float8PerTensorQuantizer) else "")
        raise UnknownQuantizerError(
            f"{err} Or pass them to the kit: check_quantizer({cls}, capabilities=...){hint}."
        ) from None


def check_quantizer(
    factory: Callable[[], QuantizerUnderTest],
    capabilities: QuantizerCapabilities | None = None,
    *,
    examples: int = 4,
    steps: int = 40,
    seed: int = 0,
    shapes: Sequence[tuple[int, int]] = DEFAULT_SHAPES,
    dtype: torch.dtype = torch.float32,
    registry: QuantizerRegistry | None = None,
) -> QuantizerReport:
    """Check the quantizers ``factory()`` makes against ``capabilities``.

    ``factory`` is called for a fresh quantizer whenever a check needs one
    (a class with a no-argument constructor will do). ``capabilities``
    defaults to what ``registry`` (default: the default registry) holds for
    the quantizer, so a registered quantizer is checked as registered.
    ``examples`` is the number of weights per capability check and of random
    walks per lifecycle setting; ``steps`` the events per walk. Returns a
    :class:`QuantizerReport`; call ``report.raise_for_failures()`` in a test.
    """
    _check_arguments(factory, capabilities, examples, steps, seed)
    _check_weights(shapes, dtype)
    protocol, quantizer = protocol_check(factory)
    if capabilities is None and quantizer is None:
        raise KitArgumentError(f"cannot look up capabilities: {protocol.reason}; pass capabilities=... explicitly")
    caps = capabilities if capabilities is not None else _registered(registry or default_registry, quantizer)
    name = qualified_name(type(quantizer)) if quantizer is not None else repr(factory)
    results = [protocol]
    if protocol.failed:  # every check by its name, so that a report counts the same checks every time
        results += [CheckResult(n, CheckStatus.SKIPPED, "not run: the protocol check failed")
                    for n in (*_CLAIM_CHECKS, *lifecycle_names())]
    else:
        weights = sample_weights(shapes, examples, seed, dtype)
        results += claim_checks(factory, caps, weights)
    if not protocol.failed:
        results += lifecycle_checks(factory, caps, walks=examples, steps=steps, seed=seed, shape=tuple(shapes[0]), dtype=dtype)
    return QuantizerReport(quantizer=name, capabilities=caps, results=tuple(results), policy=policy_summary(caps))


#: The checks of the quantizer after ``protocol`` and before the lifecycle's.
_CLAIM_CHECKS = ("usages", "columnwise_derivable", "derived_caches", "requantization_safe")


def _check_arguments(factory: Any, capabilities: Any, examples: Any, steps: Any, seed: Any) -> None:
    if not callable(factory):
        raise KitArgumentError(
            "check_quantizer's factory must be a callable returning a fresh quantizer (e.g. the quantizer "
            f"class, or lambda: MyQuantizer(...)); received {factory!r} ({type(factory).__name__})"
        )
    if capabilities is not None and not isinstance(capabilities, QuantizerCapabilities):
        raise InvalidCapabilitiesError(
            "check_quantizer's capabilities must be a QuantizerCapabilities, or None to look them up in the "
            f"registry; received {capabilities!r} ({type(capabilities).__name__})"
        )
    for label, value in (("examples", examples), ("steps", steps)):
        if type(value) is not int or value < 1:
            raise KitArgumentError(f"check_quantizer's {label} must be a positive int; received {value!r}")
    # exactly int: a bool or a float seed would be a typo that torch's generator turns into another seed or rejects
    if type(seed) is not int or seed < 0:
        raise KitArgumentError(f"check_quantizer's seed must be a non-negative int; received {seed!r} "
                               f"({type(seed).__name__})")


def _check_weights(shapes: Any, dtype: Any) -> None:
    """The sample weights' shapes and dtype, refused before any is made."""
    def is_pair(shape: Any) -> bool:
        return (isinstance(shape, (tuple, list)) and len(shape) == 2
                and all(type(d) is int and d > 0 for d in shape))

    if isinstance(shapes, (str, bytes)) or not isinstance(shapes, Sequence) or not shapes \
            or not all(is_pair(s) for s in shapes):
        one = f"; for one shape write shapes=({tuple(shapes)!r},)" if is_pair(shapes) else ""
        raise KitArgumentError("check_quantizer's shapes must be a non-empty sequence of (rows, columns) pairs of "
                               f"positive ints, e.g. {DEFAULT_SHAPES!r}; received {shapes!r}{one}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise KitArgumentError("check_quantizer's dtype must be a floating-point torch.dtype (the weights' high "
                               f"precision, e.g. torch.float32 or torch.bfloat16); received {dtype!r} "
                               f"({type(dtype).__name__})")


def policy_checks(capabilities: QuantizerCapabilities) -> list[CheckResult]:
    """Every plan invariant over every (covering policy, context) pair, and
    every context invariant over every context, for ``capabilities``.

    The policies and the invariants are pure, so the results for one set of
    capabilities and invariants are worked out once per process (about a
    second) and kept: checking a second quantizer with the same capabilities
    reruns none of it."""
    return list(_policy_checks(capabilities, tuple(PLAN_INVARIANTS), tuple(CONTEXT_INVARIANTS)))


@functools.lru_cache(maxsize=64)
def _policy_checks(capabilities: QuantizerCapabilities, plan_invariants: tuple[Callable[..., None], ...],
                   context_invariants: tuple[Callable[..., None], ...]) -> tuple[CheckResult, ...]:
    contexts = list(all_contexts(capabilities))
    triples: list[tuple[WorkspacePolicy, WorkspaceContext, WorkspacePlan]] = []
    for ctx in contexts:
        for policy in covering(ctx):
            try:
                triples.append((policy, ctx, policy.plan(ctx)))
            except Exception as err:
                reason = f"{policy!r} cannot plan a context it covers ({_setting(ctx)}): {describe_exception(err)}"
                return (CheckResult("policy: plans", CheckStatus.FAILED, reason),)
    results = [_run_invariant(inv, triples) for inv in plan_invariants]
    results += [_run_invariant(inv, [(None, ctx, None) for ctx in contexts]) for inv in context_invariants]
    return tuple(results)


def policy_summary(capabilities: QuantizerCapabilities) -> CheckResult:
    """:func:`policy_checks` as one result: they depend on the capability
    flags alone, so they say nothing about the quantizer under test."""
    results = policy_checks(capabilities)
    failed = [r for r in results if r.failed]
    if failed:
        reason = (
            f"{len(failed)} of {len(results)} broken, a bug in workspace_manager rather than in your "
            f"quantizer (please report it); first: {failed[0].name}: {failed[0].reason}"
        )
        return CheckResult(POLICY_CHECKS, CheckStatus.FAILED, reason)
    return CheckResult(
        POLICY_CHECKS, CheckStatus.PASSED,
        f"{len(results)} invariants held on every plan and context for these capability flags",
    )


def _run_invariant(invariant: Callable[..., None], cases: list[tuple[Any, WorkspaceContext, Any]]) -> CheckResult:
    name = f"policy: {invariant.__name__}"
    failures: list[str] = []
    for policy, ctx, plan in cases:
        try:
            invariant(ctx) if plan is None else invariant(policy, ctx, plan)
        except Exception as err:
            where = f"{policy!r} on " if policy is not None else ""
            shown = f" -> {plan.summary()}" if plan is not None else ""
            failures.append(f"{where}{_setting(ctx)}{shown}: {err}")
    what = "plans" if cases and cases[0][2] is not None else "contexts"
    if failures:
        summary = f"broken on {len(failures)} of {len(cases)} {what}; first:\n" + failures[0]
        return CheckResult(name, CheckStatus.FAILED, summary)
    return CheckResult(name, CheckStatus.PASSED, f"held on all {len(cases)} {what}")


def _setting(ctx: WorkspaceContext) -> str:
    return setting_words(ctx)
