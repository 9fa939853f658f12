"""A call's backward in two named phases: :class:`BackwardWork`.

FSDP2's ``FSDPParamGroup`` names its phases (``pre_backward``,
``post_backward``); the binding's are the two methods of the
:class:`BackwardWork` the forward seam leaves on TE's autograd ctx as
``_te_wm_backward``:

* ``before_te_backward(ctx, saved)``, where a kind's backward starts,
  before TE's backward reads the saved weights: the kind's part, a
  :class:`~te_integration.runtime._rebuild.Rebuild` of the weights saved in high
  precision (D9), or te.ops GroupedLinear's derive of its quantized
  parameters' columnwise data (D12). Run by the seam at the start of each
  kind's TE backward: GroupedLinear's ``restore_from_func_ctx`` (TE's first
  act in its backward), te.ops GroupedLinear's ``fuser_backward``. The dense
  kinds' rebuild needs no phase of ours: TE's backward runs it, with the
  :class:`~te_integration.runtime._rebuild.RebuildQuantizer` it was handed.
* :meth:`BackwardWork.after_te_backward`: the plan's release, which
  :func:`run_backward` runs after TE's backward, also when TE's backward
  raises: a failed step must not leave cached or derived data behind.

None on ctx, the common case, costs backward nothing: the seams test it
before any call. Backward never reads the thread's call stack, since
autograd may run it on another thread, after the call's record is gone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import _attribution
from ..te import _compat as te
from ._levers import Levers
from ._model import model_state

__all__ = ["BackwardWork", "backward_work", "run_backward"]

_RECORDINGS = _attribution.ACTIVE_RECORDINGS


@dataclass(frozen=True, slots=True)
class BackwardWork:
    """A call's work around TE's backward, in two phases (see the module docstring)."""

    #: The drop-in module (LayerNormMLP's own recompute, in backward, plans it again).
    module: Any
    #: ``(weight, levers)`` of each weight whose plan releases something after backward.
    releases: tuple[tuple[Any, Levers], ...] = ()
    #: The cache entries a released cache means, where they are not the
    #: levers' own key: one per expert of a ``GroupedLinear``.
    cache_keys: tuple[str, ...] = ()
    #: Phase one, ``before_te_backward(ctx, saved) -> saved``: given the
    #: tensors TE's backward of ``ctx`` restored, them as it must read them.
    #: The method of the kind's part (a ``Rebuild`` subclass's, or te.ops
    #: GroupedLinear's ``DeriveColumnwise``'s), held bound so that the phase
    #: is one call; None where the phase has nothing to do, which the seams
    #: test before calling.
    before_te_backward: Callable[[Any, Any], Any] | None = None

    def after_te_backward(self) -> None:
        """Phase two, after TE's backward returned or raised: the plan's release
        (:func:`run_backward` calls it where there is one)."""
        keys, module = self.cache_keys, self.module
        for tensor, levers in self.releases:
            if levers.release_columnwise and isinstance(tensor, te.QuantizedTensorStorage):
                te.clear_columnwise_cache(tensor)
            if levers.release_cache and not keys:
                model_state(module, module._wm_state).release_after_step(module, levers.key)
        for key in keys:
            model_state(module, module._wm_state).release_after_step(module, key)


def backward_work(module: Any, weights: tuple) -> BackwardWork | None:
    """The work for the call's flat ``(tensor, levers, ...)`` weights; None
    when no plan releases anything."""
    items = tuple((weights[i], weights[i + 1]) for i in range(0, len(weights), 2) if weights[i + 1].releases)
    return BackwardWork(module, items) if items else None


def run_backward(ctx, te_backward, grads: tuple):
    """TE's backward, then the after phase of ``ctx``'s work, also when TE's backward raises."""
    marking = bool(_RECORDINGS) and _attribution.marks_backward(ctx)
    if marking:
        _attribution.backward_mark(ctx, "start")
    try:
        return te_backward(ctx, *grads)
    finally:
        work = getattr(ctx, "_te_wm_backward", None)
        ctx._te_wm_backward = None
        if work is not None and (work.releases or work.cache_keys):  # a rebuild alone releases nothing
            work.after_te_backward()
        if marking:
            _attribution.backward_mark(ctx, "end")
