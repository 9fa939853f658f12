"""``te.ops.BasicLinear`` under the policy: the two seams of TE's fusible ops.

te.ops ops are not TE modules (no ``prepare_forward``/``end_forward``): an
``OperationFuser`` runs a whole pipeline of ops in one autograd Function,
``_OperationFuserAutogradFunction``, whose forward calls each op's (or each
fused op's) ``fuser_forward`` with per-op ``OperationContext`` objects. So a
call's records are opened around that Function's forward:

* **The fuser Function seam** (a same-named subclass in ``ops/fuser.py``,
  which ``OperationFuser.__call__`` looks up by name at each call): for each
  drop-in op among ``fuser._basic_ops`` it pushes a
  :class:`~te_integration._call.CallRecord` (the op, its state, its sharding
  read now), runs TE's forward, pops them in a ``finally``; then sets, on
  each op's context, the rebuild quantizer backward uses (D9), and the
  call's :class:`~te_integration._release.BackwardWork` on the fuser's ctx.
  Its backward is TE's followed by the plans' release.
* **The ``BasicLinear._functional_forward`` seam** (the class attribute,
  through which ``op_forward`` and every fused forward call it): for the
  weight of an op with a record, it plans the weight (memo per call shape)
  and carries the plan out. Under a plan that saves no workspace it calls
  TE's function with ``input_requires_grad=False``, whose only effects there
  are a rowwise-only forward quantization and no workspace returned, and
  returns the high-precision weight for the caller to save instead, which
  TE's backward quantizes again; otherwise TE's own (it saves the
  columnwise copy only).

Calls TE handles by itself pass through: no quantized compute, CUDA-graph
capture, ops without a record (stock ops), and fused forms that do not call
``BasicLinear._functional_forward`` (Userbuffers).
"""

from __future__ import annotations

import types

import torch

from workspace_manager import BackwardOverride, BackwardSource, RecomputePass, RecomputeScope

from . import _attribution
from . import _compat as te
from . import _compat_ops as te_ops
from ._call import ACTIVE, CallRecord, new_record, recompute_pass
from ._foreign_patches import SeamedName
from ._adapter_ops_grouped import grouped_backward_levers
from ._rebuild import RebuildQuantizer
from ._release import BackwardWork, run_backward
from ._state import ModuleKind, state_of

__all__ = ["OPS_KINDS", "FunctionalForwardSeam", "FunctionalBackwardSeam", "ops_seamed_names",
           "FUSER_SEAM"]

_LEDGER = _attribution.LEDGER
_OPS_LINEAR, _OPS_GROUPED = ModuleKind.OPS_BASIC_LINEAR, ModuleKind.OPS_GROUPED_LINEAR
#: The kinds whose records the fuser seam pushes.
OPS_KINDS = frozenset({_OPS_LINEAR, _OPS_GROUPED})
_NO_RECOMPUTE, _REGION = RecomputePass.NONE, RecomputeScope.REGION
_TE_FORWARD = te_ops.BasicLinear.__dict__["_functional_forward"].__func__
_TE_BACKWARD = te_ops.BasicLinear.__dict__["_functional_backward"].__func__


def _rebuilds_for_dequantized(levers) -> bool:
    """A ``requantize`` plan for both usages under backward_override="dequantized"."""
    return (levers.rebuild_usage is None and levers.plan.backward_source is BackwardSource.REQUANTIZE
            and levers.context.backward_override is BackwardOverride.DEQUANTIZED)


def _record_for(weight) -> CallRecord | None:
    """The record of the op whose weight this is, among the fuser call's."""
    record = ACTIVE.record
    while record is not None and record.kind in OPS_KINDS:
        if record.kind is _OPS_LINEAR and record.module.weight is weight:
            return record
        record = record.previous
    return None


class FunctionalForwardSeam:
    """``BasicLinear._functional_forward`` with the op's plan applied. An
    instance, not a function, so that the class attribute stays unbound."""

    __slots__ = ()

    def __call__(self, *args, **kwargs):
        record = ACTIVE.record
        if (record is None or record.kind not in OPS_KINDS or not kwargs.get("with_quantized_compute")
                or te.graph_flags._IS_GRAPH_CAPTURING):
            return _TE_FORWARD(*args, **kwargs)
        weight = kwargs["weight"] if "weight" in kwargs else args[1]
        record = _record_for(weight)
        if record is None:
            return _TE_FORWARD(*args, **kwargs)
        input_rg, weight_rg = kwargs.get("input_requires_grad", True), kwargs.get("weight_requires_grad", True)
        levers = record.state.levers(
            record.module, record.sharding, key="weight", weight=weight, quantizer=kwargs.get("weight_quantizer"),
            grad=input_rg or weight_rg, input_requires_grad=input_rg, is_first_microbatch=None,
            backward_override=kwargs.get("backward_override"),
            recompute=recompute_pass() if te.recompute_flags._IN_ACTIVATION_RECOMPUTE_REGION else _NO_RECOMPUTE,
            scope=_REGION,
        )
        record.weights = (weight, levers)
        if levers.saves_no_workspace and not levers.is_quantized_param:
            kwargs["input_requires_grad"] = False  # rowwise only, and no workspace returned
            y, x_local, w = _TE_FORWARD(*args, **kwargs)
            return y, x_local, (weight if input_rg else None)
        out = _TE_FORWARD(*args, **kwargs)
        if _LEDGER.enabled and out[2] is not None and out[2] is not weight:
            _attribution.forward_workspace(record.module, "weight", levers.plan, out[2], from_cache=False)
        return out


