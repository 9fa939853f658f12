"""``te.ops.GroupedLinear`` under the policy: its drop-in ``OpsGroupedLinear``.

The op is found, as ``BasicLinear`` is, among the ops of a fuser call (the
fuser Function seam in ``runtime/_ops_fuser`` pushes its record, and asks
:func:`_edit_op_ctx` for backward's levers). Its forward quantizes and
saves its weights in its own methods, not through
``BasicLinear._functional_forward``, so the drop-in overrides those methods
and calls these functions:

* Both forward paths (``_fuser_forward_split_quantize`` and, where TE picks
  it, ``_fuser_forward_grouped_tensor``) take ``input_requires_grad``,
  whose only effects there are the weights' columnwise usage and whether
  the quantized weights are saved. Under a plan that saves no workspace TE
  runs with it False and the op saves the high-precision weights in their
  places (the last of the saved tensors); backward's ``fuser_backward``
  runs the before phase of the op's ``BackwardWork``, whose
  :class:`OpRebuild` quantizes them again, with the plan's usages, before
  TE's backward reads them. Under a plan that saves the workspace, what is
  saved keeps only the usages backward reads (TE's grouped-tensor path
  saves both).
* Where that plan also caches nothing (FSDP2's), the weights TE quantizes
  in forward live only in that forward, so the drop-in's
  ``_get_discrete_weights_for_gemm`` (the split-quantize path's, one TE call
  per group) quantizes them all with one grouped call
  (``runtime/_expert_quantize``), as the rebuild in backward does.
* Each group's weight is planned under its own key (``weight0``, ...); the
  groups share one call shape, so one plan.

TE's grouped op ignores ``backward_override`` (it always runs a quantized
backward), so its calls are planned without one. Calls TE handles by
itself: no quantized compute, CUDA-graph capture, distributed weights
(TE re-materializes them), a single grouped weight (``single_grouped_weight=True``:
one ``GroupedTensor`` parameter, which only TE's grouped kernels quantize),
and the fused grouped MLP (compute capability 10.x only), which does not
call these methods.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from workspace_manager import BackwardSource, CacheAction, ColumnwiseSource, RecomputePass, RecomputeScope, Usage

from ..runtime._call import ACTIVE, CallPart, recompute_pass
from ..runtime._expert_quantize import quantize_experts
from ..runtime._freshness import is_per_tensor
from ..runtime._managed_common import ManagedOp
from ..runtime._plan_support_ops import ops_unsupported_reason
from ..runtime._rebuild import Rebuild
from ..runtime._kind_registry import Adapter, ModuleKind, OpHooks, register
from ..runtime._release import BackwardWork
from ..te import _compat as te
from ..te import _compat_ops as te_ops

__all__ = ["OpsGroupedLinear"]

KIND = ModuleKind("ops_grouped_linear")
_NO_RECOMPUTE, _REGION = RecomputePass.NONE, RecomputeScope.REGION


def _record_of(op):
    record = ACTIVE.record
    while record is not None and record.module is not op:
        record = record.previous
    return record


def _weights(op) -> tuple[tuple[str, ...], list]:
    keys = tuple(f"weight{i}" for i in range(op.num_groups))
    return keys, [getattr(op, key) for key in keys]


def _plan(op, record, kwargs) -> list:
    """``[(weight, levers)]`` for each group of the call."""
    keys, weights = _weights(op)
    quantizers = kwargs["weight_quantizers"]
    input_rg, weight_rg = kwargs["input_requires_grad"], kwargs["weight_requires_grad"]
    recompute = recompute_pass() if te.recompute_flags._IN_ACTIVATION_RECOMPUTE_REGION else _NO_RECOMPUTE
    planned = []
    for key, weight, quantizer in zip(keys, weights, quantizers):
        levers = record.state.levers(
            op, record.sharding, key=key, weight=weight, quantizer=quantizer, grad=input_rg or weight_rg,
            input_requires_grad=input_rg, is_first_microbatch=None, backward_override=None, recompute=recompute,
            scope=_REGION,
        )
        planned.append((weight, levers))
    return planned


def grouped_forward(op, te_method, kwargs: dict):
    """Run one of TE's forward paths of ``op`` as its plan says."""
    record = _record_of(op) if kwargs.get("with_quantized_compute") else None
    if (record is None or te.graph_flags._IS_GRAPH_CAPTURING or op._is_distributed_weight()
            or op.single_grouped_weight):
        return te_method(**kwargs)
    planned = _plan(op, record, kwargs)
    record.weights = tuple(item for pair in planned for item in pair)
    levers = planned[0][1]
    input_rg = kwargs["input_requires_grad"]
    n = len(planned)
    if levers.saves_no_workspace and not levers.is_quantized_param:
        kwargs["input_requires_grad"] = False  # rowwise only, and no quantized weight saved
        if levers.cache is CacheAction.BYPASS:
            record.part = AT_ONCE  # the weights live only in this forward: all from one grouped quantization
        out, saved = te_method(**kwargs)
        kept = tuple(w for w, _ in planned) if input_rg else (None,) * n
        return out, saved[:-n] + kept
    out, saved = te_method(**kwargs)
    if levers.saves_columnwise_only:
        for w in saved[-n:]:
            if isinstance(w, te.QuantizedTensorStorage) and not levers.is_quantized_param:
                w.update_usage(rowwise_usage=False, columnwise_usage=True)
    return out, saved


