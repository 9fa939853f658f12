"""The version-checked layer for TE's fusible operations (``te.ops``).

Part of the one thin layer over TE (with ``_compat``, whose checks and
errors it uses): everything the binding takes from ``transformer_engine.pytorch.ops``
is imported here and checked at import, each missing piece or changed code
line refused with :class:`~te_integration.te._compat.UnsupportedTEError`
naming it and its TE file.

What the ops seams rely on (docs/te-integration.md, "te.ops"):

* ``OperationFuser.__call__`` runs every op through the fuser's autograd
  Function, looked up by name in ``ops/fuser.py`` at each call, and that
  Function's forward leaves the per-op contexts on its ctx
  (``func_ctx.basic_op_ctxs``), one per basic op in ``fuser._basic_ops`` order.
* ``BasicLinear.op_forward`` and the fused forwards call
  ``BasicLinear._functional_forward`` through the class, save the weight it
  returns as the op's saved weight, and put the weight quantizer on the op's
  context, where backward takes both from.
* In ``_functional_forward``, ``input_requires_grad`` decides only the
  weight's columnwise usage and whether the weight tensor is returned for
  saving; in ``_functional_backward`` a high-precision weight is quantized
  again with the context's weight quantizer.
"""

from __future__ import annotations

from ._compat import VERSION, Seam, UnsupportedTEError, _resolve, missing_seams_message
from ._te_source import structure_problems

__all__ = ["SEAMS", "GEMM_SITES", "BasicLinear", "GroupedLinear", "OpsLinear", "Sequential", "fuser_module", "FuserFunction",
           "ops_linear_module", "ops_package"]

_OPS = "transformer_engine.pytorch.ops"
_BL, _FUSER, _FUSED = f"{_OPS}.basic.basic_linear", f"{_OPS}.fuser", f"{_OPS}.fused"
_GL = f"{_OPS}.basic.grouped_linear"
_FUSED_FORWARDS = ("ForwardLinearBiasActivation", "ForwardLinearBiasAdd", "ForwardLinearScaleAdd")

#: Every piece of ``te.ops`` the binding relies on. Seamed (``_install``):
#: ``_OperationFuserAutogradFunction`` in ``ops/fuser.py``,
#: ``BasicLinear._functional_forward`` and ``BasicLinear._functional_backward``.
SEAMS: tuple[Seam, ...] = (
    Seam(_OPS, export="ops_package"), Seam(_FUSER, export="fuser_module"),
    Seam(f"{_OPS}.linear", export="ops_linear_module"),
    Seam(_OPS, "BasicLinear", "BasicLinear"), Seam(_OPS, "Linear", "OpsLinear"), Seam(_OPS, "Sequential", "Sequential"),
    Seam(f"{_OPS}.linear", "BasicLinear"),
    Seam(_BL, "BasicLinear._functional_forward"), Seam(_BL, "BasicLinear._functional_backward"),
    Seam(_BL, "BasicLinear.op_forward"), Seam(_BL, "BasicLinear.op_backward"),
    Seam(_BL, "BasicLinear.pre_fuser_forward"),
    Seam(_FUSER, "_OperationFuserAutogradFunction", "FuserFunction"),
    Seam(_FUSER, "_OperationFuserAutogradFunction.forward"), Seam(_FUSER, "_OperationFuserAutogradFunction.backward"),
    Seam(_FUSER, "OperationFuser.__call__"),
    Seam(_OPS, "GroupedLinear", "GroupedLinear"), Seam(_GL, "GroupedLinear.fuser_forward"),
    Seam(_GL, "GroupedLinear._fuser_forward_split_quantize"), Seam(_GL, "GroupedLinear._fuser_forward_grouped_tensor"),
    Seam(_GL, "GroupedLinear.fuser_backward"), Seam(_GL, "GroupedLinear._fuser_backward_split_quantize"),
    Seam(_GL, "GroupedLinear._fuser_backward_grouped_tensor"), Seam(_GL, "GroupedLinear._is_distributed_weight"),
    Seam(_GL, "GroupedLinear.fuser_forward_save_ctx"), Seam(_GL, "GroupedLinear._get_discrete_weights_for_gemm"),
    # The GEMMs the linear ops call (check_stale_reads watches them).
    Seam(_BL, export="basic_linear_module"), Seam(_BL, "general_gemm"),
    Seam(_GL, export="ops_grouped_module"), Seam(_GL, "general_grouped_gemm"),
) + tuple(Seam(_FUSED, f"{name}.fuser_forward", name) for name in _FUSED_FORWARDS)

