"""The autograd Function seams: one body for every module kind.

Each module kind's TE Function (``_Linear``, ``_LayerNormLinear``,
``_LayerNormMLP``) is replaced in its module file by a subclass of the same
name (so ``grad_fn`` names do not change) whose forward is
:func:`seam_function`'s one body, and whose backward runs the plan's
release after TE's. What differs between kinds (where the weights,
quantizers and flags sit in TE's arguments, which ctx fields TE's backward
reads) is the kind's :class:`ModuleAdapter`.

The body runs on every call of every TE module once installed, so it calls
nothing it can spell inline: the adapter's ``begin`` (gate and plan) and
``edit_ctx``, TE's own method, and nothing more on the common path; each
Python call avoided is about a microsecond of host time per module call.

Calls TE handles on its own pass through unchanged (the adapters' ``begin``
tests it): no FP8 (no workspace), debug quantizers, FSDP1 (``fsdp_group``),
CUDA-graph capture (``skip_fp8_weight_update`` or TE's capture flag), CPU
offload; listed in docs/te-integration.md.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import _attribution
from ._call import ACTIVE, CallRecord
from ._quantize import commit_cache
from ._release import run_backward
from ._saved_tensors import save_columnwise_only
from ._state import ModuleKind

__all__ = ["ModuleAdapter", "seam_function"]

_LEDGER = _attribution.LEDGER

#: ``begin(ctx, args)``: None for a call TE handles itself; else the call's
#: record, its weights' levers set, and TE's arguments with TE's switches set.
Begin = Callable[[Any, tuple], "tuple[CallRecord, tuple] | None"]


@dataclass(frozen=True)
class ModuleAdapter:
    """Everything the binding knows of one TE module kind.

    Adding a module kind is adding one of these and its ``_compat`` entries
    (docs/te-integration.md, "Adding a module kind")."""

    kind: ModuleKind
    #: TE's public module class (what ``convert_model`` converts) and its drop-in's name.
    te_class: type
    #: TE's autograd Function, the name its module file binds it to, the
    #: method of it the seam overrides (the one TE calls with the call's
    #: arguments), and that TE module file, whose globals also name
    #: ``quantize_weight``.
    function: type
    function_name: str
    method: str
    file: types.ModuleType
    #: The keys of the module's weights, as plans and caches name them.
    weight_keys: tuple[str, ...]
    begin: Begin
    #: ``edit_ctx(ctx, record, args)``: set the levers TE's backward reads on
    #: ``ctx`` and the call's :class:`~te_integration._release.BackwardWork`.
    #: Where running TE's method is more than calling it for a call (one of
    #: LayerNormMLP's), ``begin`` sets ``record.run``.
    edit_ctx: Callable[[Any, CallRecord, tuple], None]
    #: ``(TE module, name)`` that ``managed_construction`` rebinds to the drop-in.
    construction: tuple[tuple[types.ModuleType, str], ...] = ()
    #: Further globals of ``file`` install replaces: ``(name, TE's object, ours)``.
    module_globals: tuple[tuple[str, Any, Any], ...] = ()
    #: Static methods of TE's Function the seam class overrides: ``(name, ours)``
    #: (TE's code calls them through the Function's name, so they find the seam's).
    overrides: tuple[tuple[str, Callable], ...] = ()


def seam_function(adapter: ModuleAdapter) -> type:
    """The seam subclass of ``adapter.function``, named as TE's."""
    # TE's methods are looked up at each call, as a call of TE's own Function
    # finds them (a patch of TE's class made after install is honoured): a
    # subscript of the live dict of the class that defines each, no Python call.
    method = adapter.method
    methods, backwards = _defining_dict(adapter.function, method), _defining_dict(adapter.function, "backward")
    begin, edit_ctx = adapter.begin, adapter.edit_ctx

    def managed(ctx, *args):
        te_method = methods[method]
        started = begin(ctx, args)
        if started is None:  # a call TE handles itself, or a stock module's
            out = te_method(ctx, *args)
            if ctx is not None:
                ctx._te_wm_backward = None
                if _LEDGER.enabled:
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
            if _LEDGER.enabled:
                _attribution.tag(ctx, record.module)
        return out

    def backward(ctx, *grads):
        if ctx._te_wm_backward is None and not _LEDGER.enabled:
            return backwards["backward"](ctx, *grads)
        return run_backward(ctx, backwards["backward"], grads)

    def body(namespace: dict) -> None:
        namespace.update({name: staticmethod(ours) for name, ours in adapter.overrides})
        namespace.update({adapter.method: staticmethod(managed), "backward": staticmethod(backward),
                          "__doc__": f"TE's ``{adapter.function_name}``, with each weight's plan applied.",
                          "__module__": __name__})

    # types.new_class, so that torch's Function metaclass names the backward
    # node after TE's class, as stock TE's grad_fn is named.
    return types.new_class(adapter.function_name, (adapter.function,), {}, body)


def _defining_dict(cls: type, name: str) -> Any:
    """The live ``__dict__`` of the class in ``cls``'s MRO that defines ``name``."""
    for owner in cls.__mro__:
        if name in owner.__dict__:
            return owner.__dict__
    raise ImportError(f"te_integration: TE's {cls.__qualname__} has no {name}")
