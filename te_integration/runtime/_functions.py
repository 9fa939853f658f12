"""The autograd Function seams: one body for every module kind.

Each module kind's TE Function (``_Linear``, ``_LayerNormLinear``,
``_LayerNormMLP``) is replaced in its module file by a subclass of the same
name (so ``grad_fn`` names do not change) whose forward is
:func:`seam_function`'s one body, and whose backward runs the plan's
release after TE's. What differs between kinds (where the weights,
quantizers and flags sit in TE's arguments, which ctx fields TE's backward
reads) is the kind's :class:`~te_integration.runtime._kind_registry.FunctionSeam`.

The body runs on every call of every TE module once installed, so it calls
nothing it can spell inline: the kind's ``begin`` (gate and plan) and
``edit_ctx``, TE's own method, and nothing more on the common path; each
Python call avoided is about a microsecond of host time per module call.

Calls TE handles on its own pass through unchanged (the kinds' ``begin``
tests it): no FP8 (no workspace), debug quantizers, FSDP1 (``fsdp_group``),
CUDA-graph capture (``skip_fp8_weight_update`` or TE's capture flag), CPU
offload; listed in docs/te-integration.md.
"""

from __future__ import annotations

import types
from typing import Any

from . import _attribution
from ._call import ACTIVE
from ._quantize import commit_cache
from ._kind_registry import FunctionSeam
from ._release import run_backward
from ._saved_tensors import save_columnwise_only

__all__ = ["seam_function"]

_RECORDINGS = _attribution.ACTIVE_RECORDINGS


def seam_function(spec: FunctionSeam) -> type:
    """The seam subclass of ``spec.function``, named as TE's."""
    # TE's methods are looked up at each call, as a call of TE's own Function
    # finds them (a patch of TE's class made after install is honoured): a
    # subscript of the live dict of the class that defines each, no Python call.
    method = spec.method
    methods, backwards = _defining_dict(spec.function, method), _defining_dict(spec.function, "backward")
    begin, edit_ctx = spec.begin, spec.edit_ctx

    def managed(ctx, *args):
        te_method = methods[method]
        started = begin(ctx, args)
        if started is None:  # a call TE handles itself, or a stock module's
            out = te_method(ctx, *args)
            if ctx is not None:
                ctx._te_wm_backward = None
                if _RECORDINGS:
                    _attribution.tag(ctx, _attribution.current_module())
            return out
        record, args = started
        try:
            run = record.run
            out = te_method(ctx, *args) if run is None else run(record, te_method, ctx, args)
            # TE's forward returned: the cache entries it filled become the
            # module's, and what ctx saves loses the rowwise data backward
            # will not read. A failed forward keeps neither.
            if record.pending is not None:
                commit_cache(record)
            if record.rowwise_parts is not None and ctx is not None:
                save_columnwise_only(ctx, record.rowwise_parts)
        finally:
            if record.pushed_by_seam:
                ACTIVE.record = record.previous
        if ctx is not None:
            edit_ctx(ctx, record, args)
            if _RECORDINGS:
                _attribution.tag(ctx, record.module)
        return out

    def backward(ctx, *grads):
        if ctx._te_wm_backward is None and not _RECORDINGS:
            return backwards["backward"](ctx, *grads)
        return run_backward(ctx, backwards["backward"], grads)

    def body(namespace: dict) -> None:
        namespace.update({name: staticmethod(ours) for name, ours in spec.overrides})
        namespace.update({spec.method: staticmethod(managed), "backward": staticmethod(backward),
                          "__doc__": f"TE's ``{spec.name}``, with each weight's plan applied.",
                          "__module__": __name__})

    # types.new_class, so that torch's Function metaclass names the backward
    # node after TE's class, as stock TE's grad_fn is named.
    return types.new_class(spec.name, (spec.function,), {}, body)


def _defining_dict(cls: type, name: str) -> Any:
    """The live ``__dict__`` of the class in ``cls``'s MRO that defines ``name``."""
    for owner in cls.__mro__:
        if name in owner.__dict__:
            return owner.__dict__
    raise ImportError(f"te_integration: TE's {cls.__qualname__} has no {name}")
