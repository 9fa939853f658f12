"""``GroupedLinear``: every expert's weight under one plan.

TE's ``_GroupedLinear.forward(ctx, inp, m_splits, non_tensor_args, out,
dgrad_out, *weights_and_biases)`` takes the experts' weights as one grouped
parameter (``single_grouped_weight``) or one per expert (``weight0`` ...), and
runs one of two paths: the split-quantize path, which quantizes each expert
with ``quantize_weight``, and the grouped-tensor path, which quantizes a
grouped weight with one kernel (discrete weights still go through
``quantize_weight``). The experts share shape and quantizer settings, so the
call is planned once, under the key ``weight``; each expert's cache entry
and attribution has TE's key (``weight0`` ...).

Unlike the dense modules, TE 2.20.2's GroupedLinear has no ``is_fsdp2``
switch and its backward quantizes nothing again (only a ``DistributedWeight``
is gathered again). Two module globals of ``grouped_linear.py`` carry out the
plans that save no workspace:

* ``prepare_for_saving`` (:func:`managed_prepare_for_saving`) gets each
  expert's high-precision weight in the slot of its workspace. Under FSDP2
  that is the unsharded parameter, whose storage FSDP2 frees after forward
  and gathers again before backward, as it does for TE's dense modules.
* ``restore_from_func_ctx`` (:func:`managed_restore_from_func_ctx`), TE's
  first act in its backward, runs the before phase of the call's
  ``BackwardWork``: where the plan requantizes, its :class:`ExpertRebuild`
  puts the weights quantized again, with the plan's backward usages, back
  into those slots before TE's backward reads them.

On the grouped-tensor path with one grouped weight, TE quantizes without
``quantize_weight`` and keeps its own cache entry (``weight``): the seam's
``_prepare_weights_for_grouped_tensor_gemm`` sets the forward usage and the
cache arguments from the plan before TE's code runs.
"""

from __future__ import annotations

from functools import partial
from itertools import repeat

from workspace_manager import (
    BackwardSource,
    CacheAction,
    ColumnwiseSource,
    RecomputePass,
    RecomputeScope,
    Sharding,
)

from ..runtime._call import ACTIVE, ANY_WEIGHT, CallPart, is_distributed, recompute_pass
from ..runtime._expert_quantize import quantize_experts
from ..runtime._freshness import refresh_experts
from ..runtime._modules import ManagedModule
from ..runtime._plan_support import plan_refusal
from ..runtime._quantize import expert_keys
from ..runtime._rebuild import Rebuild
from ..runtime._kind_registry import Adapter, FunctionSeam, ModuleKind, register
from ..runtime._release import BackwardWork
from ..runtime._saved_tensors import rowwise_parts
from ..te import _compat as te

__all__ = ["GroupedLinear"]

KIND = ModuleKind("grouped_linear")
_A = te.GROUPED_ARGS
_FP8, _DEBUG, _OFFLOAD, _SKIP = _A["fp8"], _A["debug"], _A["cpu_offloading"], _A["skip_fp8_weight_update"]
_GRAD, _FIRST, _QUANTIZERS, _SINGLE = (_A["is_grad_enabled"], _A["is_first_microbatch"], _A["weight_quantizers"],
                                       _A["single_grouped_weight"])
_DTYPE = _A["activation_dtype"]
_NO_RECOMPUTE, _REGION, _DISTRIBUTED = RecomputePass.NONE, RecomputeScope.REGION, Sharding.DISTRIBUTED_WEIGHT
#: Where the experts' weights start in ``_GroupedLinear.forward``'s arguments.
_FIRST_WEIGHT = 5


