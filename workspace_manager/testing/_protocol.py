"""The protocol a quantizer implements to be checked by :func:`check_quantizer`.

The workspace manager never calls these methods in production: a binding
(``te_integration``) talks to TE's own tensors. The protocol is the small,
format-neutral surface the testing kit needs to verify that a quantizer
really has the capabilities it is registered with, and to run the workspace
lifecycle on its real bytes. Wrap your quantizer in a thin adapter if its
own API differs.

A *handle* is whatever ``quantize`` returns (a quantized tensor, a
dataclass, ...): the kit only passes it back to the other methods.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from .._plan import Usage

__all__ = ["QuantizerUnderTest", "PROTOCOL_METHODS"]


@runtime_checkable
class QuantizerUnderTest(Protocol):
    """What :func:`~workspace_manager.testing.check_quantizer` calls.

    "Rowwise" data feeds fprop, "columnwise" (transposed) data feeds dgrad,
    as in :class:`~workspace_manager.Usage`.
    """

    def quantize(self, weight: torch.Tensor, *, rowwise: bool, columnwise: bool) -> Any:
        """Quantize ``weight`` (2D, high precision) into a new handle holding
        exactly the requested usages (at least one is True). Each direction
        is quantized from ``weight`` itself, never derived."""
        ...

    def update_usage(self, handle: Any, *, rowwise: bool | None = None, columnwise: bool | None = None) -> None:
        """Change the usages ``handle`` holds, in place. ``None`` leaves a
        usage as it is, ``False`` drops its data (and frees its bytes), and
        ``True`` keeps it or, when missing, *derives* it from the other
        direction. Deriving is possible only for a format registered with
        ``columnwise_derivable=True``; any other format must raise (any
        exception) instead of returning without the data."""
        ...

    def clear_derived(self, handle: Any) -> None:
        """Drop data that :meth:`update_usage` derived and that the quantizer
        keeps in memory of its own (an FP8 transpose cache). Afterwards the
        handle holds what ``quantize`` built. A format whose derived data
        needs no clearing (``derived_caches=False``) makes this a no-op."""
        ...

    def usages(self, handle: Any) -> Usage:
        """The usages ``handle`` holds now."""
        ...

    def bytes_held(self, handle: Any) -> int:
        """Bytes of quantized data and scales that ``handle`` keeps alive,
        derived data included."""
        ...

    def dequantize(self, handle: Any, usage: Usage) -> torch.Tensor:
        """The high-precision tensor that the data of one ``usage``
        (``Usage.ROWWISE`` or ``Usage.COLUMNWISE``) represents, in the
        weight's own orientation and shape (un-transpose columnwise data).
        The kit compares these bit for bit, so two equal quantizations must
        dequantize to identical bits."""
        ...


#: The method names of :class:`QuantizerUnderTest`, for error messages.
PROTOCOL_METHODS: tuple[str, ...] = (
    "quantize",
    "update_usage",
    "clear_derived",
    "usages",
    "bytes_held",
    "dequantize",
)
