"""The one registry of module kinds: one :class:`Adapter` per kind.

Each kind's file in ``te_integration/kinds/`` makes its :class:`ModuleKind`,
defines its drop-in class and registers its adapter; ``kinds/__init__``
imports every file of the package, so a kind registers by existing.
Everything the binding lists per kind is derived from the registry:
``convert_model``'s table of TE classes to drop-ins (:func:`drop_ins`), the
names ``install`` seams (``_install.seams_of``), the names
``managed_construction`` rebinds, the parameters the budget counts as a
module's GEMM weights, the TE modules attribution inspects, each kind's own
plan refusals (:func:`refusal_of`), the records the te.ops fuser seam opens
(:data:`OP_HOOKS`), te_integration's public drop-in names, and the kinds
``explain``'s legend names (:func:`register_with_explain`). This module,
like all of ``runtime/``, names no kind.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from workspace_manager.extending import register_module_kind

from ._call import CallPart

__all__ = ["ModuleKind", "Adapter", "FunctionSeam", "OpHooks", "OP_HOOKS", "register", "adapters", "adapter_for",
           "refusal_of", "drop_ins", "gemm_weight_names", "register_with_explain"]


class _KindsByName(type):
    """``ModuleKind.GROUPED_LINEAR``: a kind already made, by its name in
    capitals, as the enum this class replaced named its members (tests and
    tools written against it keep working; the runtime never spells one)."""

    def __getattr__(cls, name: str) -> ModuleKind:
        made = cls._made.get(name.lower()) if name.isupper() else None
        if made is None:
            raise AttributeError(f"type object 'ModuleKind' has no attribute {name!r} (no kind of that name was "
                                 "made; each kind's file in te_integration/kinds/ makes its own)")
        return made


class ModuleKind(metaclass=_KindsByName):
    """Which kind a drop-in is. Each kind's file makes its one instance
    (``KIND = ModuleKind("linear")``); making it again by the same name
    returns that instance, so kinds compare by identity (the seams test
    ``record.kind is KIND`` on every call) and hash by identity, in C."""

    __slots__ = ("name",)
    #: name -> the kind, in the order the kinds were made.
    _made: dict[str, ModuleKind] = {}

    def __new__(cls, name: str) -> ModuleKind:
        made = cls._made.get(name)
        if made is None:
            if not isinstance(name, str) or not name:
                raise TypeError(f"ModuleKind: the name must be a non-empty str; received {name!r}")
            made = cls._made[name] = super().__new__(cls)
            made.name = name
        return made

    def __reduce__(self):
        # Copies and pickles (a ModuleWorkspaceState's) come back as the one instance.
        return (ModuleKind, (self.name,))

    def __repr__(self) -> str:
        return f"ModuleKind({self.name!r})"

    @classmethod
    def made(cls) -> tuple[ModuleKind, ...]:
        """Every kind made in this process, in the order it was made."""
        return tuple(cls._made.values())


def gemm_weight_names(module: Any) -> tuple[str, ...]:
    """TE's own list of a module's GEMM weight parameters (``weight_names``),
    or ``("weight",)`` where the class keeps none."""
    return tuple(getattr(module, "weight_names", None) or ("weight",))


#: ``begin(ctx, args)``: None for a call TE handles itself; else the call's
#: record, its weights' levers set, and TE's arguments with TE's switches set.
Begin = Callable[[Any, tuple], "tuple[Any, tuple] | None"]


@dataclass(frozen=True)
class FunctionSeam:
    """A TE module kind's autograd Function, which ``_functions.seam_function``
    replaces in its module file by a same-named subclass, and what that
    seam's one body asks of the kind on every call."""

    #: TE's autograd Function, the name its module file binds it to, the
    #: method of it the seam overrides (the one TE calls with the call's
    #: arguments), and that TE module file, whose globals also name
    #: ``quantize_weight``.
    function: type
    name: str
    method: str
    file: types.ModuleType
    begin: Begin
    #: ``edit_ctx(ctx, record, args)``: set the levers TE's backward reads on
    #: ``ctx`` and the call's :class:`~te_integration.runtime._release.BackwardWork`.
    #: Where running TE's method is more than calling it for a call (one of
    #: LayerNormMLP's), ``begin`` sets ``record.run``.
    edit_ctx: Callable[[Any, Any, tuple], None]
    #: Further globals of ``file`` install replaces: ``(name, TE's object, ours)``.
    module_globals: tuple[tuple[str, Any, Any], ...] = ()
    #: Static methods of TE's Function the seam class overrides: ``(name, ours)``
    #: (TE's code calls them through the Function's name, so they find the seam's).
    overrides: tuple[tuple[str, Callable], ...] = ()


def _no_seams() -> tuple:
    return ()


@dataclass(frozen=True)
class OpHooks:
    """A te.ops kind: what the fuser Function seam (``_ops_fuser``), shared by
    every op kind, asks of each of the kind's ops in a fuser call."""

    #: ``edit_ctx(op_ctx, record)``, after TE's fuser forward, for an op whose
    #: call planned its weights: set on the op's context what its backward
    #: reads (rebuild quantizers); returns the ``(weight, levers)`` pairs
    #: the plans release after backward.
    edit_ctx: Callable[[Any, Any], list]
    #: Further names install replaces for the kind, with TE's definition of
    #: each (``BasicLinear``'s functional methods), beyond the fuser Function.
    seams: Callable[[], tuple] = _no_seams


