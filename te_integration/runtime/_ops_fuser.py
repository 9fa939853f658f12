"""The te.ops fuser Function seam: one body for every te.ops kind.

te.ops ops are not TE modules (no ``prepare_forward``/``end_forward``): an
``OperationFuser`` runs a whole pipeline of ops in one autograd Function,
``_OperationFuserAutogradFunction``, whose forward calls each op's (or each
fused op's) ``fuser_forward`` with per-op ``OperationContext`` objects. So a
call's records are opened around that Function's forward, by a same-named
subclass in ``ops/fuser.py`` (which ``OperationFuser.__call__`` looks up by
name at each call): for each drop-in op among ``fuser._basic_ops`` (an op
whose kind registered :class:`~te_integration.runtime._kind_registry.OpHooks`)
it pushes a :class:`~te_integration.runtime._call.CallRecord` (the op, its
state, its sharding read now), runs TE's forward, pops them in a
``finally``; then asks each op's kind (``OpHooks.edit_ctx``) to set what
the op's backward reads on its context, and puts the call's
:class:`~te_integration.runtime._release.BackwardWork` on the fuser's ctx.
Its backward is TE's followed by the plans' release.

Where each op's weights are planned is the kind's own (its file in
``kinds/``): a seam TE's op calls with the weight, or the drop-in's methods.
Ops without a record (stock ops) and calls TE handles itself pass through.
"""

from __future__ import annotations

import types

import torch

from . import _attribution
from ..te import _compat_ops as te_ops
from ._call import ACTIVE, new_record
from ._foreign_patches import SeamedName
from ._kind_registry import OP_HOOKS
from ._release import BackwardWork, run_backward
from ._state import state_of

__all__ = ["FUSER_SEAM", "fuser_seams"]

_RECORDINGS = _attribution.ACTIVE_RECORDINGS


def _open(fuser) -> list:
    """Push a record for each drop-in op of ``fuser``; ``[(index, record, its kind's hooks)]``."""
    opened = []
    for index, op in enumerate(fuser._basic_ops):
        hooks = OP_HOOKS.get(getattr(type(op), "_wm_kind", None))
        if hooks is None:
            continue
        state = state_of(op)
        probe = state.probe(op)
        record = ACTIVE.record = new_record(op, state, probe.read(), ACTIVE.record, pushed_by_seam=True)
        opened.append((index, record, hooks))
    return opened


def _edit_ctxs(func_ctx, opened: list) -> None:
    """Backward's levers on each op's context (its kind's hook), and the call's release work."""
    releases = []
    for index, record, hooks in opened:
        if record.weights:  # else TE handled the call itself
            releases += hooks.edit_ctx(func_ctx.basic_op_ctxs[index], record)
    # te.ops has no cache, so only a quantized parameter's columnwise data is released (module unused).
    func_ctx._te_wm_backward = BackwardWork(opened[0][1].module, tuple(releases)) if releases else None


def _fuser_forward(func_ctx, input_, fuser, *args):
    te_forward = te_ops.FuserFunction.forward
    # Inside a torch.compile trace the ops stay stock, as the modules do (_managed_common).
    top = ACTIVE.record
    opened = _open(fuser) if ((top is None or top.kind not in OP_HOOKS)
                              and not torch.compiler.is_dynamo_compiling()) else []
    if not opened:
        if func_ctx is not None:
            func_ctx._te_wm_backward = None
        return te_forward(func_ctx, input_, fuser, *args)
    below = opened[0][1].previous
    try:
        out = te_forward(func_ctx, input_, fuser, *args)
    finally:
        ACTIVE.record = below
    if func_ctx is not None:
        _edit_ctxs(func_ctx, opened)
        if _RECORDINGS:
            _attribution.tag(func_ctx, opened[0][1].module)
    return out


def _fuser_backward(func_ctx, *grads):
    te_backward = te_ops.FuserFunction.backward
    if getattr(func_ctx, "_te_wm_backward", None) is None and not _RECORDINGS:
        return te_backward(func_ctx, *grads)
    return run_backward(func_ctx, te_backward, grads)


def _body(namespace: dict) -> None:
    namespace.update({"forward": staticmethod(_fuser_forward), "backward": staticmethod(_fuser_backward),
                      "__doc__": "TE's ``_OperationFuserAutogradFunction``, with each drop-in op's plan applied.",
                      "__module__": __name__})


#: The fuser Function seam, named as TE's (so grad_fn names do not change).
FUSER_SEAM = types.new_class("_OperationFuserAutogradFunction", (te_ops.FuserFunction,), {}, _body)


def fuser_seams() -> tuple[SeamedName, ...]:
    """The name install replaces for every te.ops kind, with TE's own definition."""
    fuser = te_ops.fuser_module
    return (SeamedName(fuser, "_OperationFuserAutogradFunction", f"{fuser.__name__}._OperationFuserAutogradFunction",
                       FUSER_SEAM, te_ops.FuserFunction),)
