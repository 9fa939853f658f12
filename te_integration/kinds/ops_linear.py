"""Drop-in ``te.ops`` operations: ``OpsBasicLinear``, ``OpsGroupedLinear`` and ``OpsLinear``.

``OpsBasicLinear`` is TE's ``te.ops.BasicLinear`` with one mixin in front;
its plans are carried out by the te.ops seams (``_adapter_ops``), which find
it among the ops of each fuser call. The mixin holds no workspace logic:
it installs the seams before the op's first fuser call (TE calls every op's
``pre_fuser_forward`` before looking up the fuser's autograd Function), and
keeps sharded quantized parameters trimmed to their plan as the modules'
mixin does. It adds no parameter, buffer or submodule, so ``state_dict`` is
TE's. Being a subclass, it fuses as TE's op does (the fusion rules test
``isinstance(op, BasicLinear)``).

``OpsLinear`` is ``te.ops.Linear`` built with an ``OpsBasicLinear`` inside.
"""

from __future__ import annotations

from typing import Any, ClassVar

from . import _compat_ops as te_ops
from . import _install
from ._adapter_ops import ops_seamed_names
from ._adapter_ops_grouped import grouped_before_backward, grouped_forward
from ._kinds import KindEntry, register
from ._plan_support_ops import ops_unsupported_reason
from ._managed_common import ManagedCommon
from ._state import ModuleKind, ModuleWorkspaceState, state_of

__all__ = ["OpsBasicLinear", "OpsGroupedLinear", "OpsLinear", "ManagedOp"]


class ManagedOp(ManagedCommon):
    """Mixin placed before a te.ops basic operation class (see the module docstring)."""

    _wm_kind: ClassVar[ModuleKind]
    _wm_state: ModuleWorkspaceState | None = None
    _wm_installed: bool = False

    def pre_fuser_forward(self, *, requires_grad: bool) -> None:
        if not self._wm_installed or not _install.INSTALLED:
            _install.install()
            state_of(self)
            self.__dict__["_wm_installed"] = True
        super().pre_fuser_forward(requires_grad=requires_grad)



class OpsBasicLinear(ManagedOp, te_ops.BasicLinear):
    """``te.ops.BasicLinear`` whose weight workspace follows a :class:`WorkspacePolicy`,
    alone, inside ``te.ops.Linear`` and in every fused op built on it."""

    _wm_kind = ModuleKind.OPS_BASIC_LINEAR


class OpsGroupedLinear(ManagedOp, te_ops.GroupedLinear):
    """``te.ops.GroupedLinear`` whose weights' workspaces follow a :class:`WorkspacePolicy`
    (each group's weight planned under its own key; see ``_adapter_ops_grouped``)."""

    _wm_kind = ModuleKind.OPS_GROUPED_LINEAR

    def _fuser_forward_split_quantize(self, **kwargs: Any) -> Any:
        return grouped_forward(self, super()._fuser_forward_split_quantize, kwargs)

    def _fuser_forward_grouped_tensor(self, **kwargs: Any) -> Any:
        return grouped_forward(self, super()._fuser_forward_grouped_tensor, kwargs)

    def fuser_backward(self, basic_op_ctxs: Any, grad_output: Any, **kwargs: Any) -> Any:
        grouped_before_backward(basic_op_ctxs[0])
        return super().fuser_backward(basic_op_ctxs, grad_output, **kwargs)


class OpsLinear(te_ops.OpsLinear):
    """``te.ops.Linear`` (same constructor) whose ``BasicLinear`` is an :class:`OpsBasicLinear`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for op in self.basic_ops:
            if type(op) is te_ops.BasicLinear:
                op.__class__ = OpsBasicLinear


# Both ops are carried out by the same seams (``ops_seamed_names``): the
# fuser Function's and BasicLinear's functional methods (install takes each
# name once). ``te.ops.Linear`` builds its op from the name in its module
# file; the public names are ``te.ops.BasicLinear`` and ``te.ops.GroupedLinear``.
register(KindEntry(kind=ModuleKind.OPS_BASIC_LINEAR, te_class=te_ops.BasicLinear, drop_in=OpsBasicLinear,
                   seams=ops_seamed_names,
                   construction=((te_ops.ops_linear_module, "BasicLinear"), (te_ops.ops_package, "BasicLinear")),
                   # te.ops.Linear's too (a note saying so would not fit explain's one screen)
                   explain_name="te.ops.BasicLinear", refusal=ops_unsupported_reason))
register(KindEntry(kind=ModuleKind.OPS_GROUPED_LINEAR, te_class=te_ops.GroupedLinear, drop_in=OpsGroupedLinear,
                   seams=ops_seamed_names, construction=((te_ops.ops_package, "GroupedLinear"),),
                   explain_name="te.ops.GroupedLinear", explain_note="one plan for all experts",
                   refusal=ops_unsupported_reason))
