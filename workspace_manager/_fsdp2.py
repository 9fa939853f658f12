"""Detect how PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``) shards a
module's weight, without TransformerEngine.

A binding asks this once per module call to fill
:attr:`WorkspaceContext.sharding`. The answer is read from FSDP2's own state
rather than from the arguments given to ``fully_shard``, because FSDP2
rewrites them: the root module's default is changed at its first forward, and
``FSDPModule.set_reshard_after_forward`` changes them at any time.

How ``reshard_after_forward`` is read
    ``fully_shard`` stores it per parameter group as
    ``FSDPParamGroup.post_forward_mesh_info`` (read in torch 2.11 and 2.13;
    ``FSDPParamGroup._reshard_after_forward`` is the same test):

    * ``None``: the gathered weight stays after forward (``False``, or the int
      ``1``) -> :attr:`Sharding.FSDP2_KEEP`;
    * the group's own mesh: freed after forward (``True``, or an int equal to
      the shard size) -> :attr:`Sharding.FSDP2_RESHARD`;
    * a smaller HSDP mesh: an int ``reshard_after_forward`` that reshards to
      that many ranks. Reported as :attr:`Sharding.FSDP2_RESHARD` on purpose:
      the full weight is freed after forward and backward all-gathers it
      again (from the smaller mesh), which is all a workspace policy needs.

    With ``reshard_after_forward=None`` (the default), the module that runs
    forward first becomes FSDP2's root, and its lazy init sets its groups'
    ``post_forward_mesh_info`` to ``None``. Before that first forward this
    module predicts it (an FSDP2 module with no FSDP2 ancestor becomes the
    root), so the answer does not change when training starts.

Which group decides
    The parameter group holding the module's own parameters decides (found
    through ``FSDPParam._module_info``), so a root with no direct parameters,
    or ``fully_shard([a, b])``, needs no special case. A module without
    parameters of its own takes the closest FSDP2-managed module (itself or an
    ancestor) whose groups shard parameters. Only ``fully_shard`` states
    count: ``replicate()`` (both the DDP-based one and the FSDP-based one,
    whose state subclasses ``FSDPState``) and fully_shard over a replicate-only
    mesh shard nothing, so they give :attr:`Sharding.NONE`.

Ancestors
    ``nn.Module`` has no parent links. With ``root`` the path from ``root`` is
    walked; without it the FSDP2-managed modules listed in
    ``torch.distributed._composable_state._module_state_mapping`` (as TE does)
    are searched. Either happens only for modules without parameters of their
    own, and for an auto-root prediction before the first forward.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from ._context import Sharding
from ._errors import ContextTypeError, InvalidContextError

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["detect_fsdp2_sharding", "ShardingProbe", "probe_fsdp2_sharding", "fsdp2_gathered_parameters",
           "FSDP2Parameter", "fsdp2_parameters"]

#: FSDP2's home module (torch >= 2.6, the package's minimum). The older path,
#: ``torch.distributed._composable.fsdp``, re-exports it and so imports it too.
_FSDP2_PACKAGE = "torch.distributed.fsdp._fully_shard"


def detect_fsdp2_sharding(
    module: torch.nn.Module, root: torch.nn.Module | None = None
) -> Sharding:
    """Return how FSDP2 shards ``module``'s weight.

    :attr:`Sharding.FSDP2_RESHARD` or :attr:`Sharding.FSDP2_KEEP` when
    ``fully_shard`` manages the module's parameters (applied to the module or
    to an ancestor), :attr:`Sharding.NONE` otherwise. ``root``, when given, is
    a module containing ``module``; it bounds the ancestor search (see the
    module docstring) and is walked only when ancestors are needed, where a
    ``module`` outside it raises :class:`InvalidContextError`.

    Raises :class:`ContextTypeError` when ``module`` or ``root`` is not an
    ``nn.Module``.
    """
    return probe_fsdp2_sharding(module, root).read()


class ShardingProbe:
    """Where FSDP2 keeps the answer for one module, read afresh on each call.

    Finding the parameter groups that own a module walks every FSDP2 state;
    reading whether they reshard after forward is one attribute per group.
    A binding asks on every call, so it keeps a probe per module and reads
    it: the answer follows ``set_reshard_after_forward`` at once, in both
    directions. :meth:`stale` says when new FSDP2 states exist in the
    process (``fully_shard`` was applied since), so that the groups must be
    found again; it never decides the answer.
    """

    __slots__ = ("_owners", "_root", "_managed", "_entries", "_count", "_single", "_records", "is_fsdp2")

    def __init__(self, owners: list[tuple[Any, Any]], root: Any, managed: dict[Any, Any],
                 mapping: Any) -> None:
        self._owners = owners
        self._root = root
        self._managed = managed
        # FSDP2's state mapping is a WeakKeyDictionary, whose len() runs
        # Python; its plain dict counts the same entries in one C call.
        self._entries = getattr(mapping, "data", mapping)
        self._count = len(self._entries) if mapping is not None else 0
        # The one owning (state, group), where FSDP2 keeps the lazy-init
        # flag the fast read needs; None otherwise (read in full).
        self._single = owners[0] if len(owners) == 1 and hasattr(owners[0][0], "_is_root") else None
        self._records: tuple[FSDP2Parameter, ...] | None = None
        #: Whether FSDP2 manages the weight at all (keep or reshard).
        self.is_fsdp2 = bool(owners)

    def parameters(self, module: Any) -> tuple[FSDP2Parameter, ...]:
        """FSDP2's records of ``module``'s own parameters (the module this
        probe was made for), found once per probe: the groups that own it
        hold them. Empty where FSDP2 does not manage the module's weight."""
        if self._records is None:
            self._records = tuple(record for _, group in self._owners for record in _records_of(group)
                                  if record.module is module)
        return self._records

    def read(self) -> Sharding:
        """The sharding now: NONE when no FSDP2 group owns the weight."""
        if not self._owners:
            return Sharding.NONE
        return _decide(self._owners, self._root, self._managed)

    def current(self) -> Sharding | None:
        """:meth:`read`, or None when :meth:`stale` (one call for both, for
        bindings that ask on every module call). After FSDP2's lazy init a
        single owning group decides with one attribute read."""
        entries = self._entries
        if entries is None:
            if _FSDP2_PACKAGE in sys.modules:
                return None
            return Sharding.NONE
        if len(entries) != self._count:
            return None
        single = self._single
        if single is not None and single[0]._is_root is not None:  # lazy init ran: no auto-root to predict
            return Sharding.FSDP2_KEEP if single[1].post_forward_mesh_info is None else Sharding.FSDP2_RESHARD
        if not self._owners:
            return Sharding.NONE
        return _decide(self._owners, self._root, self._managed)

    def stale(self) -> bool:
        """Whether FSDP2 state was added or removed since the probe was made."""
        if self._entries is None:  # FSDP2 was not imported then; one dict lookup
            return _FSDP2_PACKAGE in sys.modules
        return len(self._entries) != self._count


