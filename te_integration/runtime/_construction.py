"""``managed_construction``: TE's composite modules build drop-ins inside the block.

``te.TransformerLayer`` and ``te.MultiheadAttention`` look up the names of
the modules they build (``Linear``, ``LayerNormLinear``, ``LayerNormMLP``)
in their own module files at construction. Inside the block those names are
the drop-ins (each kind's adapter lists where its name is bound), process
wide, so one thread at a time may hold the block. TE builds no
``GroupedLinear`` itself; its name in ``transformer_engine.pytorch`` (and
``.module``) is rebound, so ``te.GroupedLinear(...)`` inside the block is a
drop-in (a class bound before the block, e.g. by ``from ... import``, is not).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from ._kind_registry import adapters

__all__ = ["managed_construction"]


class _Construction:
    """The one active :func:`managed_construction`: its thread, nesting
    depth and TE's names to restore. Guarded by ``_CONSTRUCTION_LOCK``."""

    owner: int | None = None
    owner_name = ""
    depth = 0
    saved: list = []


_CONSTRUCTION_LOCK = threading.Lock()


def _construction_targets() -> list[tuple[Any, str, type]]:
    return [(module, name, adapter.drop_in) for adapter in adapters() for module, name in adapter.construction]


def _enter_construction() -> None:
    me = threading.current_thread()
    with _CONSTRUCTION_LOCK:
        if _Construction.owner is None:
            targets = _construction_targets()
            _Construction.saved = [(mod, name, getattr(mod, name)) for mod, name, _ in targets]
            for mod, name, cls in targets:
                setattr(mod, name, cls)
            _Construction.owner, _Construction.owner_name = me.ident, me.name
        elif _Construction.owner != me.ident:
            raise RuntimeError(
                f"managed_construction() is already active in thread {_Construction.owner_name!r}; thread "
                f"{me.name!r} cannot enter it too, because the block rebinds names of TE's modules for the whole "
                "process. Construct in one thread at a time, or build stock TE modules and call "
                "convert_model() on them (it changes nothing global)."
            )
        _Construction.depth += 1


def _exit_construction() -> None:
    with _CONSTRUCTION_LOCK:
        _Construction.depth -= 1
        if _Construction.depth:
            return
        for mod, name, original in _Construction.saved:
            setattr(mod, name, original)
        _Construction.owner, _Construction.saved = None, []


@contextlib.contextmanager
def managed_construction() -> Iterator[None]:
    """Within the block, ``te.TransformerLayer`` and ``te.MultiheadAttention``
    build their Linear, LayerNormLinear and LayerNormMLP as drop-ins, and
    ``te.GroupedLinear(...)`` builds a drop-in GroupedLinear.

    It rebinds the names those modules resolve at construction, and restores
    them when the outermost block exits, also after an exception. The
    rebinding is process-wide, so one thread at a time may hold the block:
    a second thread entering it meanwhile gets a RuntimeError naming the
    holder, and changes nothing. The same thread may nest blocks; the names
    stay rebound until its outermost block exits. Other threads that
    construct TE modules while the block is held get drop-ins too;
    :func:`convert_model` has no such side effect.
    """
    _enter_construction()
    try:
        yield
    finally:
        _exit_construction()
