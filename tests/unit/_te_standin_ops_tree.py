"""The stand-in TE on disk (``_te_standin_tree``) with TE 2.20's ``te.ops``
pieces that ``_compat_ops.SEAMS`` names, each defined at the start of a
line (so ``remove`` can take one away) and holding the code lines
``_compat_ops`` looks for, for the import checks of the te.ops layer."""

from __future__ import annotations

import textwrap
from pathlib import Path

from _te_standin_tree import write_te_tree


def _lines(*needles: str) -> str:
    """A function body whose source holds ``needles`` (in its docstring)."""
    return '"""' + " | ".join(needles) + '"""'


_BASIC_LINEAR = f'''
general_gemm = None
class BasicLinear:
    @staticmethod
    def _functional_forward(*args, **kwargs):
        {_lines("columnwise=input_requires_grad and backward_override is None", "if input_requires_grad:",
                "w = None", "return y, x_local, w")}
    @staticmethod
    def _functional_backward(*args, **kwargs):
        {_lines("weight_quantizer.set_usage(columnwise=True)", "w = weight_quantizer(w)",
                "w = maybe_dequantize(w, dtype)")}
    def op_forward(self, *args):
        {_lines("BasicLinear._functional_forward(", "saved_weight = w", "ctx.weight_quantizer = weight_quantizer")}
    def op_backward(self, *args):
        {_lines("weight_quantizer=ctx.weight_quantizer")}
    def pre_fuser_forward(self, *, requires_grad):
        return None
'''

_GROUPED = f'''
general_grouped_gemm = None
class GroupedLinear:
    def fuser_forward(self, *args, **kwargs):
        {_lines("input_requires_grad=input_requires_grad,", "weight_quantizers=weight_quantizers,")}
    def _fuser_forward_split_quantize(self, **kwargs):
        {_lines("ws = self._get_discrete_weights_for_gemm(", "columnwise_usage=input_requires_grad",
                "if not input_requires_grad or self._is_distributed_weight():", "saved.extend(ws)",
                "return out, tuple(saved)")}
    def _get_discrete_weights_for_gemm(self, *args, **kwargs):
        {_lines("quantizer.set_usage(rowwise=True, columnwise=columnwise_usage)", "w = quantizer(w)")}
    def _fuser_forward_grouped_tensor(self, **kwargs):
        {_lines("columnwise_usage=input_requires_grad", "if not input_requires_grad or self._is_distributed_weight():",
                "saved.extend(grouped_weights)", "return out, tuple(saved)")}
    def fuser_backward(self, *args, **kwargs):
        return None
    def _fuser_backward_split_quantize(self, **kwargs):
        {_lines("ws, saved_tensors = saved_tensors[:num_groups], saved_tensors[num_groups:]",
                "saved_tensors = ctx.saved_tensors")}
    def _fuser_backward_grouped_tensor(self, **kwargs):
        {_lines("ws, saved_tensors = saved_tensors[:num_groups], saved_tensors[num_groups:]",
                "saved_tensors = ctx.saved_tensors")}
    def _is_distributed_weight(self):
        return False
    def fuser_forward_save_ctx(self, **kwargs):
        {_lines("ctx.weight_quantizers = weight_quantizers", "ctx.input_requires_grad = requires_grad[0]")}
'''

_FUSER = f'''
class _OperationFuserAutogradFunction:
    @staticmethod
    def forward(func_ctx, *args):
        {_lines("func_ctx.basic_op_ctxs = basic_op_ctxs", "op.fuser_forward(")}
    @staticmethod
    def backward(func_ctx, *grads):
        return None
class OperationFuser:
    def __call__(self, *args):
        {_lines("_OperationFuserAutogradFunction.apply(", "_OperationFuserAutogradFunction.forward(None",
                "op.pre_fuser_forward(requires_grad=")}
'''

_FUSED = "".join(f'''
class {name}:
    def fuser_forward(self, *args):
        {_lines("BasicLinear._functional_forward(", "saved_weight = w", "linear_op_ctx.weight_quantizer = weight_quantizer")}
''' for name in ("ForwardLinearBiasActivation", "ForwardLinearBiasAdd", "ForwardLinearScaleAdd"))

FILES = {
    "pytorch/ops/__init__.py": """
        from .basic import basic_linear as _bl, grouped_linear as _gl
        from . import linear as _linear
        BasicLinear = _bl.BasicLinear
        GroupedLinear = _gl.GroupedLinear
        Linear = getattr(_linear, "Linear", None)
        class Sequential:
            pass
    """,
    "pytorch/ops/basic/__init__.py": "",
    "pytorch/ops/basic/basic_linear.py": _BASIC_LINEAR,
    "pytorch/ops/basic/grouped_linear.py": _GROUPED,
    "pytorch/ops/linear.py": """
        from .basic import basic_linear as _bl
        BasicLinear = _bl.BasicLinear
        class Linear:
            pass
    """,
    "pytorch/ops/fuser.py": _FUSER,
    "pytorch/ops/fused/__init__.py": _FUSED,
}


def write_te_ops_tree(root: Path) -> Path:
    """The stand-in TE with its te.ops pieces, under ``root``; returns ``root``."""
    write_te_tree(root)
    for rel, source in FILES.items():
        path = root / "transformer_engine" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source).lstrip("\n"))
    return root
