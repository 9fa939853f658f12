"""A CPU stand-in for TE 2.20's LayerNormMLP, in the shape the seams rely on.

It follows ``module/layernorm_mlp.py`` where the weights' workspaces are
concerned, with the rest cut away (no norm, identity activation, no bias):

* ``_forward`` sets each weight quantizer's usages (columnwise unless
  ``fsdp2_skip_columnwise = is_fsdp2 and not is_recomputation``), quantizes
  both weights through the file's global ``quantize_weight``, runs the fprop
  GEMMs through the file's ``general_gemm`` (FC2's is skipped in the
  module's own recompute pass), and saves for backward through the file's
  ``prepare_for_saving``: the inputs only in a ``checkpoint=True`` first
  pass, else the workspaces, each None where ``fsdp2_skip_columnwise`` drops it.
  The recompute pass returns its tensors instead, in the order of
  ``RECOMPUTED``.
* ``forward`` appends ``recompute_for_bwd=False`` and calls ``_forward``
  through the file's class name, as TE does (so the installed seam runs).
* ``backward`` takes the tensors from ``_recompute`` (the own checkpoint's
  recompute pass, or what was saved), rebuilds a weight whose place is None
  with ``ctx``'s quantizer after ``set_usage(rowwise=True, columnwise=True)``,
  makes sure of the columnwise data, runs dgrad, and clears the columnwise
  data when ``ctx.is_fsdp2``.
"""

from __future__ import annotations

from typing import Any

import torch

import _fake_te as fake

#: Positions in the non-tensor argument tuple (``recompute_for_bwd`` last, appended by ``forward``).
ARGS = {"is_first_microbatch": 0, "fp8": 1, "fc1_weight_quantizer": 2, "fc2_weight_quantizer": 3,
        "cpu_offloading": 4, "is_grad_enabled": 5, "fsdp_group": 6, "skip_fp8_weight_update": 7,
        "checkpoint": 8, "debug": 9, "is_fsdp2": 10, "recompute_for_bwd": 11}
#: Positions of the workspaces in what the recompute pass returns.
RECOMPUTED = {"fc1_weight": 2, "fc2_weight": 5}


class Float8Quantizer(fake.Float8CurrentScalingQuantizer):
    """Named as TE's delayed-scaling quantizer, so the registry describes it
    as one (its requantization is not exact): with it on FC1 only, FC1 and
    FC2 may be planned differently."""


Float8Quantizer.__module__ = "transformer_engine.pytorch.tensor.float8_tensor"


def _file() -> Any:
    return fake._FILES["lnmlp"]


def _quantize(weight, quantizer, workspace, first, grad, skip_columnwise):
    if isinstance(weight, fake.QuantizedTensorStorage):
        return weight, None
    quantizer.set_usage(rowwise=True, columnwise=grad and not skip_columnwise)
    update = first is None or first
    return _file().quantize_weight(tensor=weight, quantizer=quantizer, workspace=workspace, update_workspace=update,
                                   cache=workspace is None and first is not None)


def mlp_forward(ctx, inp, ln_w, ln_b, fc1_w, fc1_ws, fc1_b, fc2_w, fc2_ws, fc2_b, nta):
    """TE 2.20's ``_LayerNormMLP._forward``, weight steps only."""
    a = ARGS
    grad, checkpoint, recompute_for_bwd = nta[a["is_grad_enabled"]], nta[a["checkpoint"]], nta[a["recompute_for_bwd"]]
    is_recomputation = checkpoint and grad and recompute_for_bwd
    skip = nta[a["is_fsdp2"]] and not is_recomputation
    first = nta[a["is_first_microbatch"]]
    fc1, new1 = _quantize(fc1_w, nta[a["fc1_weight_quantizer"]], fc1_ws, first, grad, skip)
    fc2, new2 = _quantize(fc2_w, nta[a["fc2_weight_quantizer"]], fc2_ws, first, grad, skip)
    fc1.update_usage(rowwise_usage=True)
    act = _file().general_gemm(fc1, inp)
    out = None
    if not is_recomputation:
        fc2.update_usage(rowwise_usage=True)
        out = _file().general_gemm(fc2, act)
    if ctx is not None and grad:
        _save(ctx, nta, inp, act, (fc1_w, fc1, fc2_w, fc2), checkpoint and not recompute_for_bwd, skip)
        if is_recomputation:
            return (ctx, inp, fc1, fc1_w, act, fc2, fc2_w)
    return out, None, new1, new2


def _save(ctx, nta, inp, act, weights, first_of_checkpoint: bool, skip: bool) -> None:
    """TE's three cases: a ``checkpoint=True`` first pass saves the inputs
    only (``save_for_checkpoint``); its recompute pass saves nothing, as it
    returns its tensors; otherwise the workspaces are saved."""
    fc1_w, fc1, fc2_w, fc2 = weights
    ctx.checkpoint, ctx.other_args = nta[ARGS["checkpoint"]], nta
    if first_of_checkpoint:
        tensors, objects = _file().prepare_for_saving(inp, fc1_w, fc2_w)
        ctx.save_for_backward(*tensors)
        ctx.tensor_objects = objects
        return
    ctx.is_fsdp2 = nta[ARGS["is_fsdp2"]]
    ctx.fc1_weight_quantizer = nta[ARGS["fc1_weight_quantizer"]]
    ctx.fc2_weight_quantizer = nta[ARGS["fc2_weight_quantizer"]]
    if ctx.checkpoint:  # the recompute pass
        return
    fc1_save = None if (skip and fc1 is not fc1_w) else fc1
    fc2_save = None if (skip and fc2 is not fc2_w) else fc2
    tensors, objects = _file().prepare_for_saving(inp, fc1_save, fc1_w, act, fc2_save, fc2_w)
    ctx.save_for_backward(*tensors)
    ctx.tensor_objects = objects


