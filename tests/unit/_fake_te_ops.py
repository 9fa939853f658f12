"""A CPU stand-in for TE 2.20's ``te.ops`` (BasicLinear, Bias, a fused linear
+ bias forward, the fuser and its autograd Function, Sequential,
``te.ops.Linear``; GroupedLinear in ``_fake_te_ops_grouped``), in the shape
the ops seams rely on, not TE's numerics. As in ``ops/basic/basic_linear.py``:
``_functional_forward`` (called through the class by ``op_forward`` and the
fused op) quantizes a high-precision weight with columnwise usage iff
``input_requires_grad and backward_override is None`` and returns it for
saving with its columnwise data only (None without ``input_requires_grad``);
the callers save it and put the quantizer on the op's context;
``_functional_backward`` quantizes a high-precision weight again after
``set_usage(columnwise=True)``, or dequantizes under an override. As in
``ops/fuser.py``: ``OperationFuser.__call__`` calls each op's
``pre_fuser_forward``, then the fuser file's ``_OperationFuserAutogradFunction``
by name, whose forward leaves ``func_ctx.basic_op_ctxs``.
"""

from __future__ import annotations

import types
from typing import Any

import torch

import _fake_te as fake
from _fake_te import Float8CurrentScalingQuantizer, QuantizedTensorStorage, Workspace

#: The usages of each workspace rebuilt in backward, as built; of each forward quantization.
REBUILT: list = []
FORWARD: list = []
#: Under backward_override="dequantized": what dgrad dequantized (usages), or "high precision".
DEQUANTIZED: list = []


class OperationContext:
    to_save, saved_tensors = None, ()

    def save_for_backward(self, *tensors) -> None:
        self.to_save = tensors


class BasicOperation(torch.nn.Module):
    is_fused_op = False

    def pre_fuser_forward(self, *, requires_grad: bool) -> None:
        self.prepared = requires_grad

    def params(self) -> list:
        return list(self.parameters(recurse=False))


def _functional_forward(input, weight, *, bias=None, with_quantized_compute=False, backward_override=None,
                        weight_quantizer=None, input_requires_grad=True, weight_requires_grad=True, **unused):
    w = weight
    if with_quantized_compute and not isinstance(w, QuantizedTensorStorage):
        weight_quantizer.set_usage(rowwise=True, columnwise=input_requires_grad and backward_override is None)
        w = weight_quantizer(w)
        FORWARD.append(w.get_usages())
    y = _OPS_FILES["basic_linear"].gemm_calls(w, input)
    if bias is not None:
        y = y + bias
    if input_requires_grad:
        if w is not weight and with_quantized_compute and backward_override is None:
            w.update_usage(rowwise_usage=False, columnwise_usage=True)
    else:
        w = None
    return y, input, w


def _functional_backward(grad_output, input, weight, *, with_quantized_compute, weight_quantizer,
                         input_requires_grad, weight_requires_grad, **unused):
    dx = dw = None
    if input_requires_grad:
        w = weight
        if with_quantized_compute:
            if isinstance(w, QuantizedTensorStorage):
                w.update_usage(columnwise_usage=True)
            else:
                weight_quantizer.set_usage(columnwise=True)
                w = weight_quantizer(w)
                REBUILT.append(w.get_usages())
            dx = fake.general_gemm(w, grad_output, layout="NN")
        else:
            DEQUANTIZED.append(w.get_usages() if isinstance(w, QuantizedTensorStorage) else "high precision")
            dx = grad_output @ (w.dequantize() if isinstance(w, QuantizedTensorStorage) else w)
    if weight_requires_grad:
        dw = grad_output.t() @ input
    return dx, dw


