"""``LayerNormLinear``: TE's ``te.LayerNormLinear``, one weight behind TE's
``_LayerNormLinear`` Function.

TE's ``_LayerNormLinear.forward(ctx, inp, ln_weight, ln_bias, weight,
weight_workspace, bias, non_tensor_args)`` takes its switches in a tuple
(positions checked in ``te/_compat``: ``LNL_ARGS``); ``begin`` gates and
plans the weight, setting TE's ``is_fsdp2`` switch in a copy of the tuple;
``edit_ctx`` sets backward's levers on ``ctx``.
"""

from __future__ import annotations

from workspace_manager import RecomputePass, RecomputeScope, Sharding

from ..runtime._call import ACTIVE, GATHERED_WEIGHT, is_distributed, recompute_pass
from ..runtime._modules import ManagedModule
from ..runtime._kind_registry import Adapter, FunctionSeam, ModuleKind, register
from ..runtime._release import backward_work
from ..te import _compat as te

__all__ = ["LayerNormLinear"]

KIND = ModuleKind("layernorm_linear")
_NO_RECOMPUTE, _REGION, _DISTRIBUTED = RecomputePass.NONE, RecomputeScope.REGION, Sharding.DISTRIBUTED_WEIGHT
_ARGS = te.LNL_ARGS
_GATE = tuple(_ARGS.get(name, -1) for name in ("fp8", "debug", "fsdp_group", "skip_fp8_weight_update",
                                               "cpu_offloading", "is_fsdp2"))


def _begin(ctx, args: tuple):
    record = ACTIVE.record
    nta, (fp8, debug, group, skip, offload, switch) = args[6], _GATE
    if (record is None or record.kind is not KIND or not nta[fp8] or nta[debug] or nta[group] is not None
            or nta[skip] is not None or nta[offload] or te.graph_flags._IS_GRAPH_CAPTURING):
        return None
    weight, a = args[3], _ARGS
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


def _edit_ctx(ctx, record, args: tuple) -> None:
    levers = record.weights[1]
    ctx.is_fsdp2 = levers.clears_in_backward
    if levers.dgrad_reads_high_precision or levers.rebuild_usage is not None:
        ctx.weight_quantizer = record.state.backward_quantizer(levers, ctx.weight_quantizer)
    ctx._te_wm_backward = backward_work(record.module, (args[3], levers)) if levers.releases else None


class LayerNormLinear(ManagedModule, te.TELayerNormLinear):
    """``te.LayerNormLinear`` whose weight workspace follows a :class:`WorkspacePolicy`."""

    _wm_kind = KIND


ADAPTER = Adapter(
    kind=KIND, te_class=te.TELayerNormLinear, drop_in=LayerNormLinear, order=20,
    construction=((te.mha_module, "LayerNormLinear"),),
    function=FunctionSeam(function=te.LNLFunction, name="_LayerNormLinear", method="forward", file=te.lnl_module,
                          begin=_begin, edit_ctx=_edit_ctx),
)
register(ADAPTER)