def probe_fsdp2_sharding(module: torch.nn.Module, root: torch.nn.Module | None = None) -> ShardingProbe:
    """A :class:`ShardingProbe` for ``module`` (arguments as
    :func:`detect_fsdp2_sharding`, which is ``probe_fsdp2_sharding(...).read()``)."""
    _require_module("module", module)
    if root is not None:
        _require_module("root", root)
    api = _fsdp2_api()
    if api is None:
        return ShardingProbe([], root, {}, None)
    managed = _fsdp2_modules(api)
    return ShardingProbe(_owning_groups(module, root, managed, api), root, managed, api.mapping)


def _owning_groups(module: Any, root: Any, managed: dict[Any, Any], api: SimpleNamespace) -> list[tuple[Any, Any]]:
    """The (state, parameter group) pairs whose resharding decides for
    ``module``: the groups holding its own parameters, else (a module
    without parameters of its own) the closest FSDP2 module's groups."""
    if not managed:
        return []
    owners = [
        (state, group)
        for state in _distinct(managed.values())
        for group in _sharded_groups(state, api)
        if _group_holds(group, module)
    ]
    if owners:
        return owners
    if any(True for _ in module.parameters(recurse=False)):
        # Its own weight is outside FSDP2 (ignored_params, replicate, or no
        # FSDP2 at all): whole on every rank, whatever its ancestors do.
        return []
    own = [managed[module]] if module in managed else []
    for state in own + _ancestor_states(module, root, managed):
        groups = _sharded_groups(state, api)
        if groups:
            return [(state, g) for g in groups]
    return []


def _require_module(name: str, value: Any) -> None:
    """User input check: a clear TypeError subclass rather than an
    AttributeError deep inside the walk."""
    import torch.nn as nn

    if not isinstance(value, nn.Module):
        raise ContextTypeError(
            f"detect_fsdp2_sharding: {name} must be a torch.nn.Module; received "
            f"{value!r} ({type(value).__name__}). Pass the module whose weight "
            f"is used (e.g. the Linear), not its weight tensor or its name."
        )


