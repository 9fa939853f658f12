"""Reference FP8 formats for the quantized-gather tests, in plain PyTorch.

* :class:`CurrentScaling`: per-tensor scaling from the amax (as TE's
  Float8CurrentScaling), ``torch.float8_e4m3fn``;
* :class:`BlockScaling`: a scale per ``block x block`` tile (as TE's
  Float8BlockScaling with 2D weight blocks; the tests use small blocks so
  that shard boundaries cut through them);
* :class:`RefFloat8Weight`: the unsharded quantized weight a GEMM receives,
  with rowwise data and a columnwise form (the transpose) derived from it, as
  TE's Float8Tensor / Float8BlockwiseQTensor after FSDP2's gather;
* :class:`RefFactory`: builds it from gathered bytes and picks its usages the
  way TE's own FSDP2 hooks do;
* :func:`ref_linear`: a "GEMM" that dequantizes and multiplies. Given a
  high-precision weight it quantizes the whole weight itself (stock TE with
  bf16 parameters: forward rowwise, backward again with both usages); given a
  :class:`RefFloat8Weight` it uses it as is (TE with a quantized weight).

Both quantizers implement ``workspace_manager``'s ShardQuantizer protocol, and
:func:`quantize_whole` quantizes a whole weight through the same two calls, so
the stock path and the sharded path share every line of arithmetic but the
reduction and the row offsets.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from workspace_manager._context import Sharding
from workspace_manager._shard_gather import GatherContext, GatherPass, ShardLayout

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


def _scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """max / amax in float32; 1 where the amax is 0 (an all-zero tensor or block)."""
    amax = amax.float()
    return torch.where(amax > 0, torch.tensor(FP8_MAX, dtype=torch.float32) / amax, torch.ones_like(amax))


def _cast(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (values.float() * scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


class CurrentScaling:
    """Per-tensor current scaling. Counts its quantize calls."""

    block = None

    def __init__(self) -> None:
        self.calls = 0

    def statistic(self, shard: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
        if shard.numel() == 0:
            return torch.zeros(1, dtype=torch.float32, device=shard.device)
        return shard.detach().abs().amax().float().reshape(1)

    def quantize(self, shard: torch.Tensor, statistic: torch.Tensor, layout: ShardLayout):
        self.calls += 1
        scale = _scale_from_amax(statistic.reshape(()))
        return _cast(shard, scale), (1.0 / scale).reshape(1)


class BatchCurrentScaling(CurrentScaling):
    """:class:`CurrentScaling` as a ``BatchShardQuantizer``: a refresh hands
    it all its shards at once, and it writes a shard over the memory the
    refresh offers it (``kept``: the last shard's data and scale_inv) where
    they fit, as the TE binding keeps TE's cast objects. Counts its batch
    calls (``batches``: statistics and quantize_all calls, and the shards
    each took), how many shards of each quantize_all call went into kept
    memory (``reused``) and, as its base, every shard quantized."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[tuple[str, int]] = []
        self.reused: list[int] = []

    def statistics(self, shards, layouts, kept):
        self.batches.append(("statistics", len(shards)))
        return [self.statistic(s, layout) for s, layout in zip(shards, layouts)]

    def quantize_all(self, shards, statistics, layouts, kept):
        self.batches.append(("quantize_all", len(shards)))
        made, reused = [], 0
        for shard, statistic, layout, old in zip(shards, statistics, layouts, kept):
            data, scale_inv = self.quantize(shard, statistic, layout)
            if old is not None and old[0].shape == data.shape and old[0].dtype == data.dtype:
                old[0].copy_(data), old[1].copy_(scale_inv)
                data, scale_inv, reused = old[0], old[1], reused + 1
            made.append((data, scale_inv, (data, scale_inv)))
        self.reused.append(reused)
        return made


class BlockScaling:
    """A scale per ``block x block`` tile of a 2-D weight; the statistic is
    the grid of block amaxes of the whole weight (zero where the shard has
    no rows), so the reduced grid is the whole weight's."""

    def __init__(self, block: int) -> None:
        self.block = block
        self.calls = 0

    def _grid(self, shape: tuple[int, ...]) -> tuple[int, int]:
        return -(-shape[0] // self.block), -(-shape[1] // self.block)

    def _row_blocks(self, layout: ShardLayout, device: torch.device) -> torch.Tensor:
        rows = torch.arange(layout.row_start, layout.row_start + layout.rows, device=device)
        return rows // self.block

    def statistic(self, shard: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
        grid_rows, grid_cols = self._grid(layout.full_shape)
        grid = torch.zeros(grid_rows, grid_cols, dtype=torch.float32, device=shard.device)
        if shard.numel():
            cols = shard.shape[1]
            padded = shard.detach().abs().float().new_zeros(shard.shape[0], grid_cols * self.block)
            padded[:, :cols] = shard.detach().abs().float()
            per_row = padded.reshape(shard.shape[0], grid_cols, self.block).amax(-1)
            grid.index_reduce_(0, self._row_blocks(layout, shard.device), per_row, "amax")
        return grid.reshape(-1)

    def quantize(self, shard: torch.Tensor, statistic: torch.Tensor, layout: ShardLayout):
        self.calls += 1
        grid = _scale_from_amax(statistic.reshape(self._grid(layout.full_shape)))
        per_row = grid[self._row_blocks(layout, shard.device)]
        per_element = per_row.repeat_interleave(self.block, dim=1)[:, : shard.shape[1]]
        return _cast(shard, per_element), 1.0 / grid


def quantize_whole(weight: torch.Tensor, quantizer) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole weight quantized by one rank (stock TE's path after a bf16 gather)."""
    layout = ShardLayout.of(tuple(weight.shape), 0, 1)
    return quantizer.quantize(weight, quantizer.statistic(weight, layout), layout)


class RefFloat8Weight(torch.Tensor):
    """FP8 rowwise data, a derived columnwise form (the transpose; with
    2-D blocks the block scales transpose too), and the scales. Any op other
    than FSDP2's no-op ``as_strided``/``detach`` runs on the dequantized
    weight."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, data, scale_inv, dtype, block, shape):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=scale_inv.device)

    def __init__(self, data, scale_inv, dtype, block, shape):
        self._data = data  # float8 (rows, cols) or None
        self._transpose = None  # float8 (cols, rows) or None
        self._scale_inv = scale_inv
        self._block = block
        self._nominal = dtype

    def _share(self) -> RefFloat8Weight:
        twin = RefFloat8Weight(self._data, self._scale_inv, self._nominal, self._block, self.shape)
        twin._transpose = self._transpose
        return twin

    def usages(self) -> str:
        return "+".join(n for n, t in (("rowwise", self._data), ("columnwise", self._transpose)) if t is not None)

    def set_usage(self, rowwise: bool, columnwise: bool) -> None:
        """TE's update_usage: derive the columnwise form from the rowwise
        data (never the reverse), drop what is not wanted."""
        if columnwise and self._transpose is None:
            self._transpose = self._data.t().contiguous()
        if not rowwise:
            self._data = None
        if not columnwise:
            self._transpose = None

    def _expand(self, scale: torch.Tensor, shape) -> torch.Tensor:
        if self._block is None:
            return scale.reshape(())
        full = scale.repeat_interleave(self._block, 0).repeat_interleave(self._block, 1)
        return full[: shape[0], : shape[1]]

    def rowwise_values(self) -> torch.Tensor:
        if self._data is None:
            raise RuntimeError("the GEMM needs rowwise data; the gathered weight holds " + self.usages())
        return self._data.float() * self._expand(self._scale_inv, self._data.shape)

    def columnwise_values(self) -> torch.Tensor:
        """W dequantized from the columnwise form (the transpose), as dgrad reads it."""
        if self._transpose is None:
            self.set_usage(rowwise=self._data is not None, columnwise=True)
        scale = self._scale_inv if self._block is None else self._scale_inv.t()
        return (self._transpose.float() * self._expand(scale, self._transpose.shape)).t()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self = args[0]
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
            return self._share()
        if func is torch.ops.aten.as_strided.default and tuple(args[1]) == tuple(self.shape):
            return self._share()
        unwrapped = [a.rowwise_values().to(a.dtype) if isinstance(a, RefFloat8Weight) else a for a in args]
        return func(*unwrapped, **kwargs)


class RefFactory:
    """Makes :class:`RefFloat8Weight` from gathered bytes; records the
    usages each gather gave, for the tests.

    When FSDP2 reshards after forward, the forward gather is rowwise only
    and the backward gather gets the columnwise form too (derived after the
    gather); when it keeps the forward gather, that gather gets both. Unlike
    TE 2.20's own hooks, the backward gather keeps its rowwise data: an
    activation recompute runs the forward GEMM after the backward gather,
    and the rowwise data is FSDP2's gathered buffer, which stays allocated
    until the reshard anyway."""

    def __init__(self, block: int | None) -> None:
        self.block = block
        self.log: list[tuple[str, str, str]] = []

    @staticmethod
    def _usages(context: GatherContext) -> tuple[bool, bool]:
        if context.sharding is Sharding.FSDP2_KEEP:
            return True, True
        return True, context.phase is GatherPass.BACKWARD

    def make(self, data, scale_inv, dtype, context):
        out = RefFloat8Weight(None, scale_inv, dtype, self.block, data.shape)
        self.refill(out, data, scale_inv, context)
        return out

    def refill(self, out, data, scale_inv, context):
        out._data = data.view(FP8)
        out._transpose = None  # the previous gather's transpose is stale
        out._scale_inv = scale_inv
        out.set_usage(*self._usages(context))
        self.log.append((context.phase.value, context.sharding.value, out.usages()))


class _RefLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, quantizer):
        if isinstance(weight, RefFloat8Weight):
            values = weight.rowwise_values()
        else:  # stock: quantize the gathered high-precision weight (rowwise)
            data, scale_inv = quantize_whole(weight, quantizer)
            values = RefFloat8Weight(data, scale_inv, weight.dtype, quantizer.block, weight.shape).rowwise_values()
        ctx.save_for_backward(x, weight)
        ctx.quantizer = quantizer
        return (x.float() @ values.t()).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        if isinstance(weight, RefFloat8Weight):
            quantized = weight
        else:  # stock under FSDP2: quantize the (re-)gathered weight again
            data, scale_inv = quantize_whole(weight, ctx.quantizer)
            quantized = RefFloat8Weight(data, scale_inv, weight.dtype, ctx.quantizer.block, weight.shape)
        dgrad = (grad.float() @ quantized.columnwise_values()).to(x.dtype)
        if isinstance(weight, RefFloat8Weight):
            weight.set_usage(rowwise=weight._data is not None, columnwise=False)  # TE's clear after dgrad
        wgrad = (grad.reshape(-1, grad.shape[-1]).float().t() @ x.reshape(-1, x.shape[-1]).float())
        return dgrad, wgrad.to(weight.dtype), None


def ref_linear(x: torch.Tensor, weight: torch.Tensor, quantizer) -> torch.Tensor:
    return _RefLinear.apply(x, weight, quantizer)


class RefLinear(nn.Module):
    """A linear layer whose GEMM is :func:`ref_linear` (no bias: a bias
    elsewhere in the model stays a plain parameter)."""

    def __init__(self, fan_in: int, fan_out: int, quantizer, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(fan_out, fan_in, dtype=dtype) * 0.5)
        self.quantizer = quantizer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ref_linear(x, self.weight, self.quantizer)
