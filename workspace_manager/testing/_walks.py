"""The lifecycle on a real quantizer, as seeded random walks.

For each module setting (sharding x weight source x microbatches) the kit
walks a :class:`LifecycleSession` through random forward, backward,
reshard and weight-write events (an optimizer step, a silent optimizer
write, an in-place write), with the quantizer under test behind a
:class:`QuantizerAdapter`, checking every invariant after every event. The
walks come from :class:`random.Random` seeded with the setting and ``seed``,
so a run is reproducible; a failure reports the events that led to it.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable

import torch

from .._context import BackwardOverride, Microbatch, QuantizerCapabilities, RecomputePass, Sharding, WeightSource
from ._adapter import QuantizerAdapter, QuantizerRuntime, versioned_weights
from ._protocol import QuantizerUnderTest
from ._report import CheckResult, CheckStatus, describe_exception
from ._session import LifecycleSession

__all__ = ["LIFECYCLE_SETTINGS", "lifecycle_checks", "lifecycle_names"]

#: Every module setting the lifecycle is walked in.
LIFECYCLE_SETTINGS: tuple[tuple[Sharding, WeightSource, bool], ...] = tuple(
    itertools.product(Sharding, WeightSource, (False, True))
)
_TRACE_SHOWN = 15


def _setting_name(sharding: Sharding, weight: WeightSource, microbatches: bool) -> str:
    return f"lifecycle: {sharding.value} {weight.value} {'microbatches' if microbatches else 'no microbatches'}"


def lifecycle_names() -> list[str]:
    """The name of each lifecycle check, in :data:`LIFECYCLE_SETTINGS`' order."""
    return [_setting_name(*setting) for setting in LIFECYCLE_SETTINGS]


def _idle_events(session: LifecycleSession) -> tuple[tuple[float, str, Callable[[], None]], ...]:
    """The events allowed while no backward is pending, with the roll below
    which each is chosen."""
    return (
        (0.10, "optimizer step", session.optimizer_step),
        (0.15, "silent optimizer write", session.silent_optimizer_write),
        (0.20, "in-place write", session.inplace_write),
        (0.28, "reshard", session.reshard),
    )


def _choose(session: LifecycleSession, rng: random.Random) -> tuple[str, Callable[[], str]]:
    """A random event allowed in the session's state: its label, and the
    action that runs it and returns what the plan said."""
    idle = not session.runtime.pending
    roll = rng.random()
    if not idle and roll < 0.35:
        return "backward", lambda: f" -> {session.backward().summary()}"
    for bound, label, event in _idle_events(session) if idle else ():
        if roll < bound:
            return label, lambda: event() or ""
    grad, dgrad = rng.random() < 0.85, rng.random() < 0.8
    recompute = rng.choice((RecomputePass.NONE, RecomputePass.NONE, RecomputePass.FIRST))
    override = rng.choice((BackwardOverride.NONE,) * 4 + tuple(BackwardOverride))
    # a caller who says "later microbatch" whatever happened to the weight
    claimed = Microbatch.LATER if session.use_microbatches and rng.random() < 0.15 else None

    def forward() -> str:
        ctx, plan = session.forward(grad=grad, input_requires_grad=dgrad, recompute=recompute, override=override,
                                    microbatch=claimed)
        return f" (microbatch={ctx.microbatch.name}) -> {plan.summary()}"

    label = f"forward(grad={grad}, input_requires_grad={dgrad}, recompute={recompute.name}, backward_override={override.name})"
    return label, forward


def _run(trace: list[str], label: str, action: Callable[[], str]) -> None:
    trace.append(label)  # a failing event stays in the trace by its label
    trace[-1] = label + action()


def _walk(session: LifecycleSession, rng: random.Random, steps: int, trace: list[str]) -> None:
    session.check_invariants()
    for _ in range(steps):
        _run(trace, *_choose(session, rng))
        session.check_invariants()
    while session.runtime.pending:  # finish the step
        _run(trace, "backward", lambda: f" -> {session.backward().summary()}")
        session.check_invariants()
    _run(trace, "optimizer step", lambda: session.optimizer_step() or "")
    _run(trace, "reshard", lambda: session.reshard() or "")
    session.check_invariants()


def _failure(name: str, err: Exception, trace: list[str], walk: int) -> CheckResult:
    """The failed check: where in which walk, the cause, and the events that led there."""
    cause = str(err) if isinstance(err, AssertionError) else "the quantizer raised " + describe_exception(err)
    cause = cause or type(err).__name__
    shown = trace[-_TRACE_SHOWN:]
    lines = [f"walk {walk}, at event {len(trace)}: {cause}"]
    if len(trace) > len(shown):
        lines.append(f"  ... {len(trace) - len(shown)} earlier events")
    lines += [f"  {len(trace) - len(shown) + i + 1}. {e}" for i, e in enumerate(shown)]
    # the cause in one line: failures of one cause in several settings are one line of the report
    return CheckResult(name, CheckStatus.FAILED, "\n".join(lines), cause=" ".join(cause.split()))


def _check_setting(
    factory: Callable[[], QuantizerUnderTest],
    capabilities: QuantizerCapabilities,
    setting: tuple[Sharding, WeightSource, bool],
    *,
    walks: int,
    steps: int,
    seed: int,
    shape: tuple[int, int],
    dtype: torch.dtype,
) -> CheckResult:
    sharding, weight, microbatches = setting
    name = _setting_name(*setting)
    for walk in range(walks):
        rng = random.Random(f"{seed}:{sharding.value}:{weight.value}:{microbatches}:{walk}")
        trace: list[str] = []
        try:
            adapter = QuantizerAdapter(factory(), capabilities, versioned_weights(shape, seed=seed + walk, dtype=dtype))
            runtime = QuantizerRuntime(adapter, sharding=sharding, weight=weight)
            _walk(LifecycleSession(runtime, use_microbatches=microbatches), rng, steps, trace)
        except Exception as err:  # AssertionError from an invariant, or the quantizer's own error
            return _failure(name, err, trace, walk)
    return CheckResult(
        name, CheckStatus.PASSED,
        f"{walks} walks of {steps} events: live bytes matched what every plan kept alive; no read was stale",
    )


def lifecycle_checks(
    factory: Callable[[], QuantizerUnderTest],
    capabilities: QuantizerCapabilities,
    *,
    walks: int,
    steps: int,
    seed: int,
    shape: tuple[int, int],
    dtype: torch.dtype,
) -> list[CheckResult]:
    """One check per module setting in :data:`LIFECYCLE_SETTINGS`."""
    return [
        _check_setting(factory, capabilities, s, walks=walks, steps=steps, seed=seed, shape=shape, dtype=dtype)
        for s in LIFECYCLE_SETTINGS
    ]