@dataclass(frozen=True)
class Adapter:
    """Everything the kind-independent runtime needs of one kind: exactly one
    of ``function`` (a TE module kind) and ``op`` (a te.ops kind) is set."""

    kind: ModuleKind
    #: TE's class (what ``convert_model`` converts; subclasses too) and ours.
    te_class: type
    drop_in: type
    #: The keys of the kind's weights, as plans and caches name them (per
    #: call; te.ops's grouped op plans each group's under TE's own name).
    weight_keys: tuple[str, ...] = ("weight",)
    #: ``(TE module, name)`` that ``managed_construction`` rebinds to ``drop_in``.
    construction: tuple[tuple[Any, str], ...] = ()
    #: ``refusal(context, plan)``: why TE cannot carry out ``plan`` for this
    #: kind beyond the rules every kind shares (``_plan_support``), or None.
    #: Asked when a call shape is planned, so a refused plan never runs.
    refusal: Callable[[Any, Any], str | None] | None = None
    #: The kind as TE's users name its module, in ``explain``'s legend
    #: (default: the drop-in's class name), and what one call plans where
    #: that is more than one weight's plan ("" where it is not).
    explain_name: str = ""
    explain_note: str = ""
    #: Where the kind is listed among the kinds (explain's legend,
    #: te_integration's names): lower first, then by registration.
    order: int = 100
    #: The kind's own data on a call's record (:attr:`CallRecord.part`), a
    #: :class:`~te_integration.runtime._call.CallPart` subclass, or None.
    part: type | None = None
    function: FunctionSeam | None = None
    op: OpHooks | None = None

    def __post_init__(self) -> None:
        if (self.function is None) == (self.op is None):
            raise TypeError(f"Adapter for {self.kind!r}: set exactly one of function (a TE module kind) and op "
                            "(a te.ops kind)")
        if getattr(self.drop_in, "_wm_kind", None) is not self.kind or not issubclass(self.drop_in, self.te_class):
            raise TypeError(f"Adapter for {self.kind!r}: the drop-in {self.drop_in.__name__} must subclass "
                            f"{self.te_class.__name__} and set _wm_kind to the adapter's kind")
        if self.part is not None and not issubclass(self.part, CallPart):
            raise TypeError(f"Adapter for {self.kind!r}: part must subclass CallPart; received {self.part!r}")

    @property
    def name(self) -> str:
        """The kind as explain's legend and messages name it."""
        return self.explain_name or self.drop_in.__name__

    def gemm_weights(self, module: Any) -> tuple[str, ...]:
        """The parameters TE quantizes as the module's GEMM weights (the
        budget's count): TE's ``weight_names``, or the weight keys where
        the kind has several (LayerNormMLP keeps no ``weight_names``)."""
        return self.weight_keys if len(self.weight_keys) > 1 else gemm_weight_names(module)


_ADAPTERS: dict[ModuleKind, Adapter] = {}
#: kind -> its :class:`OpHooks`, for every te.ops kind: the fuser seam's
#: test of whether an op (or a record) is one of the kinds it opens. Changed
#: in place only, so a module that imported it sees every registration.
OP_HOOKS: dict[ModuleKind, OpHooks] = {}


def register(adapter: Adapter) -> None:
    """Add a kind. A second, different adapter for a kind is refused."""
    if not isinstance(adapter, Adapter):
        raise TypeError(f"register: expected an Adapter, received {type(adapter).__name__}")
    taken = _ADAPTERS.get(adapter.kind)
    if taken is not None and taken != adapter:
        raise ValueError(
            f"register: {adapter.kind!r} is already registered, with drop-in {taken.drop_in.__name__}; each kind "
            f"has one adapter. Register {adapter.drop_in.__name__} under a ModuleKind of its own.")
    _ADAPTERS[adapter.kind] = adapter
    if adapter.op is not None:
        OP_HOOKS[adapter.kind] = adapter.op


def adapters() -> tuple[Adapter, ...]:
    """Every registered kind, by :attr:`Adapter.order`, then registration."""
    return tuple(sorted(_ADAPTERS.values(), key=lambda adapter: adapter.order))


def adapter_for(kind: ModuleKind) -> Adapter:
    """The adapter of ``kind``; a kind nobody registered is a LookupError saying so."""
    try:
        return _ADAPTERS[kind]
    except KeyError:
        raise LookupError(
            f"no module kind {kind!r} is registered (registered: "
            f"{', '.join(k.name for k in _ADAPTERS) or 'none'}); a kind registers its Adapter in its file "
            "in te_integration/kinds/") from None


def refusal_of(kind: ModuleKind) -> tuple[str, Callable[[Any, Any], str | None]] | None:
    """``(the kind's name, its refusal)``, or None: the kind has no refusal
    of its own, or no adapter (a partly loaded binding in a test has none)."""
    adapter = _ADAPTERS.get(kind)
    if adapter is None or adapter.refusal is None:
        return None
    return adapter.name, adapter.refusal


def drop_ins() -> dict[type, type]:
    """TE's class -> its drop-in, for every registered kind."""
    return {adapter.te_class: adapter.drop_in for adapter in adapters()}


def register_with_explain() -> None:
    """Name every kind in ``explain``'s legend (the core names no TE module),
    in :func:`adapters`' order; refused while a kind made in this process
    has no adapter, since the legend would then leave a managed kind out."""
    missing = [kind.name for kind in ModuleKind.made() if kind not in _ADAPTERS]
    if missing:
        raise RuntimeError(f"te_integration: module kinds without a registered adapter: {', '.join(missing)}; "
                           "each kind registers its Adapter in its file in te_integration/kinds/")
    for adapter in adapters():
        register_module_kind(adapter.name, adapter.explain_note)
