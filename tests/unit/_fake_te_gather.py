"""The stand-in TE's part of the quantized FSDP2 all-gather (D13), on CPU.

What ``te_integration.te._compat`` gives the binding for it, in plain
PyTorch: the shard's amax, the FP8 cast with the scale of a reduced amax
(``torch.float8_e4m3fn``, scale = 448 / amax), and :class:`GatheredFloat8`,
the FP8 weight the stand-in's modules receive from the all-gather (TE's
``Float8Tensor``: rowwise bytes, a transpose derived on demand, one scale).
:class:`Fp8CurrentScalingQuantizer` is a stand-in weight quantizer of the
same arithmetic for whole weights (stock's path: the bf16 gather quantized
in the call), so that the two paths agree bit for bit exactly where the
shard's scale is the whole weight's. The 2D-block format (Float8BlockScaling,
128x128 blocks, one scale each) has the same three parts:
:func:`block_quantize_rows`, :class:`GatheredBlock` and
:class:`Fp8BlockScalingQuantizer`. The recipes are named as TE's.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from _fake_te import Float8CurrentScalingQuantizer, QuantizedTensorStorage, Workspace

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)


def _scale(amax: torch.Tensor) -> torch.Tensor:
    """FP8 max / amax in float32 (1 where the amax is 0)."""
    amax = amax.float().reshape(1)
    return torch.where(amax > 0, torch.tensor(FP8_MAX) / amax, torch.ones_like(amax))


def _cast(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (values.detach().float() * scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def shard_amax(shard: torch.Tensor) -> torch.Tensor:
    if shard.numel() == 0:
        return torch.zeros(1, dtype=torch.float32)
    return shard.detach().abs().amax().float().reshape(1)


def cast_with_amax(shard: torch.Tensor, amax: torch.Tensor, quantizer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    scale = _scale(amax)
    return _cast(shard, scale).view(torch.uint8), 1.0 / scale


def shard_amaxes(shards: list[torch.Tensor]) -> list[torch.Tensor]:
    """As the TE layer's: one element each, views of one buffer."""
    packed = torch.stack([shard_amax(s).reshape(()) for s in shards]) if shards else torch.zeros(0)
    return list(packed.split(1))


def cast_with_amaxes(shards: list[torch.Tensor], amaxes: list[torch.Tensor], quantizer: Any, kept=None) -> list:
    """As the TE layer's: ``(data, scale_inv, kept)``, written over ``kept``
    (a previous call's ``(data, scale_inv)``) where it fits the shard."""
    kept = kept if kept is not None else [None] * len(shards)
    return [_into(cast_with_amax(s, a, quantizer), k) for s, a, k in zip(shards, amaxes, kept)]


def _into(made: tuple[torch.Tensor, torch.Tensor], kept: Any) -> tuple[torch.Tensor, torch.Tensor, Any]:
    data, scale_inv = made
    if isinstance(kept, tuple) and kept[0].shape == data.shape and kept[1].shape == scale_inv.shape:
        kept[0].copy_(data), kept[1].copy_(scale_inv)
        data, scale_inv = kept
    return data, scale_inv, (data, scale_inv)