def _fsdp2_api() -> SimpleNamespace | None:
    """FSDP2's private pieces this module reads, or None when FSDP2 cannot
    have been applied in this process.

    ``fully_shard`` imports its package, so if that package is not in
    ``sys.modules`` nothing is sharded; this keeps a model without FSDP2
    from importing torch.distributed at all.
    """
    if _FSDP2_PACKAGE not in sys.modules:
        return None
    try:
        from importlib import import_module

        from torch.distributed._composable.contract import _get_registry
        from torch.distributed._composable_state import _get_module_state, _module_state_mapping

        common = import_module(f"{_FSDP2_PACKAGE}._fsdp_common")
        state = import_module(f"{_FSDP2_PACKAGE}._fsdp_state")
    except ImportError:  # a torch build without these internals
        return None
    return SimpleNamespace(
        registry=_get_registry,
        get_state=_get_module_state,
        mapping=_module_state_mapping,
        FSDPState=state.FSDPState,
        FSDPMeshInfo=common.FSDPMeshInfo,
    )


def _fsdp2_modules(api: SimpleNamespace) -> dict[Any, Any]:
    """Every module ``fully_shard`` was applied to, mapped to its FSDPState.

    The composable-state mapping also lists ``replicate()`` and other
    composable APIs; the registry's ``"fully_shard"`` entry and the state
    class together keep only FSDP2 (the FSDP-based ``replicate`` state
    subclasses FSDPState, FSDP1's composable ``fully_shard`` does not).
    """
    found = {}
    for mod in list(api.mapping.keys()):
        if "fully_shard" not in (api.registry(mod) or {}):
            continue
        state = api.get_state(mod)
        if isinstance(state, api.FSDPState):
            found[mod] = state
    return found


def _distinct(states: Any) -> list[Any]:
    """States without repeats: ``fully_shard([a, b])`` maps both to one."""
    seen: dict[int, Any] = {}
    for state in states:
        seen.setdefault(id(state), state)
    return list(seen.values())


def _sharded_groups(state: Any, api: SimpleNamespace) -> list[Any]:
    """The state's parameter groups that really shard (an FSDPMeshInfo mesh;
    a replicate-only DDPMeshInfo shards nothing).

    torch 2.13 keeps a list (``_fsdp_param_groups``, for per-parameter
    meshes); torch 2.11 and older keep one optional ``_fsdp_param_group``.
    """
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    return [g for g in groups if isinstance(g.mesh_info, api.FSDPMeshInfo)]


def _group_holds(group: Any, module: Any) -> bool:
    """Whether ``group`` manages one of ``module``'s own parameters
    (``ParamModuleInfo`` names the owning module and any tied sharers)."""
    for fsdp_param in group.fsdp_params:
        info = getattr(fsdp_param, "_module_info", None)
        if info is None:
            continue
        if info.module is module or any(m is module for m in info.shared_modules):
            return True
    return False


def _decide(owners: list[tuple[Any, Any]], root: Any, managed: dict[Any, Any]) -> Sharding:
    """RESHARD when any owning group frees its gathered parameters after
    forward (conservative: some of the weight must be gathered again for
    backward), KEEP otherwise."""
    for state, group in owners:
        if group.post_forward_mesh_info is not None and not _will_be_auto_root(state, root, managed):
            return Sharding.FSDP2_RESHARD
    return Sharding.FSDP2_KEEP


def _will_be_auto_root(state: Any, root: Any, managed: dict[Any, Any]) -> bool:
    """Whether FSDP2's lazy init will clear this state's
    ``post_forward_mesh_info``: it has not run yet, ``reshard_after_forward``
    was left to FSDP2 (older torch without the
    ``_auto_reshard_after_forward`` flag always cleared the root's), and no FSDP2 module encloses it, so it becomes the root.

    A model whose first forward starts below its outermost FSDP2 module
    gets a different root; that is FSDP2's own caveat too.
    """
    if getattr(state, "_is_root", None) is not None:
        return False  # lazy init ran: post_forward_mesh_info is final
    if not getattr(state, "_auto_reshard_after_forward", True):
        return False
    modules = getattr(state, "_modules", ())
    if len(modules) != 1:
        return False  # FSDP2 refuses a multi-module state as root
    return not _ancestor_states(modules[0], root, managed)


def _ancestor_states(module: Any, root: Any, managed: dict[Any, Any]) -> list[Any]:
    """FSDP2 states of ``module``'s strict ancestors, closest first.

    With ``root``: the path from ``root`` down to ``module``. Without it:
    the FSDP2-managed modules whose subtree contains ``module``; they nest,
    so the smaller subtree is the closer ancestor (TE's rule).
    """
    if root is not None:
        path = _path_from(root, module)
        return [managed[m] for m in reversed(path[:-1]) if m in managed]
    enclosing = []
    for candidate, state in managed.items():
        if candidate is module:
            continue
        size = 0
        inside = False
        for sub in candidate.modules():
            size += 1
            inside = inside or sub is module
        if inside:
            enclosing.append((size, state))
    enclosing.sort(key=lambda item: item[0])
    return [state for _, state in enclosing]


