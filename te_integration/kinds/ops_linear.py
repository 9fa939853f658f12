"""``te.ops.BasicLinear`` (alone, inside ``te.ops.Linear`` and in every fused
op built on it) under the policy: its drop-in ``OpsBasicLinear``, and
``OpsLinear``, ``te.ops.Linear`` built with an ``OpsBasicLinear`` inside.

The op is found among the ops of each fuser call: the fuser Function seam
(``runtime/_ops_fuser``, shared by every te.ops kind) pushes its record and
afterwards asks :func:`_edit_op_ctx` for backward's levers. Its weight is
planned by a seam of its own, which every forward path calls:

* **The ``BasicLinear._functional_forward`` seam** (the class attribute,
  through which ``op_forward`` and every fused forward call it): for the
  weight of an op with a record, it plans the weight (memo per call shape)
  and carries the plan out. Under a plan that saves no workspace it calls
  TE's function with ``input_requires_grad=False``, whose only effects there
  are a rowwise-only forward quantization and no workspace returned, and
  returns the high-precision weight for the caller to save instead, which
  TE's backward quantizes again; otherwise TE's own (it saves the
  columnwise copy only).
* **The ``BasicLinear._functional_backward`` seam** rebuilds a weight planned
  ``requantize`` under ``backward_override="dequantized"``.

Calls TE handles by itself pass through: no quantized compute, CUDA-graph
capture, ops without a record (stock ops), and fused forms that do not call
``BasicLinear._functional_forward`` (Userbuffers). Being a subclass, the
drop-in fuses as TE's op does (the fusion rules test ``isinstance(op,
BasicLinear)``); it adds no parameter, buffer or submodule, so
``state_dict`` is TE's.
"""

from __future__ import annotations

from typing import Any

from workspace_manager import BackwardOverride, BackwardSource, RecomputePass, RecomputeScope

from ..runtime import _attribution
from ..runtime._call import ACTIVE, CallRecord, recompute_pass
from ..runtime._foreign_patches import SeamedName
from ..runtime._managed_common import ManagedOp
from ..runtime._plan_support_ops import ops_unsupported_reason
from ..runtime._rebuild import RebuildQuantizer
from ..runtime._kind_registry import OP_HOOKS, Adapter, ModuleKind, OpHooks, register
from ..te import _compat as te
from ..te import _compat_ops as te_ops

__all__ = ["OpsBasicLinear", "OpsLinear"]

KIND = ModuleKind("ops_basic_linear")
_RECORDINGS = _attribution.ACTIVE_RECORDINGS
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
    while record is not None and record.kind in OP_HOOKS:
        if record.kind is KIND and record.module.weight is weight:
            return record
        record = record.previous
    return None


class FunctionalForwardSeam:
    """``BasicLinear._functional_forward`` with the op's plan applied. An
    instance, not a function, so that the class attribute stays unbound."""

    __slots__ = ()

    def __call__(self, *args, **kwargs):
        record = ACTIVE.record
        if (record is None or record.kind not in OP_HOOKS or not kwargs.get("with_quantized_compute")
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
        if _RECORDINGS and out[2] is not None and out[2] is not weight:
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


def _edit_op_ctx(op_ctx, record) -> list:
    """The rebuild quantizer the op's backward uses (D9); the weight to release, if its plan releases."""
    weight, levers = record.weights
    quantizer = getattr(op_ctx, "weight_quantizer", None)
    if quantizer is not None and levers.rebuild_usage is not None:
        op_ctx.weight_quantizer = record.state.backward_quantizer(levers, quantizer)
    elif quantizer is not None and _rebuilds_for_dequantized(levers):
        # Both usages under "dequantized": still a RebuildQuantizer, the
        # mark the backward seam rebuilds by (TE's backward would not).
        op_ctx.weight_quantizer = RebuildQuantizer(quantizer, levers.plan.backward_usage)
    return [(weight, levers)] if levers.releases else []


_FUNCTIONAL_SEAM = FunctionalForwardSeam()
_BACKWARD_SEAM = FunctionalBackwardSeam()


def _seams() -> tuple[SeamedName, ...]:
    """BasicLinear's two functional methods, with TE's own definition of each."""
    cls = te_ops.BasicLinear
    return (
        SeamedName(cls, "_functional_forward", f"{cls.__module__}.BasicLinear._functional_forward", _FUNCTIONAL_SEAM),
        SeamedName(cls, "_functional_backward", f"{cls.__module__}.BasicLinear._functional_backward",
                   _BACKWARD_SEAM),
    )


class OpsBasicLinear(ManagedOp, te_ops.BasicLinear):
    """``te.ops.BasicLinear`` whose weight workspace follows a :class:`WorkspacePolicy`,
    alone, inside ``te.ops.Linear`` and in every fused op built on it."""

    _wm_kind = KIND


class OpsLinear(te_ops.OpsLinear):
    """``te.ops.Linear`` (same constructor) whose ``BasicLinear`` is an :class:`OpsBasicLinear`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for op in self.basic_ops:
            if type(op) is te_ops.BasicLinear:
                op.__class__ = OpsBasicLinear


# ``te.ops.Linear`` builds its op from the name in its module file; the
# public name is ``te.ops.BasicLinear``. te.ops.Linear's too in explain's
# legend (a note saying so would not fit explain's one screen).
ADAPTER = Adapter(
    kind=KIND, te_class=te_ops.BasicLinear, drop_in=OpsBasicLinear, order=50,
    construction=((te_ops.ops_linear_module, "BasicLinear"), (te_ops.ops_package, "BasicLinear")),
    explain_name="te.ops.BasicLinear", refusal=ops_unsupported_reason,
    op=OpHooks(edit_ctx=_edit_op_ctx, seams=_seams),
)
register(ADAPTER)