def _begin(ctx, args: tuple):
    record = ACTIVE.record
    nta = args[2]
    if (record is None or record.kind is not KIND or not nta[_FP8] or nta[_DEBUG] or nta[_SKIP] is not None
            or nta[_OFFLOAD] or te.graph_flags._IS_GRAPH_CAPTURING):
        return None
    module = record.module
    experts = args[_FIRST_WEIGHT:_FIRST_WEIGHT + (1 if nta[_SINGLE] else module.num_gemms)]
    first = experts[0]
    distributed = getattr(first, "is_distributed_weight", False) and is_distributed(first)
    recipe = te.FP8GlobalStateManager.get_fp8_recipe()
    levers = record.state.levers(
        module, _DISTRIBUTED if distributed else record.sharding, key="weight", weight=first,
        quantizer=nta[_QUANTIZERS][0], grad=nta[_GRAD], input_requires_grad=args[0].requires_grad,
        is_first_microbatch=nta[_FIRST], backward_override=getattr(recipe, "backward_override", None),
        recompute=recompute_pass() if te.recompute_flags._IN_ACTIVATION_RECOMPUTE_REGION else _NO_RECOMPUTE,
        scope=_REGION,
    )
    if nta[_SINGLE] and levers.plan.columnwise_source is ColumnwiseSource.DERIVED:
        _refuse_derived(levers)
    if levers.is_quantized_param and len(experts) > 1:
        refresh_experts(experts[1:], record.state.writes)  # the first was checked by levers() (D12)
    # Every tensor TE quantizes in this call is one of its experts.
    record.weights = (ANY_WEIGHT, levers)
    # A distributed weight's slots are TE's own (it saves None and gathers again).
    part = record.part = ExpertCall()  # fields set here: an __init__ would be one call more per module call
    part.experts, part.index, part.saves_weights = experts, 0, levers.saves_no_workspace and not distributed
    part.quantized = part.quantize_all = None
    if (part.saves_weights and levers.cache is CacheAction.BYPASS and not levers.is_quantized_param
            and not nta[_SINGLE] and first.dtype == nta[_DTYPE]):
        # Nothing cached, nothing saved: every expert's workspace lives only
        # in this forward, so all can come from one grouped quantization,
        # made at TE's first quantize_weight of the call (the seam's).
        part.quantize_all = partial(quantize_experts, record.state, nta[_QUANTIZERS], experts, True,
                                    levers.forward_columnwise)
    return record, args


class ExpertCall(CallPart):
    """A GroupedLinear call's own data (:attr:`CallRecord.part`), set by ``_begin``."""

    __slots__ = ("experts", "index", "saves_weights", "quantize_all", "quantized")

    #: The call's expert weights (one grouped weight, or one per expert),
    #: planned together under one key and cached under one key each.
    experts: tuple
    #: The expert ``quantize_weight`` is expected to see next (TE quantizes
    #: them in order), for the per-expert cache keys.
    index: int
    #: TE's saving helper gets the experts' high-precision weights in the
    #: slots of their workspaces (the plan saves no workspace).
    saves_weights: bool


def _refuse_derived(levers) -> None:
    """One grouped weight has no columnwise data TE's backward could derive:
    ``GroupedTensorStorage`` has no ``update_usage``, and the grouped-tensor
    backward derives only for quantized storages."""
    raise plan_refusal(
        "the grouped weight of a GroupedLinear(single_grouped_weight=True)",
        "columnwise_source=derived, but TE's grouped-tensor backward derives no columnwise data for a grouped "
        "weight; build it in forward (forward_usage=rowwise+columnwise) or requantize", levers.context, levers.plan)


def _edit_ctx(ctx, record, args: tuple) -> None:
    levers, part = record.weights[1], record.part
    before = None  # the before phase: the experts saved in high precision, quantized again
    if part.saves_weights and levers.plan.backward_source is BackwardSource.REQUANTIZE:
        before = ExpertRebuild(args[2][_QUANTIZERS], levers.plan.backward_usage, record.state).before_te_backward
    if not levers.releases and before is None:
        ctx._te_wm_backward = None
        return
    experts = part.experts
    keys = ()
    if levers.release_cache:
        keys = ("weight",) if args[2][_SINGLE] else expert_keys(len(experts))
    ctx._te_wm_backward = BackwardWork(record.module, tuple(zip(experts, repeat(levers))) if levers.releases else (),
                                       cache_keys=keys, before_te_backward=before)


class ExpertRebuild(Rebuild):
    """GroupedLinear's part of the one rebuild (``_rebuild``): the experts
    go back into the list of saved tensors TE's backward restored, in
    either of TE's layouts, before it reads them."""

    __slots__ = ()

    def before_te_backward(self, ctx, saved: list) -> list:
        count = ctx.num_gemms
        # The forward sets its quantizers' usages before each use, so the
        # rebuild leaves them as it set them (restore=False).
        if not ctx.grouped_tensor_supported:  # split-quantize path: inputs, workspaces, weights, biases
            saved[count:2 * count] = self.quantized(saved[count:2 * count], False)
        elif ctx.single_grouped_weight:  # grouped-tensor path: input, weights, offsets
            saved[1] = self.quantized_grouped(saved[1], count)
        else:
            saved[1:1 + count] = self.quantized(saved[1:1 + count], False)
        return saved


# -- the module globals of grouped_linear.py the seams replace ---------------------------
def managed_prepare_for_saving(*tensors):
    """TE's ``prepare_for_saving``, with the experts' high-precision weights
    in their workspaces' slots where the plan saves no workspace."""
    record = ACTIVE.record
    part = record.part if record is not None else None
    if type(part) is ExpertCall and part.saves_weights:  # a record of another kind passes (te.ops's, say)
        tensors = _weights_in_workspace_slots(tensors, part.experts, record.module.num_gemms)
    return te.prepare_for_saving(*tensors)


