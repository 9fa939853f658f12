"""Other libraries' patches of the names the seams replace in TE's modules.

``_install.install`` puts its own ``quantize_weight``, ``_Linear``,
``_LayerNormLinear`` and ``_LayerNormMLP`` into TE's module files. If
another library has patched one of those names (before or after
``te_integration`` was imported), installing over it would drop that patch,
and a patch made over the seams would bypass the plans; both silently.
So install first asks who holds each name, and refuses with
:class:`ForeignPatchError`, changing nothing, while anyone but TE or this
package does. See "Fault modes" in docs/te-integration.md.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from types import ModuleType

__all__ = ["ForeignPatchError"]


class ForeignPatchError(RuntimeError):
    """A name te_integration replaces in TE's modules holds another library's patch."""


class Holder(enum.Enum):
    """Who holds a seamed name now."""

    TE = "TE's own definition"
    OURS = "te_integration's seam"
    FOREIGN = "another patch"


@dataclass(frozen=True)
class SeamedName:
    """``module.name``, which TE defines as ``te_home`` (module.qualname) and
    install replaces with ``ours``. ``base``: TE's object ``ours`` extends,
    as recorded when te_integration was imported (None: nothing recorded)."""

    module: ModuleType
    name: str
    te_home: str
    ours: object
    base: object = None

    @property
    def where(self) -> str:
        return f"{self.module.__name__}.{self.name}"


def _defined_at(obj: object) -> str | None:
    """``module.qualname`` of a function or class; None for wrappers
    (``functools.wraps`` copies the name but leaves ``__wrapped__``)."""
    if hasattr(obj, "__wrapped__"):
        return None
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    return f"{module}.{qualname}" if module and qualname else None


def holder(value: object, seamed: SeamedName) -> Holder:
    """Who ``value``, found at ``seamed``'s place, comes from."""
    if value is seamed.ours:
        return Holder.OURS
    return Holder.TE if _defined_at(value) == seamed.te_home else Holder.FOREIGN


def _describe(obj: object) -> str:
    return _defined_at(obj) or repr(obj)


def foreign_patches(names: tuple[SeamedName, ...]) -> list[str]:
    """One line per name held (or, at import, recorded) by another patch."""
    found = []
    for seamed in names:
        value = getattr(seamed.module, seamed.name, None)
        if holder(value, seamed) is Holder.FOREIGN:
            found.append(f"{seamed.where} is {_describe(value)}, neither TE's {seamed.te_home} "
                         "nor te_integration's seam")
        if seamed.base is not None and _defined_at(seamed.base) != seamed.te_home:
            found.append(f"{seamed.where} was {_describe(seamed.base)} when te_integration was imported, "
                         "so its seam extends that patch instead of TE's class")
    return found


def in_place(names: tuple[SeamedName, ...]) -> bool:
    """Every seam is where install put it (the per-call fast check)."""
    return all(getattr(s.module, s.name, None) is s.ours for s in names)


def refuse_foreign_patches(names: tuple[SeamedName, ...]) -> None:
    """Raise :class:`ForeignPatchError` listing every foreign patch, if any."""
    found = foreign_patches(names)
    if found:
        raise ForeignPatchError(
            "te_integration cannot install its seams into TransformerEngine: " + "; ".join(found)
            + ". Its drop-in modules apply their plans through these names, and it does not overwrite "
            "another library's patch. Nothing was changed. Remove the other patch, or use stock TE "
            "modules (no drop-ins) in this process."
        )
