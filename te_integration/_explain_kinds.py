"""The binding's module kinds, named in ``explain``'s legend.

A plan depends on the call, not on the module kind, so ``explain``'s table
holds for every kind the binding manages; its legend says which kinds those
are. The core names no TE module: this registers each
:class:`~te_integration._state.ModuleKind` with
``workspace_manager.register_module_kind`` when the binding is imported,
and refuses to import if a kind has no entry here.
"""

from __future__ import annotations

from workspace_manager import register_module_kind

from ._state import ModuleKind

__all__ = ["EXPLAINED_KINDS", "register_module_kinds"]

#: Each kind as TE's users name its module, and what one call plans where
#: that is more than one weight's plan ("" where it is not).
EXPLAINED_KINDS: dict[ModuleKind, tuple[str, str]] = {
    ModuleKind.LINEAR: ("Linear", ""),
    ModuleKind.LAYERNORM_LINEAR: ("LayerNormLinear", ""),
    ModuleKind.LAYERNORM_MLP: ("LayerNormMLP", ""),
    ModuleKind.GROUPED_LINEAR: ("GroupedLinear", "one plan for all experts"),
    ModuleKind.OPS_BASIC_LINEAR: ("te.ops.BasicLinear", ""),  # te.ops.Linear's too (a note would not fit one screen)
    ModuleKind.OPS_GROUPED_LINEAR: ("te.ops.GroupedLinear", "one plan for all experts"),
}


def register_module_kinds() -> None:
    """Register every module kind of the binding with ``explain``, in ModuleKind's order."""
    missing = [kind.name for kind in ModuleKind if kind not in EXPLAINED_KINDS]
    if missing:  # pragma: no cover - a new module kind needs its legend entry
        raise RuntimeError(f"te_integration: module kinds without an explain entry: {', '.join(missing)}")
    for kind in ModuleKind:
        register_module_kind(*EXPLAINED_KINDS[kind])


register_module_kinds()