def _weights_in_workspace_slots(tensors: tuple, experts: tuple, count: int) -> tuple:
    """TE's two saving layouts (checked in ``_compat``): the split-quantize
    path's ``inputs, workspaces, weights, biases`` (``4 * count`` tensors)
    and the grouped-tensor path's ``input, workspaces, four offset tensors``;
    a slot TE leaves None (no dgrad follows) stays None."""
    width = len(experts)
    if len(tensors) == 4 * count:
        return tensors[:count] + experts + tensors[2 * count:]
    if len(tensors) == 1 + width + 4:
        slots = tuple(None if saved is None else weight for saved, weight in zip(tensors[1:1 + width], experts))
        return tensors[:1] + slots + tensors[1 + width:]
    raise RuntimeError(
        f"te_integration: GroupedLinear saved {len(tensors)} tensors for backward, in neither of TE 2.20's "
        f"layouts for {count} experts; the binding cannot tell where the workspaces are. Please report this "
        "to the te-workspace-manager project.")


def managed_restore_from_func_ctx(ctx, return_saved_tensors: bool = False):
    """TE's ``restore_from_func_ctx``, then the before phase of the call's
    :class:`BackwardWork`: TE's backward calls this first, before it reads
    any saved tensor."""
    out = te.restore_from_func_ctx(ctx, return_saved_tensors)
    work = getattr(ctx, "_te_wm_backward", None)
    if work is not None and work.before_te_backward is not None:  # nothing to do costs no call
        # ExpertRebuild edits TE's list in place, so with return_saved_tensors
        # the pair TE gets back holds the rebuilt list.
        work.before_te_backward(ctx, out[0] if return_saved_tensors else out)
    return out


def managed_prepare_weights(weights, weight_quantizers, weight_workspaces, **kwargs):
    """TE's ``_prepare_weights_for_grouped_tensor_gemm``, with a grouped
    weight's forward usage and cache arguments from the plan."""
    record = ACTIVE.record
    if (record is None or record.kind is not KIND or not record.weights
            or not kwargs.get("single_grouped_weight") or not kwargs.get("with_quantized_compute")):
        return _TE_PREPARE_WEIGHTS(weights, weight_quantizers, weight_workspaces, **kwargs)
    levers = record.weights[1]
    kwargs["columnwise_usage"] = levers.forward_columnwise
    # TE's own cache logic: a given entry is refreshed only on a first
    # microbatch, a new one is returned to be stored when cache_weight is set.
    action = levers.cache
    if action is CacheAction.BYPASS:
        weight_workspaces, kwargs["cache_weight"] = [None], False
    elif action is CacheAction.FILL:  # quantized afresh into a new entry, whatever the call's position
        weight_workspaces, kwargs["cache_weight"] = [None], True
    elif action is CacheAction.READ_ONLY:  # an entry read as it is; a miss not stored
        kwargs["cache_weight"], kwargs["is_first_microbatch"] = False, False
    grouped, new_workspaces = _TE_PREPARE_WEIGHTS(weights, weight_quantizers, weight_workspaces, **kwargs)
    fresh = grouped is not weights[0] and grouped is not (weight_workspaces[0] if weight_workspaces else None)
    if levers.saves_columnwise_only and fresh:  # D11, as the quantize_weight seam does for discrete weights
        parts = rowwise_parts(grouped)
        if parts:
            record.rowwise_parts = parts if record.rowwise_parts is None else record.rowwise_parts + parts
    return grouped, new_workspaces


_TE_PREPARE_WEIGHTS = te.GroupedFunction._prepare_weights_for_grouped_tensor_gemm


class GroupedLinear(ManagedModule, te.TEGroupedLinear):
    """``te.GroupedLinear`` whose experts' workspaces follow a :class:`WorkspacePolicy`
    (one plan for all experts, per call; either parameter layout)."""

    _wm_kind = KIND


ADAPTER = Adapter(
    kind=KIND, te_class=te.TEGroupedLinear, drop_in=GroupedLinear, order=40,
    construction=((te.tep, "GroupedLinear"), (te.te_module_package, "GroupedLinear")),
    explain_note="one plan for all experts", part=ExpertCall,
    function=FunctionSeam(
        function=te.GroupedFunction, name="_GroupedLinear", method="forward", file=te.grouped_module, begin=_begin,
        edit_ctx=_edit_ctx,
        module_globals=(("prepare_for_saving", te.prepare_for_saving, managed_prepare_for_saving),
                        ("restore_from_func_ctx", te.restore_from_func_ctx, managed_restore_from_func_ctx)),
        overrides=(("_prepare_weights_for_grouped_tensor_gemm", managed_prepare_weights),)),
)
register(ADAPTER)
