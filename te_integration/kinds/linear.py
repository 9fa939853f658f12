"""The module kinds the binding carries plans out for, one adapter each.

An adapter (:class:`~te_integration._functions.ModuleAdapter`) says where a
kind's weights, quantizers and flags sit in the arguments TE's autograd
Function gets, how TE's switch for saving the workspace is set there, and
which ctx fields TE's backward reads. ``begin`` gates (a call TE handles
itself passes through) and plans each weight; ``edit_ctx`` sets backward's
levers. Both run on every call, so they spell their reads inline.

``Linear`` and ``LayerNormLinear`` are here; ``LayerNormMLP``, whose two
weights can be planned to save differently and whose own checkpoint
recomputes inside backward, is in ``_adapter_mlp``; ``GroupedLinear``,
whose experts share one plan and whose backward has no rebuild of its own,
in ``_adapter_grouped``.
"""

from __future__ import annotations

from workspace_manager import RecomputePass, RecomputeScope, Sharding

from . import _compat as te
from ._adapter_grouped import GROUPED_LINEAR
from ._adapter_mlp import LAYERNORM_MLP
from ._call import ACTIVE, GATHERED_WEIGHT, is_distributed, recompute_pass
from ._functions import ModuleAdapter
from ._release import backward_work
from ._state import ModuleKind

__all__ = ["ADAPTERS", "adapter_for"]

_LINEAR, _LNL = ModuleKind.LINEAR, ModuleKind.LAYERNORM_LINEAR
_NO_RECOMPUTE, _REGION, _DISTRIBUTED = RecomputePass.NONE, RecomputeScope.REGION, Sharding.DISTRIBUTED_WEIGHT


# -- Linear: TE's _Linear.forward(ctx, weight, inp, bias, fwd_args) ------------------
def _begin_linear(ctx, args: tuple):
    record = ACTIVE.record
    fwd_args = args[3]
    if (record is None or record.kind is not _LINEAR or not fwd_args.fp8 or fwd_args.debug
            or fwd_args.fsdp_group is not None or fwd_args.skip_fp8_weight_update is not None
            or fwd_args.cpu_offloading or te.graph_flags._IS_GRAPH_CAPTURING):
        return None
    weight = args[0]
    distributed = getattr(weight, "is_distributed_weight", False) and is_distributed(weight)
    levers = record.state.levers(
        record.module, _DISTRIBUTED if distributed else record.sharding, key="weight", weight=weight,
        quantizer=fwd_args.weight_quantizer, grad=fwd_args.is_grad_enabled,
        input_requires_grad=fwd_args.input_requires_grad, is_first_microbatch=fwd_args.is_first_microbatch,
        backward_override=fwd_args.backward_override,
        recompute=recompute_pass() if te.recompute_flags._IN_ACTIVATION_RECOMPUTE_REGION else _NO_RECOMPUTE,
        scope=_REGION,
    )
    fwd_args.is_fsdp2 = levers.saves_no_workspace  # TE's switch: save no workspace for backward
    record.weights = (GATHERED_WEIGHT if distributed else weight, levers)
    return record, args


def _edit_linear_ctx(ctx, record, args: tuple) -> None:
    levers = record.weights[1]
    bwd = ctx.backward_objects
    bwd.is_fsdp2 = levers.clears_in_backward
    if levers.dgrad_reads_high_precision or levers.rebuild_usage is not None:
        bwd.weight_quantizer = record.state.backward_quantizer(levers, bwd.weight_quantizer)
    ctx._te_wm_backward = backward_work(record.module, (args[0], levers)) if levers.releases else None


# -- LayerNormLinear: TE's _LayerNormLinear.forward(ctx, inp, ln_weight, ln_bias,
#    weight, weight_workspace, bias, non_tensor_args) --------------------------------
_LNL_ARGS = te.LNL_ARGS
_LNL_GATE = tuple(_LNL_ARGS.get(name, -1) for name in ("fp8", "debug", "fsdp_group", "skip_fp8_weight_update",
                                                        "cpu_offloading", "is_fsdp2"))


def _begin_layernorm_linear(ctx, args: tuple):
    record = ACTIVE.record
    nta, (fp8, debug, group, skip, offload, switch) = args[6], _LNL_GATE
    if (record is None or record.kind is not _LNL or not nta[fp8] or nta[debug] or nta[group] is not None
            or nta[skip] is not None or nta[offload] or te.graph_flags._IS_GRAPH_CAPTURING):
        return None
    weight, a = args[3], _LNL_ARGS
    distributed = getattr(weight, "is_distributed_weight", False) and is_distributed(weight)
    recipe = te.FP8GlobalStateManager.get_fp8_recipe()
    levers = record.state.levers(
        record.module, _DISTRIBUTED if distributed else record.sharding, key="weight", weight=weight,
        quantizer=nta[a["weight_quantizer"]], grad=nta[a["is_grad_enabled"]], input_requires_grad=True,
        is_first_microbatch=nta[a["is_first_microbatch"]],
        backward_override=getattr(recipe, "backward_override", None),
        recompute=recompute_pass() if te.recompute_flags._IN_ACTIVATION_RECOMPUTE_REGION else _NO_RECOMPUTE,
        scope=_REGION,
    )
    record.weights = (GATHERED_WEIGHT if distributed else weight, levers)
    nta = nta[:switch] + (levers.saves_no_workspace,) + nta[switch + 1:]  # TE's switch: save no workspace
    return record, args[:6] + (nta,)


def _edit_layernorm_linear_ctx(ctx, record, args: tuple) -> None:
    levers = record.weights[1]
    ctx.is_fsdp2 = levers.clears_in_backward
    if levers.dgrad_reads_high_precision or levers.rebuild_usage is not None:
        ctx.weight_quantizer = record.state.backward_quantizer(levers, ctx.weight_quantizer)
    ctx._te_wm_backward = backward_work(record.module, (args[3], levers)) if levers.releases else None


LINEAR = ModuleAdapter(
    kind=_LINEAR, te_class=te.TELinear, function=te.LinearFunction, function_name="_Linear", method="forward",
    file=te.linear_module, weight_keys=("weight",), begin=_begin_linear, edit_ctx=_edit_linear_ctx,
    construction=((te.mha_module, "Linear"),),
)
LAYERNORM_LINEAR = ModuleAdapter(
    kind=_LNL, te_class=te.TELayerNormLinear, function=te.LNLFunction, function_name="_LayerNormLinear",
    method="forward", file=te.lnl_module, weight_keys=("weight",), begin=_begin_layernorm_linear, edit_ctx=_edit_layernorm_linear_ctx,
    construction=((te.mha_module, "LayerNormLinear"),),
)

#: Every module kind, in the order the drop-ins are listed.
ADAPTERS: tuple[ModuleAdapter, ...] = (LINEAR, LAYERNORM_LINEAR, LAYERNORM_MLP, GROUPED_LINEAR)
_BY_KIND = {adapter.kind: adapter for adapter in ADAPTERS}


def adapter_for(kind: ModuleKind) -> ModuleAdapter:
    return _BY_KIND[kind]
