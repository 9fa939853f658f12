"""What a call's backward must do once TE's backward is done: :class:`BackwardWork`.

The forward seam leaves it on TE's autograd ctx as ``_te_wm_backward``
(None, the common case, costs backward nothing): backward never reads the
thread's call stack, since autograd may run it on another thread, after
the call's record is gone. :func:`run_backward` runs TE's backward, then
the plan's release, also when TE's backward raises: a failed step must not
leave cached or derived data behind.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import _attribution
from ..te import _compat as te
from ._levers import Levers
from ._step_hook import release_after_step

__all__ = ["BackwardWork", "backward_work", "run_backward"]

_LEDGER = _attribution.LEDGER


@dataclass(frozen=True, slots=True)
class BackwardWork:
    """A call's work for after its backward."""

    #: The drop-in module (LayerNormMLP's own recompute, in backward, plans it again).
    module: Any
    #: ``(weight, levers)`` of each weight whose plan releases something after backward.
    releases: tuple[tuple[Any, Levers], ...] = ()
    #: The cache entries a released cache means, where they are not the
    #: levers' own key: one per expert of a ``GroupedLinear``.
    cache_keys: tuple[str, ...] = ()
    #: ``rebuild(ctx, saved)``: quantize again, in the list TE's backward
    #: restored, the weights saved in high precision in place of their
    #: workspaces (``GroupedLinear``, whose backward has no rebuild of its own).
    rebuild: Callable[[Any, list], None] | None = None


def backward_work(module: Any, weights: tuple) -> BackwardWork | None:
    """The work for the call's flat ``(tensor, levers, ...)`` weights; None
    when no plan releases anything."""
    items = tuple((weights[i], weights[i + 1]) for i in range(0, len(weights), 2) if weights[i + 1].releases)
    return BackwardWork(module, items) if items else None


def _release(work: BackwardWork) -> None:
    keys = work.cache_keys
    for tensor, levers in work.releases:
        if levers.release_columnwise and isinstance(tensor, te.QuantizedTensorStorage):
            te.clear_columnwise_cache(tensor)
        if levers.release_cache and not keys:
            release_after_step(work.module, levers.key)
    for key in keys:
        release_after_step(work.module, key)


def run_backward(ctx, te_backward, grads: tuple):
    """TE's backward, then the plan's release, also when TE's backward raises."""
    marking = _LEDGER.enabled and _attribution.marks_backward(ctx)
    if marking:
        _attribution.backward_mark(ctx, "start")
    try:
        return te_backward(ctx, *grads)
    finally:
        work = getattr(ctx, "_te_wm_backward", None)
        ctx._te_wm_backward = None
        if work is not None and (work.releases or work.cache_keys):
            _release(work)
        if marking:
            _attribution.backward_mark(ctx, "end")
