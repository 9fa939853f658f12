"""A reference quantizer in plain PyTorch that passes the testing kit.

Per-tensor scaled ``torch.float8_e4m3fn`` with current scaling (the scale
comes from the tensor's own amax), like TE's ``Float8CurrentScalingQuantizer``:

- rowwise data is the FP8 weight, columnwise data is its transpose. Both
  use the one per-tensor scale, so the transpose of the rowwise data *is*
  the columnwise quantization, bit for bit: ``columnwise_derivable=True``;
- a transpose made by :meth:`Float8PerTensorQuantizer.update_usage` lives in
  a buffer the quantizer allocated (a transpose cache) that FSDP2 would not
  free: ``derived_caches=True``;
- the scale depends on the weight only: ``requantization_safe=True``.

Read it as a worked example of :class:`~workspace_manager.testing.QuantizerUnderTest`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._context import QuantizerCapabilities
from .._plan import Usage

__all__ = ["FLOAT8_MAX", "REFERENCE_CAPABILITIES", "Float8PerTensorWeight", "Float8PerTensorQuantizer"]

#: The largest finite float8_e4m3fn value.
FLOAT8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)

#: The capabilities :class:`Float8PerTensorQuantizer` has (and the kit verifies).
REFERENCE_CAPABILITIES = QuantizerCapabilities(
    name="reference_float8_per_tensor",
    columnwise_derivable=True,
    derived_caches=True,
    requantization_safe=True,
)


@dataclass(eq=False)
class Float8PerTensorWeight:
    """A quantized weight: FP8 data per direction and one float32 scale."""

    shape: torch.Size
    scale: torch.Tensor
    rowwise: torch.Tensor | None = None
    columnwise: torch.Tensor | None = None  # the transpose: shape[::-1]
    derived: Usage = Usage.NONE  # directions update_usage derived (the cache)

    def usages(self) -> Usage:
        held = Usage.NONE
        if self.rowwise is not None:
            held |= Usage.ROWWISE
        if self.columnwise is not None:
            held |= Usage.COLUMNWISE
        return held


class Float8PerTensorQuantizer:
    """Per-tensor current-scaling FP8 with a transpose cache."""

    def quantize(self, weight: torch.Tensor, *, rowwise: bool, columnwise: bool) -> Float8PerTensorWeight:
        if weight.dim() != 2:
            raise ValueError(f"expected a 2D weight; received shape {tuple(weight.shape)}")
        if not (rowwise or columnwise):
            raise ValueError("quantize needs at least one of rowwise=True, columnwise=True")
        w = weight.detach().float()
        amax = w.abs().max()
        scale = torch.where(amax > 0, FLOAT8_MAX / amax, torch.ones_like(amax))
        out = Float8PerTensorWeight(shape=w.shape, scale=scale)
        if rowwise:
            out.rowwise = _to_fp8(w, scale)
        if columnwise:
            out.columnwise = _to_fp8(w.t().contiguous(), scale)
        return out

    def update_usage(
        self, handle: Float8PerTensorWeight, *, rowwise: bool | None = None, columnwise: bool | None = None
    ) -> None:
        if rowwise and handle.rowwise is None:
            handle.rowwise = _transpose(handle.columnwise, "rowwise")
            handle.derived |= Usage.ROWWISE
        if columnwise and handle.columnwise is None:
            handle.columnwise = _transpose(handle.rowwise, "columnwise")
            handle.derived |= Usage.COLUMNWISE
        if rowwise is False:
            handle.rowwise = None
        if columnwise is False:
            handle.columnwise = None
        if handle.usages() is not Usage.BOTH:
            # What is left is the only copy: it is no longer a cache.
            handle.derived = Usage.NONE

    def clear_derived(self, handle: Float8PerTensorWeight) -> None:
        if Usage.ROWWISE in handle.derived:
            handle.rowwise = None
        if Usage.COLUMNWISE in handle.derived:
            handle.columnwise = None
        handle.derived = Usage.NONE

    def usages(self, handle: Float8PerTensorWeight) -> Usage:
        return handle.usages()

    def bytes_held(self, handle: Float8PerTensorWeight) -> int:
        data = [t for t in (handle.rowwise, handle.columnwise) if t is not None]
        return sum(t.numel() * t.element_size() for t in data) + handle.scale.numel() * handle.scale.element_size()

    def dequantize(self, handle: Float8PerTensorWeight, usage: Usage) -> torch.Tensor:
        if usage is Usage.ROWWISE and handle.rowwise is not None:
            return handle.rowwise.float() / handle.scale
        if usage is Usage.COLUMNWISE and handle.columnwise is not None:
            return handle.columnwise.float().t() / handle.scale
        raise ValueError(f"cannot dequantize {usage.label} data; the handle holds {handle.usages().label}")


def _to_fp8(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (w * scale).clamp(-FLOAT8_MAX, FLOAT8_MAX).to(torch.float8_e4m3fn)


def _transpose(source: torch.Tensor | None, wanted: str) -> torch.Tensor:
    if source is None:
        raise ValueError(f"cannot derive {wanted} data from a handle that holds no data")
    return source.t().contiguous()
