"""The weight quantizer TE's backward rebuilds with, narrowed to the plan's usages."""

from __future__ import annotations

from typing import Any, ClassVar

from workspace_manager import Usage

__all__ = ["RebuildQuantizer", "quantize_with_usage"]


class RebuildQuantizer:
    """Stands for a weight quantizer in TE's backward rebuild (docs/decisions.md, D9).

    TE 2.20 asks for both usages there (``set_usage(rowwise=True,
    columnwise=True)`` before quantizing the gathered weight), although
    dgrad reads only columnwise data. This wrapper ignores that request and
    quantizes with the plan's usages. Formats whose kernels cannot build
    columnwise data alone (TE 2.20's per-tensor FP8: its cast-transpose
    needs rowwise output, and says so with ``NotImplementedError``) build
    both and drop the rest at once, so backward holds only what the plan
    names. Any other attribute TE reads comes from the wrapped quantizer;
    afterwards the quantizer is left as TE's rebuild leaves it (both usages).
    """

    __slots__ = ("quantizer", "usage", "_rowwise", "_columnwise")

    #: Quantizer classes found unable to build the narrow usage directly.
    builds_both: ClassVar[set] = set()

    def __init__(self, quantizer: Any, usage: Usage) -> None:
        self.quantizer = quantizer
        self.usage = usage
        self._rowwise = Usage.ROWWISE in usage
        self._columnwise = Usage.COLUMNWISE in usage

    def set_usage(self, *, rowwise: bool | None = None, columnwise: bool | None = None) -> None:
        """Ignored: the plan's usages stand."""

    def __call__(self, tensor: Any) -> Any:
        return quantize_with_usage(self.quantizer, tensor, self._rowwise, self._columnwise)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.quantizer, name)


def quantize_with_usage(quantizer: Any, tensor: Any, rowwise: bool, columnwise: bool, restore: bool = True) -> Any:
    """``quantizer(tensor)`` holding only the usages named; with ``restore``
    the quantizer is left with both usages (as TE's rebuilds leave it;
    GroupedLinear's forward sets its quantizers' usages before each use, so
    its rebuild skips that). A format whose kernels cannot build the narrow
    usage directly (it raises ``NotImplementedError``) builds both, then
    drops the rest at once."""
    if type(quantizer) not in RebuildQuantizer.builds_both:
        quantizer.set_usage(rowwise=rowwise, columnwise=columnwise)
        try:
            return quantizer(tensor)
        except NotImplementedError:
            RebuildQuantizer.builds_both.add(type(quantizer))
        finally:
            if restore:
                quantizer.set_usage(rowwise=True, columnwise=True)
    quantizer.set_usage(rowwise=True, columnwise=True)
    out = quantizer(tensor)
    out.update_usage(rowwise_usage=rowwise, columnwise_usage=columnwise)
    return out