def _edit_op_ctx(op_ctx, record) -> list:
    """The fuser seam's hook (``OpHooks.edit_ctx``): leave on the op's context
    the :class:`BackwardWork` whose before phase its ``fuser_backward`` runs:
    an :class:`OpRebuild` of the weights saved in high precision, or a
    :class:`DeriveColumnwise` of the quantized parameters saved. te.ops runs
    one backward per op inside the fuser's, so the op's context carries the
    phase; the release is the fuser's (``runtime/_ops_fuser``), after every
    op's backward, also when one raises: the returned weights whose plans
    release."""
    weights = record.weights
    releases = [(weights[i], weights[i + 1]) for i in range(0, len(weights), 2) if weights[i + 1].releases]
    levers = weights[1]
    if not getattr(op_ctx, "input_requires_grad", 0):
        return releases
    count = len(weights) // 2
    if levers.is_quantized_param:
        # TE's grouped op reads the parameters' columnwise data as it finds it
        # and derives none; the plan's release dropped it after the last
        # backward (every format the plan derives), or the forward marked an
        # FP8 transpose older than the weight invalid (D12).
        before = DeriveColumnwise(count, levers.plan.columnwise_source is ColumnwiseSource.DERIVED)
    elif levers.plan.backward_source is BackwardSource.REQUANTIZE:
        usage = levers.plan.backward_usage if levers.plan.backward_usage is not Usage.NONE else Usage.COLUMNWISE
        before = OpRebuild(op_ctx.weight_quantizers[:count], usage, record.state)
    else:
        return releases
    op_ctx._te_wm_backward = BackwardWork(record.module, before_te_backward=before.before_te_backward)
    return releases


class OpRebuild(Rebuild):
    """te.ops GroupedLinear's part of the one rebuild (``runtime/_rebuild``): the
    weights go back into the op context's saved tensors (the last of them),
    before TE's ``fuser_backward`` reads them."""

    __slots__ = ()

    def before_te_backward(self, op_ctx, saved: tuple) -> tuple:
        n = len(self.quantizers)
        # restore=True: the quantizers are left with both usages, as TE's rebuilds leave them.
        return tuple(saved[:-n]) + tuple(self.quantized(saved[-n:], True))