def _path_from(root: Any, module: Any) -> list[Any]:
    """The modules from ``root`` down to ``module`` (both included), by a
    depth-first walk that stops once found."""
    stack = [(root, [root])]
    seen: set[int] = set()
    while stack:
        current, path = stack.pop()
        if current is module:
            return path
        if id(current) in seen:
            continue
        seen.add(id(current))
        stack.extend((child, path + [child]) for child in current.children())
    raise InvalidContextError(
        f"detect_fsdp2_sharding: module {type(module).__name__} is not inside root "
        f"{type(root).__name__}; pass the model that contains it as root, or root=None "
        f"to search every FSDP2-managed module."
    )


@dataclass(frozen=True)
class FSDP2Parameter:
    """One parameter FSDP2 manages, read from FSDP2's own record of it
    (``FSDPParam``): the module that registers it and the name it has
    there, the sharded parameter an optimizer holds, and the unsharded
    parameter FSDP2 all-gathers into. The two are read from the record at
    each access, so they follow FSDP2 when it replaces one (a
    ``load_state_dict(assign=True)``, FSDP2's first all-gather)."""

    module: Any
    name: str
    #: FSDP2's ``FSDPParam``.
    record: Any

    @property
    def sharded(self) -> Any:
        """The sharded parameter (a DTensor): what ``model.parameters()``
        and so an optimizer hold between steps."""
        return self.record.sharded_param

    @property
    def unsharded(self) -> Any:
        """The unsharded parameter, or None before FSDP2's first all-gather
        made it; FSDP2 reuses the same object at every later all-gather."""
        return vars(self.record).get("_unsharded_param")


def _records_of(group: Any) -> list[FSDP2Parameter]:
    """An :class:`FSDP2Parameter` per module registering each of ``group``'s
    parameters (the owner, then the modules FSDP2 records as sharing it)."""
    found = []
    for fsdp_param in group.fsdp_params:
        info = getattr(fsdp_param, "_module_info", None)
        if info is None:
            continue
        holders = [(info.module, info.param_name),
                   *zip(getattr(info, "shared_modules", ()), getattr(info, "shared_param_names", ()))]
        found.extend(FSDP2Parameter(module, name, fsdp_param) for module, name in holders)
    return found


def fsdp2_parameters(model: torch.nn.Module | None = None) -> list[FSDP2Parameter]:
    """FSDP2's records of the parameters of the modules in ``model`` (every
    module FSDP2 manages in the process when None): one entry per module
    that registers a parameter, so a parameter a wrapper shares with its
    child is listed under both. Empty where FSDP2 was never applied.

    A binding maps an optimizer's parameters (the sharded ones) to the
    modules that compute with them (the unsharded ones) through these."""
    import torch.nn as nn

    if model is not None and not isinstance(model, nn.Module):
        raise ContextTypeError(f"fsdp2_parameters: model must be a torch.nn.Module or None; "
                               f"received {type(model).__name__}")
    api = _fsdp2_api()
    if api is None:
        return []
    inside = None if model is None else {id(m) for m in model.modules()}
    found: list[FSDP2Parameter] = []
    seen: set[int] = set()
    for state in _distinct(_fsdp2_modules(api).values()):
        for group in _sharded_groups(state, api):
            if id(group) in seen:
                continue
            seen.add(id(group))
            found.extend(r for r in _records_of(group) if inside is None or id(r.module) in inside)
    return found


def fsdp2_gathered_parameters(model: torch.nn.Module) -> list[tuple[Any, str, Any]]:
    """``(module, parameter name, tensor)`` for each unsharded parameter
    FSDP2 keeps for the modules in ``model``, whether or not its storage is
    allocated now: one entry per module that registers it, so a parameter a
    wrapper shares with its child (te.ops's ``Linear`` and its
    ``BasicLinear``; FSDP2 records the first as the owner and the child as
    sharing it) is listed under both.

    FSDP2 makes the unsharded parameter at the first all-gather and reuses
    the same object at every later one (a tensor subclass's
    ``fsdp_post_all_gather`` gets it back as ``out``), so whatever a quantized
    format derives on it (an FP8 transpose) outlives the reshard unless
    somebody clears it. Between forward and backward these tensors are the
    module's parameters; after the reshard only FSDP2 holds them.
    """
    import torch.nn as nn

    if not isinstance(model, nn.Module):
        raise ContextTypeError(f"fsdp2_gathered_parameters: model must be a torch.nn.Module; "
                               f"received {type(model).__name__}")
    found = []
    for record in fsdp2_parameters(model):
        tensor = record.unsharded  # set by FSDP2's first all-gather (init_unsharded_param); absent before
        if tensor is not None:
            found.append((record.module, record.name, tensor))
    return found