def dequantized(data: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """FP8 bytes (uint8) as float32 values."""
    return data.view(FP8).float() * scale_inv.reshape(())


class Fp8CurrentScalingQuantizer(Float8CurrentScalingQuantizer):
    """Whole-weight per-tensor FP8 (stock's path): the stand-in quantizer's
    workspaces, holding the dequantized FP8 values, so that the stand-in's
    GEMMs read what they read from a :class:`GatheredFloat8`."""

    def quantize(self, tensor, *, dtype=None):
        if isinstance(tensor, QuantizedTensorStorage):
            return super().quantize(tensor, dtype=dtype)
        data, scale_inv = cast_with_amax(tensor, shard_amax(tensor), self)
        values = dequantized(data, scale_inv)
        return Workspace(values if self.rowwise_usage else None,
                         values.t().contiguous() if self.columnwise_usage else None, tensor, self)

    def update_quantized(self, tensor, workspace) -> None:
        fresh = self.quantize(tensor)
        if workspace._data is not None:
            workspace._data.copy_(fresh._data if fresh._data is not None else fresh._transpose.t())
        if workspace.get_usages()["columnwise"]:
            workspace._transpose.copy_(workspace._data.t() if workspace._data is not None else fresh._transpose)
        workspace.source, workspace.refreshes = tensor, workspace.refreshes + 1


Fp8CurrentScalingQuantizer.__module__ = "transformer_engine.pytorch.tensor.float8_tensor"


BLOCK = 128


def _block_grid(values: torch.Tensor) -> torch.Tensor:
    """The amax of each 128x128 block of a 2-D tensor, blocks counted from its first row."""
    rows, cols = values.shape
    nbr, nbc = -(-rows // BLOCK), -(-cols // BLOCK)
    padded = values.new_zeros(nbr * BLOCK, nbc * BLOCK, dtype=torch.float32)
    padded[:rows, :cols] = values.detach().abs().float()
    return padded.view(nbr, BLOCK, nbc, BLOCK).amax(dim=(1, 3))


def _expand(grid: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return grid.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:rows, :cols]


def block_quantize_rows(shard: torch.Tensor, quantizer: Any, kept=None) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """``(uint8 data, scale_inv, kept)`` of a shard whose rows start a block:
    one scale per block, the block columns padded to a multiple of 4 (as
    TE); written over ``kept`` (a previous call's) where it fits."""
    amax = _block_grid(shard)
    scale = torch.where(amax > 0, FP8_MAX / amax, torch.ones_like(amax))
    data = _cast(shard, _expand(scale, *shard.shape)).view(torch.uint8)
    scale_inv = torch.zeros(amax.shape[0], -(-amax.shape[1] // 4) * 4)
    scale_inv[:, : amax.shape[1]] = 1.0 / scale
    return _into((data, scale_inv), kept)


class Fp8BlockScalingQuantizer(Float8CurrentScalingQuantizer):
    """Whole-weight 2D-block FP8 (stock's path), as :class:`Fp8CurrentScalingQuantizer`
    is for per-tensor scaling; its capabilities are TE's 2D-block format's."""

    block_scaling_dim = 2

    def quantize(self, tensor, *, dtype=None):
        if isinstance(tensor, QuantizedTensorStorage):
            return super().quantize(tensor, dtype=dtype)
        data, scale_inv, _ = block_quantize_rows(tensor, self)
        values = GatheredBlock(data, scale_inv, tensor.dtype, self).dequantize(torch.float32)
        return Workspace(values if self.rowwise_usage else None,
                         values.t().contiguous() if self.columnwise_usage else None, tensor, self)


Fp8BlockScalingQuantizer.__module__ = "transformer_engine.pytorch.tensor.float8_blockwise_tensor"
Fp8BlockScalingQuantizer.__qualname__ = "Float8BlockQuantizer"


class GatheredFloat8(QuantizedTensorStorage, torch.Tensor):
    """Stands for TE's ``Float8Tensor`` made from FSDP2's gathered bytes:
    ``_data`` (uint8 rows), ``_transpose`` (uint8, derived on demand),
    ``_scale_inv``, ``_quantizer``. FSDP2's own steps (``detach``,
    ``alias``, ``as_strided`` to its shape) share the same buffers; any
    other op runs on the dequantized weight."""

    __torch_function__ = torch._C._disabled_torch_function_impl
    internal = False

    @staticmethod
    def __new__(cls, data, scale_inv, dtype, quantizer):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=dtype, device=data.device)

    def __init__(self, data, scale_inv, dtype, quantizer) -> None:
        self._data, self._transpose, self._transpose_invalid = data, None, True
        self._scale_inv, self._quantizer = scale_inv, quantizer

    def get_usages(self) -> dict:
        return {"rowwise": self._data is not None,
                "columnwise": self._transpose is not None and not self._transpose_invalid}

    def update_usage(self, rowwise_usage=None, columnwise_usage=None) -> None:
        if columnwise_usage and not self.get_usages()["columnwise"]:
            if self._data is None:
                raise RuntimeError("Cannot generate FP8 data, even from FP8 data transpose")
            self._transpose, self._transpose_invalid = self._data.t().contiguous(), False
        if columnwise_usage is False:
            self._transpose, self._transpose_invalid = None, True
        if rowwise_usage is False:
            self._data = None

    def gemm_operand(self, layout: str) -> torch.Tensor:
        """The weight as a GEMM of ``layout`` reads it: rowwise for fprop
        (TN), from the transpose for dgrad (NN). As cuBLAS, it refuses a
        scale it reads through a pointer not aligned to 16 bytes."""
        if self._scale_inv.data_ptr() % 16:
            raise RuntimeError("general_gemm: cuBLAS Error: the requested functionality is not supported "
                               "(scale_inv is not aligned to 16 bytes)")
        if layout == "TN":
            if self._data is None:
                raise RuntimeError("general_gemm: the rowwise data the TN GEMM reads is missing")
            return self._values(self._data)
        if not self.get_usages()["columnwise"]:
            raise RuntimeError("general_gemm: the columnwise data the NN GEMM reads is missing")
        return self._values(self._transpose.t())

    def _values(self, data: torch.Tensor) -> torch.Tensor:
        """FP8 bytes of the weight's shape as float32 values."""
        return dequantized(data, self._scale_inv)

    def dequantize(self, dtype=None) -> torch.Tensor:
        return self._values(self._data).to(dtype or self.dtype)

    def _share(self) -> GatheredFloat8:
        twin = type(self)(self._data, self._scale_inv, self.dtype, self._quantizer)
        twin._transpose, twin._transpose_invalid = self._transpose, self._transpose_invalid
        return twin

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        this = args[0]
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
            return this._share()
        if func is torch.ops.aten.as_strided.default and tuple(args[1]) == tuple(this.shape):
            return this._share()
        plain = [a.dequantize() if isinstance(a, GatheredFloat8) else a for a in args]
        return func(*plain, **(kwargs or {}))


def float8_weight(data, scale_inv, dtype, quantizer) -> GatheredFloat8:
    own = Float8CurrentScalingQuantizer()
    own.set_usage(rowwise=True, columnwise=False)
    return GatheredFloat8(data, scale_inv, dtype, own)


def refill_float8_weight(out, data, scale_inv) -> None:
    out._data, out._transpose, out._transpose_invalid = data, None, True
    out._scale_inv = scale_inv


class GatheredBlock(GatheredFloat8):
    """Stands for TE's ``Float8BlockwiseQTensor`` made from FSDP2's gathered
    bytes: as :class:`GatheredFloat8`, with one scale per 128x128 block."""

    def _values(self, data: torch.Tensor) -> torch.Tensor:
        rows, cols = data.shape
        grid = self._scale_inv[:, : -(-cols // BLOCK)]
        return data.view(FP8).float() * _expand(grid, rows, cols)


def block_weight(data, scale_inv, dtype, quantizer) -> GatheredBlock:
    own = Fp8BlockScalingQuantizer()
    own.set_usage(rowwise=True, columnwise=False)
    return GatheredBlock(data, scale_inv, dtype, own)


def refill_block_weight(out, data, scale_inv) -> None:
    refill_float8_weight(out, data, scale_inv)


def weight_quantizer_of(recipe) -> Any:
    name = type(recipe).__name__
    if name == "Float8CurrentScaling":
        return Fp8CurrentScalingQuantizer()
    return Fp8BlockScalingQuantizer() if name == "Float8BlockScaling" else None


def _recipe(name: str) -> type:
    return type(name, (), {"backward_override": None, "__repr__": lambda self: f"{name}()"})


#: Stand-ins of TE's recipe classes, by their names (the binding reads the name and ``backward_override``).
RECIPES = SimpleNamespace(current=_recipe("Float8CurrentScaling"), delayed=_recipe("DelayedScaling"),
                          block=_recipe("Float8BlockScaling"), mxfp8=_recipe("MXFP8BlockScaling"))


def compat_entries() -> dict[str, Any]:
    return {"shard_amaxes": shard_amaxes, "cast_with_amaxes": cast_with_amaxes, "float8_weight": float8_weight,
            "refill_float8_weight": refill_float8_weight, "weight_quantizer_of": weight_quantizer_of,
            "block_quantize_rows": block_quantize_rows, "block_weight": block_weight,
            "refill_block_weight": refill_block_weight}
