"""The TE modules' drop-in mixin, and model conversion.

Each TE module kind's drop-in (its file in ``kinds/``) is TE's own class
with :class:`ManagedModule` in front. The mixin holds no workspace logic and
does not wrap ``forward``: TE's own ``forward`` runs, and the mixin only
opens the call's record between TE's ``prepare_forward`` and
``end_forward`` (``_call``), where the seams plan each weight through the
policy (``_functions`` and the kind's ``begin``). The drop-ins add no
parameters, buffers, submodules or ``fp8_meta`` entries, so ``state_dict``
and ``extra_state`` are exactly TE's and checkpoints move both ways between
stock and drop-in modules. :func:`convert_model` takes its table of TE
classes to drop-ins from the registry of kinds (``_kind_registry``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch

from workspace_manager import PolicyMismatchError, WorkspacePolicy

from . import _argument_checks as checks
from . import _install
from ._call import ACTIVE, CallRecord, refuse_reentry
from ._managed_common import ManagedCommon, ManagedOp
from ._model import model_for_root
from ._kind_registry import ModuleKind, drop_ins
from ._state import ModuleWorkspaceState, state_of

__all__ = [
    "ManagedModule",
    "convert_model",
    "set_workspace_policy",
    "last_plans",
    "workspace_state",
]


class _FSDP2Flag:
    """TE's ``is_fsdp2`` flag on a drop-in, answered from FSDP2's state for
    this module: it follows ``fully_shard`` and ``set_reshard_after_forward``,
    and a composable parent that is not FSDP2 does not crash it.

    A non-data descriptor, so that during a module call the value read once
    in ``prepare_forward`` (kept in the instance dict until ``end_forward``)
    answers TE's reads without running Python; outside calls it is read afresh."""

    def __get__(self, module: Any, owner: type | None = None) -> Any:
        if module is None:
            return self
        return state_of(module).probe(module).is_fsdp2