@dataclass(frozen=True, slots=True)
class DeriveColumnwise:
    """The before phase for quantized parameters, which te.ops GroupedLinear
    saves as they are: their columnwise data derived from their rowwise
    data, in place, before TE's backward reads it."""

    #: How many of the saved tensors (the last) are the parameters.
    count: int
    #: Every format (the plan's ``ColumnwiseSource.DERIVED``), or only an
    #: FP8 transpose the forward marked invalid (D12).
    every_format: bool

    def before_te_backward(self, op_ctx, saved: tuple) -> tuple:
        every_format = self.every_format
        for w in saved[-self.count:]:
            if isinstance(w, te.QuantizedTensorStorage) and (every_format or _invalidated(w)):
                w.update_usage(columnwise_usage=True)
        return saved


def _invalidated(w) -> bool:
    """An FP8 transpose the forward marked invalid (D12): derived again."""
    return is_per_tensor(w) and w._transpose is not None and w._transpose_invalid


def grouped_before_backward(op_ctx) -> None:
    """The before phase of the op's :class:`BackwardWork`, where its
    ``fuser_backward`` starts: the saved weights made as the plan says
    before TE's backward reads them. Run once."""
    work = getattr(op_ctx, "_te_wm_backward", None)
    if work is not None:  # set only with a before phase (_edit_op_ctx)
        op_ctx._te_wm_backward = None
        op_ctx.saved_tensors = work.before_te_backward(op_ctx, op_ctx.saved_tensors)


class GroupsAtOnce(CallPart):
    """The record's part (:data:`AT_ONCE`) of a te.ops GroupedLinear call
    whose groups' weights are quantized by one grouped call in forward."""

    __slots__ = ()


AT_ONCE = GroupsAtOnce()


class OpsGroupedLinear(ManagedOp, te_ops.GroupedLinear):
    """``te.ops.GroupedLinear`` whose weights' workspaces follow a :class:`WorkspacePolicy`
    (each group's weight planned under its own key; see the module docstring)."""

    _wm_kind = KIND

    def _get_discrete_weights_for_gemm(self, weight_params, weight_quantizers, columnwise_usage: bool,
                                       with_quantized_compute: bool, dtype) -> list:
        """TE's per-group quantization of the forward weights, made by one
        grouped call (``_expert_quantize``) where the plan keeps none of
        them past this forward and a grouped call gives TE's bytes."""
        record = _record_of(self) if with_quantized_compute else None
        if record is not None and record.part is AT_ONCE and isinstance(weight_params, list):
            grouped = quantize_experts(record.state, weight_quantizers, weight_params, True, columnwise_usage)
            if grouped is not None:
                return grouped
        return super()._get_discrete_weights_for_gemm(weight_params, weight_quantizers, columnwise_usage,
                                                      with_quantized_compute, dtype)

    def _fuser_forward_split_quantize(self, **kwargs: Any) -> Any:
        return grouped_forward(self, super()._fuser_forward_split_quantize, kwargs)

    def _fuser_forward_grouped_tensor(self, **kwargs: Any) -> Any:
        return grouped_forward(self, super()._fuser_forward_grouped_tensor, kwargs)

    def fuser_backward(self, basic_op_ctxs: Any, grad_output: Any, **kwargs: Any) -> Any:
        grouped_before_backward(basic_op_ctxs[0])  # the before phase of the op's BackwardWork
        return super().fuser_backward(basic_op_ctxs, grad_output, **kwargs)


# Its records are opened by the fuser Function seam, as BasicLinear's are
# (install replaces that name once); the public name is te.ops.GroupedLinear.
ADAPTER = Adapter(
    kind=KIND, te_class=te_ops.GroupedLinear, drop_in=OpsGroupedLinear, order=60,
    construction=((te_ops.ops_package, "GroupedLinear"),),
    explain_name="te.ops.GroupedLinear", explain_note="one plan for all experts", refusal=ops_unsupported_reason,
    op=OpHooks(edit_ctx=_edit_op_ctx),
)
register(ADAPTER)
