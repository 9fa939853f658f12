"""The testing kit's protocol over the TE quantizer, on real (CUDA) tensors.

``check_quantizer`` talks to a quantizer through six methods
(:class:`workspace_manager.testing.QuantizerUnderTest`). TE's quantizers have
their own API: ``set_usage`` + ``quantize`` build a storage, and the storage's
``update_usage`` keeps, drops or derives data. This adapter maps one onto the
other and adds nothing of its own, so the kit checks TE's code:

- ``quantize`` sets the usages on the TE quantizer and quantizes the weight
  moved to the GPU;
- ``update_usage`` calls the storage's ``update_usage``, which derives
  columnwise data from rowwise data (reference_current_scaling.py:127-132)
  and raises when asked for rowwise data it cannot make (line 128);
- ``clear_derived`` drops columnwise data that ``update_usage`` derived,
  through the storage's ``update_usage(columnwise_usage=False)``. (TE's own
  ``clear_columnwise_cache`` looks for ``_transpose`` / ``_columnwise_data``
  attributes, tensor/utils.py:1528-1535, which this reference storage does
  not have, so it would clear nothing here.)
- ``bytes_held`` counts each distinct storage once: the rowwise and
  columnwise scales are one tensor (reference_current_scaling.py:145, 327);
- ``dequantize`` calls the quantizer's ``dequantize(data, scale)``.

Use it as ``check_quantizer(ExamplePerTensorFP8KitAdapter, EXAMPLE_CAPABILITIES)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from workspace_manager import Usage

from .quantizer import ExamplePerTensorFP8Quantizer

__all__ = ["ExampleHandle", "ExamplePerTensorFP8KitAdapter"]


@dataclass(eq=False)
class ExampleHandle:
    """A TE storage (``CurrentScalingTensorRef``) and which of its usages
    :meth:`ExamplePerTensorFP8KitAdapter.update_usage` derived."""

    storage: Any
    derived: Usage = Usage.NONE


class ExamplePerTensorFP8KitAdapter:
    """:class:`~workspace_manager.testing.QuantizerUnderTest` over one
    :class:`ExamplePerTensorFP8Quantizer` (a fresh one by default)."""

    def __init__(self, quantizer: ExamplePerTensorFP8Quantizer | None = None, device: str | torch.device = "cuda"):
        self.quantizer = quantizer if quantizer is not None else ExamplePerTensorFP8Quantizer()
        self.device = torch.device(device)

    def quantize(self, weight: torch.Tensor, *, rowwise: bool, columnwise: bool) -> ExampleHandle:
        if not (rowwise or columnwise):
            raise ValueError("quantize needs at least one of rowwise=True, columnwise=True")
        self.quantizer.set_usage(rowwise=rowwise, columnwise=columnwise)
        return ExampleHandle(self.quantizer.quantize(weight.detach().to(self.device)))

    def update_usage(self, handle: ExampleHandle, *, rowwise: bool | None = None, columnwise: bool | None = None) -> None:
        before = self.usages(handle)
        handle.storage.update_usage(rowwise_usage=rowwise, columnwise_usage=columnwise)
        after = self.usages(handle)
        handle.derived |= after & ~before
        if after is not Usage.BOTH:
            # What is left is the only copy: it is no longer derived data.
            handle.derived = Usage.NONE

    def clear_derived(self, handle: ExampleHandle) -> None:
        if Usage.COLUMNWISE in handle.derived:
            handle.storage.update_usage(columnwise_usage=False)
        if Usage.ROWWISE in handle.derived:  # TE never derives rowwise data; kept for symmetry
            handle.storage.update_usage(rowwise_usage=False)
        handle.derived = Usage.NONE

    def usages(self, handle: ExampleHandle) -> Usage:
        held = Usage.NONE
        if handle.storage.data is not None:
            held |= Usage.ROWWISE
        if handle.storage.data_t is not None:
            held |= Usage.COLUMNWISE
        return held

    def bytes_held(self, handle: ExampleHandle) -> int:
        s = handle.storage
        storages = {}
        for tensor in (s.data, s.data_t, s.scale, s.scale_t):
            if tensor is not None:
                storage = tensor.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())

    def dequantize(self, handle: ExampleHandle, usage: Usage) -> torch.Tensor:
        s = handle.storage
        quantizer = s._quantizer if s._quantizer is not None else self.quantizer
        if usage is Usage.ROWWISE and s.data is not None:
            return quantizer.dequantize(s.data, s.scale)
        if usage is Usage.COLUMNWISE and s.data_t is not None:
            return quantizer.dequantize(s.data_t, s.scale_t).t()
        raise ValueError(f"cannot dequantize {usage.label} data; the handle holds {self.usages(handle).label}")
