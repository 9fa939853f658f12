"""The one registry of module kinds the binding carries plans out for.

Each kind registers one :class:`KindEntry` where its drop-in class is
defined (``_modules`` for TE's modules, ``_modules_ops`` for te.ops's
operations). Everything the binding lists per kind is derived from it:
``convert_model``'s table of TE classes to drop-ins, the names ``install``
seams, the names ``managed_construction`` rebinds, the parameters the budget
counts as a module's GEMM weights, the TE modules attribution inspects, each
kind's own plan refusals, and the kinds ``explain``'s legend names
(:func:`register_with_explain`). This module names no kind.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from workspace_manager import register_module_kind

from ._foreign_patches import SeamedName
from ._state import ModuleKind

__all__ = ["KindEntry", "register", "entries", "entry_for", "refusal_of", "drop_ins", "gemm_weight_names",
           "register_with_explain"]


def gemm_weight_names(module: Any) -> tuple[str, ...]:
    """TE's own list of a module's GEMM weight parameters (``weight_names``),
    or ``("weight",)`` where the class keeps none."""
    return tuple(getattr(module, "weight_names", None) or ("weight",))


@dataclass(frozen=True)
class KindEntry:
    """Everything the binding's kind-independent parts need of one kind."""

    kind: ModuleKind
    #: TE's class (what ``convert_model`` converts; subclasses too) and ours.
    te_class: type
    drop_in: type
    #: The names ``install`` replaces for this kind, with TE's definition of
    #: each. Kinds may share a name (te.ops's fuser Function): install
    #: replaces each name once.
    seams: Callable[[], tuple[SeamedName, ...]]
    #: ``(TE module, name)`` that ``managed_construction`` rebinds to ``drop_in``.
    construction: tuple[tuple[Any, str], ...] = ()
    #: The parameters TE quantizes as a module's GEMM weights (the budget's count).
    gemm_weights: Callable[[Any], tuple[str, ...]] = gemm_weight_names
    #: The kind as TE's users name its module, in ``explain``'s legend
    #: (default: the drop-in's class name), and what one call plans where
    #: that is more than one weight's plan ("" where it is not).
    explain_name: str = ""
    explain_note: str = ""
    #: ``refusal(context, plan)``: why TE cannot carry out ``plan`` for this
    #: kind beyond the rules every kind shares (``_plan_support``), or None.
    #: Asked when a call shape is planned, so a refused plan never runs.
    refusal: Callable[[Any, Any], str | None] | None = None


_ENTRIES: dict[ModuleKind, KindEntry] = {}


def register(entry: KindEntry) -> None:
    """Add a kind. A second, different entry for a kind is refused."""
    if not isinstance(entry, KindEntry):
        raise TypeError(f"register: expected a KindEntry, received {type(entry).__name__}")
    taken = _ENTRIES.get(entry.kind)
    if taken is not None and taken != entry:
        raise ValueError(
            f"register: {entry.kind} is already registered, with drop-in {taken.drop_in.__name__}; each kind "
            f"has one entry. Register {entry.drop_in.__name__} under a ModuleKind of its own.")
    _ENTRIES[entry.kind] = entry


def entries() -> tuple[KindEntry, ...]:
    """Every registered kind, in registration order."""
    return tuple(_ENTRIES.values())


def entry_for(kind: ModuleKind) -> KindEntry:
    """The entry of ``kind``; a kind nobody registered is a LookupError saying so."""
    try:
        return _ENTRIES[kind]
    except KeyError:
        raise LookupError(
            f"no module kind {kind!r} is registered (registered: {', '.join(k.name for k in _ENTRIES) or 'none'}); "
            "a kind registers its KindEntry where its drop-in class is defined") from None


def refusal_of(kind: ModuleKind) -> tuple[str, Callable[[Any, Any], str | None]] | None:
    """``(the kind's name, its refusal)``, or None: the kind has no refusal
    of its own, or no entry (the package refuses to import without one for
    every kind, see :func:`register_with_explain`; a partly loaded binding
    in a test has none)."""
    entry = _ENTRIES.get(kind)
    if entry is None or entry.refusal is None:
        return None
    return entry.explain_name or entry.drop_in.__name__, entry.refusal


def drop_ins() -> dict[type, type]:
    """TE's class -> its drop-in, for every registered kind."""
    return {entry.te_class: entry.drop_in for entry in _ENTRIES.values()}


def register_with_explain() -> None:
    """Name every kind in ``explain``'s legend (the core names no TE module),
    in ``ModuleKind``'s order; refused while a kind has no entry, since the
    legend would then leave a managed kind out."""
    missing = [kind.name for kind in ModuleKind if kind not in _ENTRIES]
    if missing:
        raise RuntimeError(f"te_integration: module kinds without a registry entry: {', '.join(missing)}; each "
                           "kind registers its KindEntry where its drop-in class is defined")
    for kind in ModuleKind:
        entry = _ENTRIES[kind]
        register_module_kind(entry.explain_name or entry.drop_in.__name__, entry.explain_note)