class ManagedModule(ManagedCommon):
    """Mixin placed before a TE module class. Its one piece of state is a
    :class:`ModuleWorkspaceState` made at first use, so an existing TE
    instance can be converted by swapping its class.

    ``prepare_forward`` pushes the call's :class:`~te_integration.runtime._call.CallRecord`
    once TE's returned, and puts TE's ``is_fsdp2`` in the instance dict (see
    :class:`_FSDP2Flag`: TE reads the attribute, so it must be found there
    without running Python); ``end_forward``, which TE calls in a ``finally``,
    takes both back. Every managed call runs these two methods, so they
    avoid Python calls of their own."""

    _wm_kind: ClassVar[ModuleKind]
    #: The module's state; the class default None means "not made yet".
    _wm_state: ModuleWorkspaceState | None = None
    is_fsdp2 = _FSDP2Flag()

    def prepare_forward(self, inp: Any, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_dynamo_compiling():
            # Inside a torch.compile trace TE's compiled path runs (Linear); it stays stock.
            return super().prepare_forward(inp, *args, **kwargs)
        state = self._wm_state
        if state is None or not state.installed or not _install.INSTALLED:
            state = self._first_managed_call()
        probe = state.sharding_probe
        sharding = probe.current() if probe is not None else None
        if sharding is None:  # first call, or FSDP2 states were added or removed since
            probe = state.probe(self)
            sharding = probe.read()
        below = ACTIVE.record
        if below is not None:
            refuse_reentry(self)
        inp = super().prepare_forward(inp, *args, **kwargs)
        # Pushed only once TE's prepare_forward returned: end_forward follows for sure.
        record = CallRecord()
        record.module, record.state, record.kind, record.sharding, record.previous = self, state, state.kind, \
            sharding, below
        record.weights, record.pending, record.rowwise_parts, record.run, record.part = (), None, None, None, None
        record.pushed_by_seam = False
        self.__dict__["is_fsdp2"] = probe.is_fsdp2
        ACTIVE.record = record
        return inp

    def _first_managed_call(self) -> ModuleWorkspaceState:
        """At each drop-in's first call (and after ``uninstall_seams``): find
        foreign patches made since, and install the seams; before TE's
        prepare_forward, whose NVTX range and recompute metadata only
        end_forward undoes, so a refusal leaves them alone."""
        _install.install()
        state = state_of(self)
        state.installed = True
        return state

    def end_forward(self) -> None:
        record = ACTIVE.record
        if record is not None and record.module is self:  # pushed by prepare_forward
            ACTIVE.record = record.previous
            del self.__dict__["is_fsdp2"]
        super().end_forward()


_CONVERTED: dict[type, type] = {}
#: The mixins of every drop-in: the modules' and te.ops's.
_MANAGED = (ManagedModule, ManagedOp)


def _managed_class_for(cls: type) -> type | None:
    """The drop-in for ``cls``: ours for TE's classes, a cached
    ``Managed<cls>`` for third-party subclasses of them, None otherwise."""
    if issubclass(cls, _MANAGED):
        return None
    table = drop_ins()  # every registered kind's
    if cls in table:
        return table[cls]
    for te_cls, ours in table.items():
        if issubclass(cls, te_cls):
            if cls not in _CONVERTED:
                mixin = ManagedOp if issubclass(ours, ManagedOp) else ManagedModule
                _CONVERTED[cls] = type(f"Managed{cls.__name__}", (mixin, cls),
                                       {"_wm_kind": ours._wm_kind, "__module__": __name__})
            return _CONVERTED[cls]
    return None


def convert_model(
    model: torch.nn.Module,
    *,
    module_filter: Callable[[torch.nn.Module, str], bool] | None = None,
    policy: WorkspacePolicy | None = None,
) -> torch.nn.Module:
    """Turn the TE modules and te.ops ops of ``model`` whose class (or a base
    of it) a kind registered into drop-ins, in place, and return ``model``.

    ``module_filter(module, fqn)`` chooses which ones (default: all);
    ``policy`` pins a policy on each chosen module (default: selected per
    call). Parameters are not copied. Converting is idempotent: drop-ins
    keep their class, and ``policy``, if given, is pinned on the chosen
    drop-ins too. The chosen drop-ins become ``model``'s: one workspace
    state for the model (``ModelWorkspaceState``), whatever model they
    belonged to before. A model without TE modules is returned unchanged.
    Call it before ``fully_shard``: a TE module FSDP2 already wraps is
    refused. Every argument and module is checked (and ``module_filter``
    asked) before any class changes, so a refused call leaves the model as it was.
    """
    checks.expect_module("convert_model", "model", model)
    checks.expect_callable("convert_model", "module_filter", module_filter)
    checks.expect_policy("convert_model", policy)
    chosen = _conversions(model, module_filter)
    owner = model_for_root(model) if chosen else None
    for module, target in chosen:
        if target is not None:
            module.__class__ = target
            module.__dict__.pop("_is_fsdp2", None)  # TE caches its FSDP2 flag; ours is detected afresh
        state_of(module, owner)
        if policy is not None:
            module.workspace_policy = policy
    return model


def _conversions(model: torch.nn.Module, module_filter: Callable | None) -> list[tuple[torch.nn.Module, type | None]]:
    """``(module, drop-in class or None if already one)`` for each chosen TE
    module; raises, having changed nothing, on a module FSDP2 wraps."""
    chosen = []
    for fqn, module in model.named_modules():
        managed = isinstance(module, _MANAGED)
        target = None if managed else _managed_class_for(type(module))
        if not managed and target is None:
            continue
        if module_filter is not None and not module_filter(module, fqn):
            continue
        if target is not None and _is_fsdp2_wrapped(module):
            raise PolicyMismatchError(
                f"convert_model: {fqn or 'the model'} ({type(module).__name__}) is already wrapped by "
                "fully_shard; FSDP2 replaced its class. Convert the model before calling fully_shard. "
                "Nothing was converted."
            )
        chosen.append((module, target))
    return chosen


def _is_fsdp2_wrapped(module: torch.nn.Module) -> bool:
    return hasattr(type(module), "_get_fsdp_state") or type(module).__name__.startswith("FSDP")


def set_workspace_policy(module: torch.nn.Module, policy: WorkspacePolicy | None) -> None:
    """Pin ``policy`` on a drop-in module (None: back to per-call selection).
    A pinned policy that does not cover a call fails at that call's forward
    with :class:`PolicyMismatchError`."""
    checks.expect_module("set_workspace_policy", "module", module)
    if not isinstance(module, _MANAGED):
        raise TypeError(
            f"set_workspace_policy: module must be a te_integration drop-in module; {type(module).__name__} "
            "is not one. Convert it first: te_integration.convert_model(model, policy=...)."
        )
    checks.expect_policy("set_workspace_policy", policy)
    module.workspace_policy = policy


def last_plans(module: torch.nn.Module) -> dict:
    """``{weight key: (context, plan)}`` of the module's latest managed call,
    for reviewers asking why a workspace is alive. A stock TE module, or a
    drop-in that has not run a managed call, has none: ``{}``."""
    checks.expect_te_module("last_plans", "module", module, tuple(drop_ins()),
                           "For a whole model: {name: last_plans(m) for name, m in model.named_modules() ...}.")
    state = module._wm_state if isinstance(module, _MANAGED) else None
    return state.last_plans() if state is not None else {}


def workspace_state(module: torch.nn.Module) -> ModuleWorkspaceState:
    """The drop-in ``module``'s :class:`ModuleWorkspaceState` (made if needed):
    its pinned policy, sharding, plans and memo, for tools and tests."""
    if not isinstance(module, _MANAGED):
        raise TypeError(
            f"workspace_state needs a te_integration module; {type(module).__name__} is not one. "
            "Convert it first with te_integration.convert_model."
        )
    return state_of(module)
