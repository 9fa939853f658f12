"""Sharded quantized parameters keep only what their all-gather needs.

Under FSDP2 a parameter built by ``quantized_model_init`` is a shard that no
GEMM reads: only its all-gather does. For formats that can derive columnwise
data (per-tensor FP8, 2D block FP8, 2D NVFP4), TE's hooks gather rowwise data
alone and derive columnwise data after the gather, so the shard's columnwise
copy (an FP8 transpose, or columnwise blocks) is one byte per parameter of
memory and of optimizer writes that nothing reads. The policy's plan says
what the shard keeps (``WorkspacePlan.parameter_keeps``); this module applies
it after ``reset_parameters``, after loading a state dict, and after every
optimizer step that writes them (optimizers rewrite the parameters).
"""

from __future__ import annotations

from typing import Any

from workspace_manager import plan_call, Usage, WeightSource, WorkspaceContext
from workspace_manager.extending import quantizer_capabilities

from ..te import _compat as te
from ._model import written_drop_ins
from ._state import state_of
from ._step_hook import Step, step_task


def trim_sharded_parameters(module: Any, *, only_regrown: bool = False) -> int:
    """Drop what the policy says the module's sharded quantized parameters
    need not keep. Returns how many parameters were trimmed. With
    ``only_regrown``, a shard is touched only if its columnwise data
    reappeared (the check at every optimizer step)."""
    state = state_of(module)
    if not state.sharding(module).is_fsdp2:
        return 0
    trimmed = 0
    for param in module.parameters(recurse=False):
        local = getattr(param, "_local_tensor", None)  # the shard of a DTensor parameter
        if not isinstance(local, te.QuantizedTensorStorage):
            continue
        state.holds_quantized = True  # checked again at each step that writes it
        if only_regrown and not _has_columnwise(local):
            continue
        keeps = parameter_plan(module, local._quantizer).parameter_keeps
        if Usage.COLUMNWISE in keeps:
            continue
        # The shard's own quantizer decides what later quantizations of it
        # (optimizer steps, checkpoint loads) write, and, with
        # reshard_after_forward=False, what the forward gather derives.
        local._quantizer.set_usage(rowwise=True, columnwise=False)
        local.update_usage(rowwise_usage=True, columnwise_usage=False)
        trimmed += 1
    return trimmed


def _has_columnwise(local: Any) -> bool:
    try:
        return bool(local.get_usages().get("columnwise", True))
    except (AttributeError, NotImplementedError):
        return True  # cannot tell: trim as before


def parameter_plan(module: Any, quantizer: Any) -> Any:
    """The drop-in ``module``'s plan for a training call on a quantized
    parameter made by ``quantizer`` (what its shards keep, what is released)."""
    state = state_of(module)
    ctx = WorkspaceContext(capabilities=quantizer_capabilities(quantizer), sharding=state.sharding(module),
                           weight=WeightSource.QUANTIZED_PARAM)
    return plan_call(ctx, state.policy)


@step_task("shard_trim")
def _retrim_written(step: Step) -> None:
    for _, written in written_drop_ins(step):
        for module in written:
            if module._wm_state.holds_quantized:
                trim_sharded_parameters(module, only_regrown=True)