_found = _resolve(SEAMS)
if "__call__" not in vars(_found["fuser_module"].OperationFuser):  # found on ``type`` otherwise
    raise UnsupportedTEError(missing_seams_message(VERSION, [(Seam(_FUSER, "OperationFuser.__call__"),
                                                               "no attribute '__call__'")]))
ops_package = _found["ops_package"]
fuser_module = _found["fuser_module"]
ops_linear_module = _found["ops_linear_module"]
BasicLinear = _found["BasicLinear"]
OpsLinear = _found["OpsLinear"]
Sequential = _found["Sequential"]
FuserFunction = _found["FuserFunction"]
GroupedLinear = _found["GroupedLinear"]
_fused = [_found[name] for name in _FUSED_FORWARDS]  # their fuser_forward functions
#: ``(module file, name)`` of the GEMM functions the linear ops call.
GEMM_SITES = ((_found["basic_linear_module"], "general_gemm"), (_found["ops_grouped_module"], "general_grouped_gemm"))
del _found

#: GroupedLinear's backward takes the weights from the end of the saved tensors.
_WEIGHTS_LAST = "ws, saved_tensors = saved_tensors[:num_groups], saved_tensors[num_groups:]"
#: Lines of TE's code the ops seams rely on.
_SENTINELS = {
    BasicLinear._functional_forward: ["columnwise=input_requires_grad and backward_override is None",
                                      "if input_requires_grad:", "w = None", "return y, x_local, w"],
    BasicLinear._functional_backward: ["weight_quantizer.set_usage(columnwise=True)", "w = weight_quantizer(w)",
                                       "w = maybe_dequantize(w, dtype)"],
    BasicLinear.op_forward: ["BasicLinear._functional_forward(", "saved_weight = w",
                             "ctx.weight_quantizer = weight_quantizer"],
    BasicLinear.op_backward: ["weight_quantizer=ctx.weight_quantizer"],
    FuserFunction.forward: ["func_ctx.basic_op_ctxs = basic_op_ctxs", "op.fuser_forward("],
    fuser_module.OperationFuser.__call__: ["_OperationFuserAutogradFunction.apply(",
                                           "_OperationFuserAutogradFunction.forward(None",
                                           "op.pre_fuser_forward(requires_grad="],
    GroupedLinear.fuser_forward: ["input_requires_grad=input_requires_grad,", "weight_quantizers=weight_quantizers,"],
    # The drop-in's _get_discrete_weights_for_gemm quantizes every group's weight at once.
    GroupedLinear._get_discrete_weights_for_gemm: ["quantizer.set_usage(rowwise=True, columnwise=columnwise_usage)",
                                                   "w = quantizer(w)"],
    GroupedLinear._fuser_forward_split_quantize: ["ws = self._get_discrete_weights_for_gemm(",
                                                  "columnwise_usage=input_requires_grad",
                                                  "if not input_requires_grad or self._is_distributed_weight():",
                                                  "saved.extend(ws)", "return out, tuple(saved)"],
    GroupedLinear._fuser_forward_grouped_tensor: ["columnwise_usage=input_requires_grad",
                                                  "if not input_requires_grad or self._is_distributed_weight():",
                                                  "saved.extend(grouped_weights)", "return out, tuple(saved)"],
    GroupedLinear._fuser_backward_split_quantize: [_WEIGHTS_LAST, "saved_tensors = ctx.saved_tensors"],
    GroupedLinear._fuser_backward_grouped_tensor: [_WEIGHTS_LAST, "saved_tensors = ctx.saved_tensors"],
    GroupedLinear.fuser_forward_save_ctx: ["ctx.weight_quantizers = weight_quantizers",
                                           "ctx.input_requires_grad = requires_grad[0]"],
    **{fused_forward: ["BasicLinear._functional_forward(", "saved_weight = w",
                           "linear_op_ctx.weight_quantizer = weight_quantizer"] for fused_forward in _fused},
}

_problems = structure_problems(_SENTINELS, (), ())
if _problems:
    raise UnsupportedTEError(
        f"TransformerEngine {VERSION}'s te.ops internals differ from what te_integration binds to: "
        + "; ".join(_problems)
        + ". Install a released TransformerEngine 2.20.x; if this already is one, please report this message to "
        "the te-workspace-manager project."
    )
