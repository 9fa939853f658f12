"""The drop-ins' mixins: what every one shares (:class:`ManagedCommon`, under
``_modules.ManagedModule`` for TE's modules and :class:`ManagedOp` for
te.ops's ops): the pinned policy as a property, the sharded quantized parameters trimmed to their plan after
TE's ``reset_parameters`` and ``_load_from_state_dict`` (D10), and no
quantized copy kept past a move of the module's parameters or a state-dict
load (D12)."""

from __future__ import annotations

from typing import Any, ClassVar

from workspace_manager import WorkspacePolicy

from . import _install
from ._freshness import placement, release_module
from ._kind_registry import ModuleKind
from ._shards import trim_sharded_parameters
from ._state import ModuleWorkspaceState, state_of

__all__ = ["ManagedCommon", "ManagedOp"]


class ManagedCommon:
    """Mixin base of the drop-ins' mixins; holds no state of its own."""

    def reset_parameters(self, *args: Any, **kwargs: Any) -> None:
        super().reset_parameters(*args, **kwargs)
        release_module(self)  # copies of the weights just replaced
        trim_sharded_parameters(self)

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        # The copies were made from the weights just replaced.
        release_module(self)
        trim_sharded_parameters(self)

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        # ``module.to``/``.cpu()``/``.half()`` come here (and recurse here for
        # each drop-in below): copies made on the old device or from the old
        # dtype must not stay behind (an offload leaves nothing on the GPU).
        before = placement(self)
        out = super()._apply(fn, *args, **kwargs)
        if placement(self) != before:
            release_module(self)
        return out

    @property
    def workspace_policy(self) -> WorkspacePolicy | None:
        """The policy pinned on this module (see :func:`set_workspace_policy`);
        None lets the manager select one per call."""
        state = self._wm_state
        return state.policy if state is not None else None

    @workspace_policy.setter
    def workspace_policy(self, policy: WorkspacePolicy | None) -> None:
        state_of(self).policy = policy


class ManagedOp(ManagedCommon):
    """Mixin placed before a te.ops basic operation class. It holds no
    workspace logic (the te.ops seams carry out the plans, finding the op
    among the ops of each fuser call): it installs the seams before the op's
    first fuser call (TE calls every op's ``pre_fuser_forward`` before
    looking up the fuser's autograd Function), and keeps sharded quantized
    parameters trimmed to their plan as the modules' mixin does. It adds no
    parameter, buffer or submodule, so ``state_dict`` is TE's."""

    _wm_kind: ClassVar[ModuleKind]
    _wm_state: ModuleWorkspaceState | None = None

    def pre_fuser_forward(self, *, requires_grad: bool) -> None:
        state = self._wm_state
        if state is None or not state.installed or not _install.INSTALLED:
            _install.install()
            state_of(self).installed = True
        super().pre_fuser_forward(requires_grad=requires_grad)
