"""``Linear``: TE's ``te.Linear``, one weight behind TE's ``_Linear`` Function.

TE's ``_Linear.forward(ctx, weight, inp, bias, fwd_args)`` takes its
switches in an argument dataclass (``LinearFwdArgs``); ``begin`` gates (a
call TE handles itself passes through) and plans the weight, setting TE's
``is_fsdp2`` switch for saving the workspace; ``edit_ctx`` sets backward's
levers on ``ctx.backward_objects``. Both run on every call, so they spell
their reads inline.
"""

from __future__ import annotations

from workspace_manager import RecomputePass, RecomputeScope, Sharding

from ..runtime._call import ACTIVE, GATHERED_WEIGHT, is_distributed, recompute_pass
from ..runtime._modules import ManagedModule
from ..runtime._kind_registry import Adapter, FunctionSeam, ModuleKind, register
from ..runtime._release import backward_work
from ..te import _compat as te

__all__ = ["Linear"]

KIND = ModuleKind("linear")
_NO_RECOMPUTE, _REGION, _DISTRIBUTED = RecomputePass.NONE, RecomputeScope.REGION, Sharding.DISTRIBUTED_WEIGHT


def _begin(ctx, args: tuple):
    record = ACTIVE.record
    fwd_args = args[3]
    if (record is None or record.kind is not KIND or not fwd_args.fp8 or fwd_args.debug
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


def _edit_ctx(ctx, record, args: tuple) -> None:
    levers = record.weights[1]
    bwd = ctx.backward_objects
    bwd.is_fsdp2 = levers.clears_in_backward
    if levers.dgrad_reads_high_precision or levers.rebuild_usage is not None:
        bwd.weight_quantizer = record.state.backward_quantizer(levers, bwd.weight_quantizer)
    ctx._te_wm_backward = backward_work(record.module, (args[0], levers)) if levers.releases else None


class Linear(ManagedModule, te.TELinear):
    """``te.Linear`` whose weight workspace follows a :class:`WorkspacePolicy`.
    Same constructor, defaults, state_dict and numerics as ``te.Linear``."""

    _wm_kind = KIND


ADAPTER = Adapter(
    kind=KIND, te_class=te.TELinear, drop_in=Linear, order=10,
    construction=((te.mha_module, "Linear"),),
    function=FunctionSeam(function=te.LinearFunction, name="_Linear", method="forward", file=te.linear_module,
                          begin=_begin, edit_ctx=_edit_ctx),
)
register(ADAPTER)
