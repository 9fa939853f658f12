"""A CPU stand-in for TE 2.20's ``te.ops.GroupedLinear`` basic op (see ``_fake_te_ops``).

Discrete weights, equal splits. Its two forward paths take
``input_requires_grad``, which decides the weights' columnwise usage and
whether they are saved (the last of the saved tensors; the split-quantize
path keeps their columnwise data only, the grouped-tensor path both, as
TE's); ``fuser_backward`` reads them from the context's ``saved_tensors``.
"""

from __future__ import annotations

import torch

import _fake_te as fake
from _fake_te import Float8CurrentScalingQuantizer
from _fake_te_ops import _STATE, FORWARD, BasicOperation


class GroupedLinear(BasicOperation):
    """``te.ops.GroupedLinear``, in the shape described above."""

    single_grouped_weight = False

    def __init__(self, num_groups: int, in_features: int, out_features: int, seed: int = 0) -> None:
        super().__init__()
        self.num_groups = num_groups
        gen = torch.Generator().manual_seed(seed)
        for i in range(num_groups):
            setattr(self, f"weight{i}", torch.nn.Parameter(torch.randn(out_features, in_features, generator=gen)))
        self.quantizers = [Float8CurrentScalingQuantizer() for _ in range(num_groups)]
        self.grouped_tensor_path = False

    def _is_distributed_weight(self) -> bool:
        return False

    def _path(self, *, input_, weight_quantizers, with_quantized_compute, input_requires_grad, weight_requires_grad):
        weights = [getattr(self, f"weight{i}") for i in range(self.num_groups)]
        ws = self._get_discrete_weights_for_gemm(weights, weight_quantizers, columnwise_usage=input_requires_grad,
                                                 with_quantized_compute=with_quantized_compute, dtype=torch.float32)
        if with_quantized_compute:
            FORWARD.extend(w.get_usages() for w in ws)
        xs = list(torch.chunk(input_, self.num_groups))
        out = torch.cat([fake.general_gemm(w, x, layout="TN") for w, x in zip(ws, xs)])
        if not input_requires_grad:
            ws = [None] * self.num_groups
        elif with_quantized_compute and not self.grouped_tensor_path:  # the grouped-tensor path saves both
            for w in ws:
                w.update_usage(rowwise_usage=False, columnwise_usage=True)
        return out, tuple([None] * 5 + xs + ws)

    def _get_discrete_weights_for_gemm(self, weight_params, weight_quantizers, columnwise_usage,
                                       with_quantized_compute, dtype):
        out = []
        for w, q in zip(weight_params, weight_quantizers):
            if with_quantized_compute:
                q.set_usage(rowwise=True, columnwise=columnwise_usage)
                w = q(w)
            out.append(w)
        return out

    def _fuser_forward_split_quantize(self, **kwargs):
        return self._path(**kwargs)

    def _fuser_forward_grouped_tensor(self, **kwargs):
        return self._path(**kwargs)

    def fuser_forward(self, basic_op_ctxs, input_, **unused):
        ctx, fp8 = basic_op_ctxs[0], _STATE["fp8"]
        path = self._fuser_forward_grouped_tensor if self.grouped_tensor_path else self._fuser_forward_split_quantize
        out, saved = path(input_=input_, weight_quantizers=self.quantizers, with_quantized_compute=fp8,
                          input_requires_grad=ctx.requires_grad, weight_requires_grad=ctx.requires_grad)
        ctx.save_for_backward(*saved)
        ctx.weight_quantizers, ctx.with_quantized_compute = self.quantizers, fp8
        ctx.input_requires_grad = ctx.requires_grad
        return out, [()]

    def fuser_backward(self, basic_op_ctxs, grad_output, **unused):
        ctx, n = basic_op_ctxs[0], self.num_groups
        saved = ctx.saved_tensors
        xs, ws = saved[5:5 + n], saved[5 + n:]
        dys = torch.chunk(grad_output, n)
        dx = torch.cat([fake.general_gemm(w, dy, layout="NN") if ctx.with_quantized_compute else dy @ w
                        for w, dy in zip(ws, dys)])
        return dx, [[dy.t() @ x for dy, x in zip(dys, xs)]], [()]

    def op_forward(self, ctx, input_, **unused):
        return self.fuser_forward([ctx], input_)[0]

    def op_backward(self, ctx, grad_output):
        dx, grads, _ = self.fuser_backward([ctx], grad_output, basic_op_grad_extra_outputs=[()])
        return dx, grads[0]