def _recompute(ctx) -> tuple:
    tensors = fake.restore_from_saved(ctx.tensor_objects, ctx.saved_tensors)
    ctx.tensor_objects = None
    if not ctx.checkpoint:
        return (ctx, *tensors)
    inp, fc1_w, fc2_w = tensors
    nta = ctx.other_args[:-1] + (True,)
    with torch.enable_grad():
        return _file()._LayerNormMLP._forward(ctx, inp, None, None, fc1_w, None, None, fc2_w, None, None, nta)


def _dgrad(ctx, workspace, weight, quantizer, grad):
    if workspace is None:
        if isinstance(weight, fake.QuantizedTensorStorage):
            workspace = weight
        else:
            quantizer.set_usage(rowwise=True, columnwise=True)
            workspace = quantizer(weight)
    if isinstance(workspace, fake.QuantizedTensorStorage):
        workspace.update_usage(columnwise_usage=True)
    dgrad = _file().general_gemm(workspace, grad, layout="NN", grad=True)
    if ctx.is_fsdp2 and isinstance(workspace, fake.QuantizedTensorStorage):
        fake.clear_columnwise_cache(workspace)
    return dgrad


class MLPFunction(torch.autograd.Function):
    """Stands for TE's ``_LayerNormMLP``."""

    @staticmethod
    def _forward(ctx, inp, ln_w, ln_b, fc1_w, fc1_ws, fc1_b, fc2_w, fc2_ws, fc2_b, nta):
        return mlp_forward(ctx, inp, ln_w, ln_b, fc1_w, fc1_ws, fc1_b, fc2_w, fc2_ws, fc2_b, nta)

    @staticmethod
    def forward(ctx, inp, ln_w, ln_b, fc1_w, fc1_ws, fc1_b, fc2_w, fc2_ws, fc2_b, nta):
        return _file()._LayerNormMLP._forward(ctx, inp, ln_w, ln_b, fc1_w, fc1_ws, fc1_b, fc2_w, fc2_ws, fc2_b,
                                              nta + (False,))

    @staticmethod
    def _recompute(ctx):
        return _recompute(ctx)

    @staticmethod
    def backward(ctx, grad_out, *unused):
        _, inp, fc1, fc1_w, act, fc2, fc2_w = _file()._LayerNormMLP._recompute(ctx)
        d_act = _dgrad(ctx, fc2, fc2_w, ctx.fc2_weight_quantizer, grad_out)
        wgrad2 = _file().general_gemm(act, grad_out, layout="NT", grad=True)
        dgrad = _dgrad(ctx, fc1, fc1_w, ctx.fc1_weight_quantizer, d_act)
        wgrad1 = _file().general_gemm(inp, d_act, layout="NT", grad=True)
        return (dgrad, None, None, wgrad1 if isinstance(fc1_w, torch.Tensor) else None, None, None,
                wgrad2 if isinstance(fc2_w, torch.Tensor) else None, None, None, None)


class TELayerNormMLP(fake.TEModule):
    """Stands for te.LayerNormMLP: the module skeleton around the Function."""

    def __init__(self, hidden: int, ffn: int, seed: int = 0, checkpoint: bool = False) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.fc1_weight = torch.nn.Parameter(torch.randn(ffn, hidden, generator=gen))
        self.fc2_weight = torch.nn.Parameter(torch.randn(hidden, ffn, generator=gen) / 4)
        self.checkpoint = checkpoint
        self._fp8_workspaces: dict = {}
        self.fc1_quantizer, self.fc2_quantizer = fake.Float8CurrentScalingQuantizer(), \
            fake.Float8CurrentScalingQuantizer()

    def forward(self, inp, is_first_microbatch: bool | None = None):
        inp = self.prepare_forward(inp)
        try:
            cache = is_first_microbatch is not None and not self.is_fsdp2
            ws1 = self._fp8_workspaces.get("fc1_weight") if cache else None
            ws2 = self._fp8_workspaces.get("fc2_weight") if cache else None
            values = {"is_first_microbatch": is_first_microbatch if cache else None, "fp8": True,
                      "fc1_weight_quantizer": self.fc1_quantizer, "fc2_weight_quantizer": self.fc2_quantizer,
                      "cpu_offloading": False, "is_grad_enabled": torch.is_grad_enabled(), "fsdp_group": None,
                      "skip_fp8_weight_update": None, "checkpoint": self.checkpoint, "debug": False,
                      "is_fsdp2": self.is_fsdp2}
            nta = tuple(values[name] for name in sorted(values, key=ARGS.get))
            fn = _file()._LayerNormMLP
            args = (inp, None, None, self.fc1_weight, ws1, None, self.fc2_weight, ws2, None, nta)
            out, _, new1, new2 = fn.apply(*args) if torch.is_grad_enabled() else fn.forward(None, *args)
            if cache:
                for key, new in (("fc1_weight", new1), ("fc2_weight", new2)):
                    if new is not None:
                        self._fp8_workspaces[key] = new
        finally:
            self.end_forward()
        return out