class BasicLinear(BasicOperation):
    def __init__(self, in_features: int, out_features: int, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.weight = torch.nn.Parameter(torch.randn(out_features, in_features, generator=gen))
        self.quantizer = Float8CurrentScalingQuantizer()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.resets = getattr(self, "resets", 0) + 1

    def get_quantizer(self, mode: str, index: int):
        return self.quantizer

    _functional_forward = staticmethod(_functional_forward)
    _functional_backward = staticmethod(_functional_backward)

    def op_forward(self, ctx, input_, *, override=None):
        fp8 = _STATE["fp8"]
        output, x_local, w = BasicLinear._functional_forward(
            input=input_, weight=self.weight, with_quantized_compute=fp8, backward_override=override,
            weight_quantizer=self.quantizer, input_requires_grad=ctx.requires_grad,
            weight_requires_grad=ctx.requires_grad and self.weight.requires_grad)
        _save(ctx, self, x_local, w, fp8, override)
        return output

    def op_backward(self, ctx, grad_output):
        x_local, w = ctx.saved_tensors
        return BasicLinear._functional_backward(
            grad_output=grad_output, input=x_local, weight=w, with_quantized_compute=ctx.with_quantized_compute,
            weight_quantizer=ctx.weight_quantizer, input_requires_grad=ctx.input_requires_grad,
            weight_requires_grad=ctx.weight_requires_grad)


def _save(ctx, op, x_local, w, fp8, override) -> None:
    if ctx.requires_grad:
        saved_weight = op.weight if override == "high_precision" else w
        ctx.save_for_backward(x_local, saved_weight)
        ctx.with_quantized_compute = fp8 and override is None
        ctx.weight_quantizer = op.quantizer
        ctx.input_requires_grad = ctx.requires_grad
        ctx.weight_requires_grad = ctx.requires_grad and op.weight.requires_grad


class Bias(BasicOperation):
    def __init__(self, features: int) -> None:
        super().__init__()
        self.bias = torch.nn.Parameter(torch.linspace(-1, 1, features))

    def op_forward(self, ctx, input_, **unused):
        return input_ + self.bias

    def op_backward(self, ctx, grad_output):
        return grad_output, grad_output.sum(0)


class ForwardLinearBias:
    """The fused linear + bias forward: TE's ``ForwardLinearBiasActivation`` shape."""

    def __init__(self, linear: BasicLinear, bias: Bias) -> None:
        self.linear, self.bias = linear, bias

    def fuser_forward(self, ctxs, x, override=None):
        linear_op, linear_op_ctx = self.linear, ctxs[0]
        fp8 = _STATE["fp8"]
        output, x_local, w = BasicLinear._functional_forward(
            input=x, weight=linear_op.weight, bias=self.bias.bias, with_quantized_compute=fp8,
            backward_override=override, weight_quantizer=linear_op.get_quantizer("forward", 1),
            input_requires_grad=linear_op_ctx.requires_grad,
            weight_requires_grad=linear_op_ctx.requires_grad and linear_op.weight.requires_grad)
        _save(linear_op_ctx, linear_op, x_local, w, fp8, override)
        ctxs[1].requires_grad = linear_op_ctx.requires_grad
        return output


#: Global switches of the stand-in: FP8 on (TE's autocast), fusion on.
_STATE = {"fp8": True, "fuse": True, "override": None}


class OperationFuser:
    def __init__(self, ops: list) -> None:
        basic = []
        for op in ops:
            basic.extend(op.basic_ops if getattr(op, "is_fused_op", False) else [op])
        self._basic_ops = basic

    def _forward_ops(self) -> list:
        """``(op, indices)``: BasicLinear + Bias fused when fusion is on."""
        out, i, ops = [], 0, self._basic_ops
        while i < len(ops):
            if (_STATE["fuse"] and isinstance(ops[i], BasicLinear) and i + 1 < len(ops)
                    and isinstance(ops[i + 1], Bias)):
                out.append((ForwardLinearBias(ops[i], ops[i + 1]), (i, i + 1)))
                i += 2
            else:
                out.append((ops[i], (i,)))
                i += 1
        return out

    def __call__(self, input):
        for op in self._basic_ops:
            op.pre_fuser_forward(requires_grad=True)
        params = [p for op in self._basic_ops for p in op.params()]
        args = (input, self, [{}] * len(self._basic_ops), torch.is_grad_enabled(), *params)
        function = _OPS_FILES["fuser"]._OperationFuserAutogradFunction
        if not torch.is_grad_enabled():
            return function.forward(None, *args)
        return function.apply(*args)


class _OperationFuserAutogradFunction(torch.autograd.Function):
    @staticmethod
    def forward(func_ctx, input_, fuser, basic_op_kwargs, set_output_requires_grad, *params):
        basic_op_ctxs = [OperationContext() for _ in fuser._basic_ops]
        x, override = input_, _STATE["override"]
        for op, indices in fuser._forward_ops():
            for i in indices:
                basic_op_ctxs[i].requires_grad = set_output_requires_grad
            if isinstance(op, ForwardLinearBias):
                x = op.fuser_forward([basic_op_ctxs[i] for i in indices], x, override)
            else:
                x = op.op_forward(basic_op_ctxs[indices[0]], x, override=override)
        if func_ctx is not None:
            to_save = []
            for ctx in basic_op_ctxs:
                start = len(to_save)
                to_save.extend(ctx.to_save or ())
                ctx.to_save, ctx._range = None, (start, len(to_save))
            tensors, objects = fake.prepare_for_saving(*to_save)
            func_ctx.save_for_backward(*tensors)
            func_ctx.tensor_objects = objects
            func_ctx.basic_op_ctxs, func_ctx.basic_ops = basic_op_ctxs, fuser._basic_ops
        return x

    @staticmethod
    def backward(func_ctx, grad_output):
        saved = fake.restore_from_saved(func_ctx.tensor_objects, list(func_ctx.saved_tensors))
        func_ctx.tensor_objects = None  # as TE's restore_from_func_ctx
        grads_by_op = []
        dy = grad_output
        for op, ctx in reversed(list(zip(func_ctx.basic_ops, func_ctx.basic_op_ctxs))):
            ctx.saved_tensors = saved[slice(*ctx._range)]
            dy, grads = op.op_backward(ctx, dy)
            ctx.saved_tensors = None  # as TE's fuser after each op's backward
            grads_by_op.append(list(grads) if isinstance(grads, list) else [grads])
        param_grads = [g for grads in reversed(grads_by_op) for g in grads]
        return (dy, None, None, None, *param_grads)


class FusedOperation(torch.nn.Module):
    is_fused_op = True

    def __init__(self, basic_ops) -> None:
        super().__init__()
        self.basic_ops = torch.nn.ModuleList(basic_ops)

    def forward(self, x):
        return OperationFuser([self])(x)


class Linear(FusedOperation):
    """``te.ops.Linear``: builds its BasicLinear through its file's global name."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, seed: int = 0) -> None:
        ops = [_OPS_FILES["linear"].BasicLinear(in_features, out_features, seed=seed)]
        if bias:
            ops.append(Bias(out_features))
        super().__init__(ops)


class Sequential(torch.nn.Module):
    def __init__(self, *ops) -> None:
        super().__init__()
        self.ops = torch.nn.ModuleList(ops)

    def forward(self, x):
        return OperationFuser(list(self.ops))(x)


BasicOperation.forward = lambda self, x: OperationFuser([self])(x)  # an op alone: a fuser of one


_OPS_FILES: dict[str, types.ModuleType] = {}
_home = fake._te_named  # give a stand-in the home TE gives the real one (the install check reads it)


def compat_ops() -> dict[str, Any]:
    """The stand-in ``_compat_ops``: what the binding reads from ``te.ops``."""
    fuser = types.ModuleType("fake_te.ops.fuser")
    fuser._OperationFuserAutogradFunction = _home(_OperationFuserAutogradFunction, "fake_te.ops.fuser",
                                                  "_OperationFuserAutogradFunction")
    basic = types.ModuleType("fake_te.ops.basic_linear")
    basic.gemm_calls = lambda w, x: fake.general_gemm(w, x, layout="TN")
    _home(BasicLinear, "fake_te.ops.basic_linear", "BasicLinear")
    BasicLinear._functional_forward = staticmethod(_functional_forward)  # as TE's, whatever a test installed
    BasicLinear._functional_backward = staticmethod(_functional_backward)
    _home(_functional_backward, "fake_te.ops.basic_linear", "BasicLinear._functional_backward")
    _home(_functional_forward, "fake_te.ops.basic_linear", "BasicLinear._functional_forward")
    linear = types.ModuleType("fake_te.ops.linear")
    linear.BasicLinear = BasicLinear
    package = types.ModuleType("fake_te.ops")
    package.BasicLinear, package.Linear, package.Sequential = BasicLinear, Linear, Sequential
    from _fake_te_ops_grouped import GroupedLinear  # it imports this module

    package.GroupedLinear = GroupedLinear
    _OPS_FILES.update(fuser=fuser, basic_linear=basic, linear=linear, package=package)
    return {"ops_package": package, "fuser_module": fuser, "ops_linear_module": linear, "BasicLinear": BasicLinear,
            "OpsLinear": Linear, "Sequential": Sequential, "FuserFunction": _OperationFuserAutogradFunction,
            "GroupedLinear": GroupedLinear}
