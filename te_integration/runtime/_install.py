"""Putting the seams into TE's module files, once per process, and taking them out.

The seamed names are derived from each registered kind's adapter
(:func:`seams_of`): for a TE module kind, ``quantize_weight`` and the
autograd Function in its TE module file (``_quantize`` and ``_functions``),
and the further globals its :class:`~te_integration.runtime._kind_registry.FunctionSeam`
names; for a te.ops kind, the fuser Function every op kind shares
(``_ops_fuser``) and the further names its
:class:`~te_integration.runtime._kind_registry.OpHooks` lists.
Stock TE modules and the calls TE handles itself run TE's code through them
unchanged. Install refuses, changing nothing, while
another library's patch holds one of those names (``_foreign_patches``).
"""

from __future__ import annotations

import threading

from ..te import _compat as te
from ._call import ACTIVE
from ._foreign_patches import ForeignPatchError, SeamedName, foreign_patches, in_place, refuse_foreign_patches
from ._functions import seam_function
from ._ops_fuser import fuser_seams
from ._quantize import managed_quantize_weight
from ._kind_registry import Adapter, adapters

__all__ = ["install", "uninstall", "seams_of", "seam_function_of", "SEAM_FUNCTIONS"]

#: Each TE module kind's Function seam, by kind: made once, at the kind's
#: first :func:`seams_of` (install compares what a name holds with it).
SEAM_FUNCTIONS: dict = {}

_LOCK = threading.Lock()
_SEAMED: tuple[SeamedName, ...] = ()
#: What each seamed name held before install put the seam there (TE's own
#: definition: install refuses anything else), for uninstall to put back.
_REPLACED: dict[tuple[int, str], object] = {}


#: Whether install ran (read by the drop-ins before each call).
INSTALLED = False


def seam_function_of(adapter: Adapter) -> type:
    """The Function seam of a TE module kind (made at the first ask)."""
    made = SEAM_FUNCTIONS.get(adapter.kind)
    if made is None:
        made = SEAM_FUNCTIONS[adapter.kind] = seam_function(adapter.function)
    return made


def seams_of(adapter: Adapter) -> tuple[SeamedName, ...]:
    """The names install replaces for one kind, with TE's definition of each.
    A TE module kind: ``quantize_weight`` and the autograd Function in its
    module file, and the further globals it names. A te.ops kind: the fuser
    Function (every op kind's: install replaces it once) and its own."""
    spec = adapter.function
    if spec is None:
        return fuser_seams() + tuple(adapter.op.seams())
    file, name = spec.file, spec.name
    qw = f"{te.base_module.__name__}.quantize_weight"
    return (SeamedName(file, "quantize_weight", qw, managed_quantize_weight),
            SeamedName(file, name, f"{file.__name__}.{name}", seam_function_of(adapter), spec.function),
            *(SeamedName(file, global_name, f"{theirs.__module__}.{theirs.__qualname__}", ours)
              for global_name, theirs, ours in spec.module_globals))


def _seamed_names() -> tuple[SeamedName, ...]:
    """The names install replaces, every registered kind's, each once (the
    package's import registered every kind: ``kinds/__init__``)."""
    names, seen = [], set()
    for adapter in adapters():
        for seamed in seams_of(adapter):
            if (id(seamed.module), seamed.name) not in seen:
                seen.add((id(seamed.module), seamed.name))
                names.append(seamed)
    return tuple(names)


def install() -> None:
    """Put the seams into TE's module globals, once per process.

    Raises :class:`ForeignPatchError`, changing nothing, while another
    library's patch holds one of those names, whether it was made before
    te_integration's import or before install. Each drop-in asks again at
    its first call, so a patch made over installed seams is found there.
    """
    global INSTALLED, _SEAMED
    with _LOCK:
        if INSTALLED and in_place(_SEAMED):
            return
        names = _SEAMED or _seamed_names()
        refuse_foreign_patches(names)
        for seamed in names:
            # A class attribute (te.ops's BasicLinear._functional_forward) is
            # kept as the class holds it, so uninstall puts TE's staticmethod back.
            current = (vars(seamed.module)[seamed.name] if isinstance(seamed.module, type)
                       else getattr(seamed.module, seamed.name))
            if current is not seamed.ours:
                _REPLACED[(id(seamed.module), seamed.name)] = current
            setattr(seamed.module, seamed.name, seamed.ours)
        _SEAMED, INSTALLED = names, True


def uninstall() -> None:
    """Put TE's own definitions back where install put the seams: stock TE
    modules then run TE's code untouched. The next drop-in call installs
    the seams again (each drop-in checks before its call).

    Raises :class:`ForeignPatchError`, changing nothing, while another
    library's patch holds one of those names (it is that library's to
    undo), and RuntimeError during a drop-in's forward."""
    global INSTALLED
    with _LOCK:
        if ACTIVE.record is not None:
            raise RuntimeError("uninstall_seams() was called inside a drop-in's forward; call it between calls")
        if not _SEAMED:
            return  # never installed
        found = foreign_patches(_SEAMED)
        if found:
            raise ForeignPatchError("te_integration cannot take its seams out of TransformerEngine: " + "; ".join(found)
                                    + ". That patch is its library's to undo. Nothing was changed.")
        for seamed in _SEAMED:
            if getattr(seamed.module, seamed.name) is seamed.ours:
                setattr(seamed.module, seamed.name, _REPLACED[(id(seamed.module), seamed.name)])
        INSTALLED = False