class FunctionalBackwardSeam:
    """``BasicLinear._functional_backward``, which rebuilds a weight planned
    ``requantize`` under ``backward_override="dequantized"``: TE's backward
    then dequantizes what it is given and never quantizes a high-precision
    weight, so the rebuild quantizer the fuser seam left on the op's context
    (a :class:`RebuildQuantizer`, which only the binding makes) quantizes it
    first. Every other call is TE's, unchanged (one type check)."""

    __slots__ = ()

    def __call__(self, *args, **kwargs):
        quantizer = kwargs.get("weight_quantizer")
        if type(quantizer) is not RebuildQuantizer or kwargs.get("with_quantized_compute"):
            return _TE_BACKWARD(*args, **kwargs)
        weight = kwargs.get("weight")
        if weight is not None and kwargs.get("input_requires_grad", True) and not isinstance(
                weight, te.QuantizedTensorStorage):
            kwargs["weight"] = quantizer(weight)
        return _TE_BACKWARD(*args, **kwargs)


def _open(fuser) -> list:
    """Push a record for each drop-in op of ``fuser``; ``[(index, record)]``."""
    opened = []
    for index, op in enumerate(fuser._basic_ops):
        if getattr(type(op), "_wm_kind", None) not in OPS_KINDS:
            continue
        state = state_of(op)
        probe = state.probe(op)
        record = ACTIVE.record = new_record(op, state, probe.read(), ACTIVE.record, pushed_by_seam=True)
        opened.append((index, record))
    return opened


def _edit_ctxs(func_ctx, opened: list) -> None:
    """Backward's levers on each op's context, and the call's release work."""
    releases = []
    for index, record in opened:
        if not record.weights:
            continue  # TE handled the call itself
        op_ctx = func_ctx.basic_op_ctxs[index]
        if record.kind is _OPS_GROUPED:
            grouped_backward_levers(op_ctx, record)
            weights = record.weights
            releases += [(weights[i], weights[i + 1]) for i in range(0, len(weights), 2) if weights[i + 1].releases]
            continue
        weight, levers = record.weights
        quantizer = getattr(op_ctx, "weight_quantizer", None)
        if quantizer is not None and levers.rebuild_usage is not None:
            op_ctx.weight_quantizer = record.state.backward_quantizer(levers, quantizer)
        elif quantizer is not None and _rebuilds_for_dequantized(levers):
            # Both usages under "dequantized": still a RebuildQuantizer, the
            # mark the backward seam rebuilds by (TE's backward would not).
            op_ctx.weight_quantizer = RebuildQuantizer(quantizer, levers.plan.backward_usage)
        if levers.releases:
            releases.append((weight, levers))
    # te.ops has no cache, so only a quantized parameter's columnwise data is released (module unused).
    func_ctx._te_wm_backward = BackwardWork(opened[0][1].module, tuple(releases)) if releases else None


def _fuser_forward(func_ctx, input_, fuser, *args):
    te_forward = te_ops.FuserFunction.forward
    # Inside a torch.compile trace the ops stay stock, as the modules do (_modules).
    top = ACTIVE.record
    opened = _open(fuser) if ((top is None or top.kind not in OPS_KINDS)
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
        if _LEDGER.enabled:
            _attribution.tag(func_ctx, opened[0][1].module)
    return out


def _fuser_backward(func_ctx, *grads):
    te_backward = te_ops.FuserFunction.backward
    if getattr(func_ctx, "_te_wm_backward", None) is None and not _LEDGER.enabled:
        return te_backward(func_ctx, *grads)
    return run_backward(func_ctx, te_backward, grads)


def _body(namespace: dict) -> None:
    namespace.update({"forward": staticmethod(_fuser_forward), "backward": staticmethod(_fuser_backward),
                      "__doc__": "TE's ``_OperationFuserAutogradFunction``, with each drop-in op's plan applied.",
                      "__module__": __name__})


#: The fuser Function seam, named as TE's (so grad_fn names do not change).
FUSER_SEAM = types.new_class("_OperationFuserAutogradFunction", (te_ops.FuserFunction,), {}, _body)
_FUNCTIONAL_SEAM = FunctionalForwardSeam()
_BACKWARD_SEAM = FunctionalBackwardSeam()


def ops_seamed_names() -> tuple[SeamedName, ...]:
    """The names install replaces for te.ops, with TE's own definition of each."""
    fuser, cls = te_ops.fuser_module, te_ops.BasicLinear
    return (
        SeamedName(fuser, "_OperationFuserAutogradFunction", f"{fuser.__name__}._OperationFuserAutogradFunction",
                   FUSER_SEAM, te_ops.FuserFunction),
        SeamedName(cls, "_functional_forward", f"{cls.__module__}.BasicLinear._functional_forward", _FUNCTIONAL_SEAM),
        SeamedName(cls, "_functional_backward", f"{cls.__module__}.BasicLinear._functional_backward",
                   _BACKWARD_SEAM),
    )
