"""Putting the seams into TE's module files, once per process, and taking them out.

The seamed names are what each registered kind lists (``_kinds``): for a TE
module kind, ``quantize_weight`` and the autograd Function in its TE module
file (``_quantize`` and ``_functions``), and the further globals its adapter
names (GroupedLinear's saving pair, ``_adapter_grouped``); for te.ops, the
fuser Function and ``BasicLinear``'s two functional methods (``_adapter_ops``).
Stock TE modules and the calls TE handles itself run TE's code through them
unchanged. Install refuses, changing nothing, while
another library's patch holds one of those names (``_foreign_patches``).
"""

from __future__ import annotations

import threading

from . import _compat as te
from ._adapters import ADAPTERS
from ._call import ACTIVE
from ._foreign_patches import ForeignPatchError, SeamedName, foreign_patches, in_place, refuse_foreign_patches
from ._functions import seam_function
from ._kinds import entries
from ._quantize import managed_quantize_weight

__all__ = ["install", "uninstall", "module_seams", "SEAM_FUNCTIONS"]

#: Each module kind's Function seam, by kind.
SEAM_FUNCTIONS = {adapter.kind: seam_function(adapter) for adapter in ADAPTERS}

_LOCK = threading.Lock()
_SEAMED: tuple[SeamedName, ...] = ()
#: What each seamed name held before install put the seam there (TE's own
#: definition: install refuses anything else), for uninstall to put back.
_REPLACED: dict[tuple[int, str], object] = {}


#: Whether install ran (read by the drop-ins before each call).
INSTALLED = False


def module_seams(adapter) -> tuple[SeamedName, ...]:
    """The names install replaces for a TE module kind: ``quantize_weight``
    and the autograd Function in its module file, and the further globals
    its adapter names."""
    file, name = adapter.file, adapter.function_name
    qw = f"{te.base_module.__name__}.quantize_weight"
    return (SeamedName(file, "quantize_weight", qw, managed_quantize_weight),
            SeamedName(file, name, f"{file.__name__}.{name}", SEAM_FUNCTIONS[adapter.kind], adapter.function),
            *(SeamedName(file, global_name, f"{theirs.__module__}.{theirs.__qualname__}", ours)
              for global_name, theirs, ours in adapter.module_globals))


def _seamed_names() -> tuple[SeamedName, ...]:
    """The names install replaces, every registered kind's, each once."""
    from . import _modules  # noqa: F401  (the kinds register with their drop-in classes there)

    names, seen = [], set()
    for entry in entries():
        for seamed in entry.seams():
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
