"""Backward's rebuild of weights saved in high precision: one :class:`Rebuild` for every kind.

Where a plan saves no workspace (``BackwardSource.REQUANTIZE``), backward
quantizes the saved high-precision weights again, holding only the plan's
backward usages (docs/decisions.md, D9). Every kind does it the same way: a
:class:`Rebuild` holds the weights' quantizers and the usages, and its one
quantize step is :func:`quantize_with_usage` (a grouped weight's is TE's
grouped kernel). What differs between kinds is only where the rebuilt
weights go, which each kind's subclass says in
:meth:`Rebuild.before_te_backward`:

* the dense kinds (``Linear``, ``LayerNormLinear``, ``LayerNormMLP``,
  ``te.ops.BasicLinear``): TE's own backward, which quantizes the weight
  again with the quantizer it is handed; :class:`RebuildQuantizer` is that
  quantizer, so TE runs it at its own rebuild and the phase has nothing to do;
* ``GroupedLinear`` (``kinds/grouped_linear.ExpertRebuild``): the list of saved
  tensors TE's backward restores (its backward quantizes nothing again);
* ``te.ops.GroupedLinear`` (``kinds/ops_grouped_linear.OpRebuild``): the op
  context's saved tensors, before TE's ``fuser_backward`` reads them.

The last two are the before phase of the call's
:class:`~te_integration.runtime._release.BackwardWork`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from workspace_manager import Usage

from ..te import _compat as te
from ._expert_quantize import quantize_experts

__all__ = ["Rebuild", "RebuildQuantizer", "quantize_with_usage"]

class Rebuild:
    """Quantize again, holding only ``usage``, weights saved in high precision (D9).

    ``quantizers`` are the weights' quantizers, in the weights' order;
    ``state``, the module's ``ModuleWorkspaceState``, remembers whether many
    experts' quantizers quantize alike (``_expert_quantize``). A
    kind's subclass says where the rebuilt weights go
    (:meth:`before_te_backward`). Not changed once made; a plain class, not
    a dataclass: it is made in forward, once per call whose plan
    requantizes, and one ``__init__`` is the fewest calls.
    """

    __slots__ = ("quantizers", "usage", "rowwise", "columnwise", "state")

    #: Quantizer classes found unable to build the narrow usage directly.
    builds_both: ClassVar[set] = set()

    def __init__(self, quantizers: Sequence, usage: Usage, state: Any = None) -> None:
        self.quantizers = quantizers
        self.usage = usage
        self.state = state
        self.rowwise, self.columnwise = Usage.ROWWISE in usage, Usage.COLUMNWISE in usage

    def before_te_backward(self, ctx: Any, saved: Any) -> Any:
        """``saved`` (what TE's backward of ``ctx`` reads) with the weights
        rebuilt in their places: the kind's part."""
        raise NotImplementedError(f"{type(self).__name__} says nowhere the rebuilt weights go")

    def quantized(self, weights: Sequence, restore: bool) -> list:
        """Each weight quantized with its quantizer (a None stays None); see
        :func:`quantize_with_usage` for ``restore``. Many weights of one
        quantization format (experts) are quantized by one grouped TE call
        where one is exact for them (``_expert_quantize``)."""
        rowwise, columnwise = self.rowwise, self.columnwise
        if len(weights) > 1 and self.state is not None:
            grouped = quantize_experts(self.state, self.quantizers, weights, rowwise, columnwise)
            if grouped is not None:
                if restore:
                    for quantizer in self.quantizers[:1]:  # the only one a grouped call narrows
                        quantizer.set_usage(rowwise=True, columnwise=True)
                return grouped
        return [None if weight is None else quantize_with_usage(quantizer, weight, rowwise, columnwise, restore)
                for weight, quantizer in zip(weights, self.quantizers)]

    def quantized_grouped(self, weight: Any, count: int) -> Any:
        """One grouped weight of ``count`` experts, quantized by TE's grouped
        kernel as its forward quantizes it (``single_grouped_weight``)."""
        if weight is None:
            return None
        quantizer = self.quantizers[0]
        # A non-reentrant checkpoint hands backward a detached alias, which
        # may be a plain tensor over the grouped weight's data.
        data = getattr(weight, "rowwise_data", None)
        source = data.view(weight.logical_shape) if data is not None else weight
        quantizer.set_usage(rowwise=self.rowwise, columnwise=self.columnwise)
        try:
            return te.tex.group_quantize(source, quantizer, count, None)
        finally:
            quantizer.set_usage(rowwise=True, columnwise=True)


class RebuildQuantizer(Rebuild):
    """A :class:`Rebuild` of one weight that TE's backward runs itself: it
    stands for the weight quantizer TE's backward rebuilds with (the dense
    kinds' place is TE's own rebuild).

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

    # TE's quantizer (``quantizers[0]``), in a slot of its own: forward
    # compares it at each call (``backward_quantizer``) and TE's backward
    # calls through it, so no index or property call is spent on it.
    __slots__ = ("quantizer",)

    def __init__(self, quantizer: Any, usage: Usage) -> None:
        # Rebuild's fields set here rather than through super().__init__: te.ops
        # makes one per call under backward_override="dequantized", and each
        # Python call there is host time per call.
        self.quantizers, self.quantizer, self.usage, self.state = (quantizer,), quantizer, usage, None
        self.rowwise, self.columnwise = Usage.ROWWISE in usage, Usage.COLUMNWISE in usage

    def before_te_backward(self, ctx: Any, saved: Any) -> Any:
        """Nothing: TE's backward rebuilds the weight itself, calling this."""
        return saved

    def set_usage(self, *, rowwise: bool | None = None, columnwise: bool | None = None) -> None:
        """Ignored: the plan's usages stand."""

    def __call__(self, tensor: Any) -> Any:
        return quantize_with_usage(self.quantizer, tensor, self.rowwise, self.columnwise)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.quantizer, name)


def quantize_with_usage(quantizer: Any, tensor: Any, rowwise: bool, columnwise: bool, restore: bool = True) -> Any:
    """``quantizer(tensor)`` holding only the usages named; with ``restore``
    the quantizer is left with both usages (as TE's rebuilds leave it;
    GroupedLinear's forward sets its quantizers' usages before each use, so
    its rebuild skips that). A format whose kernels cannot build the narrow
    usage directly (it raises ``NotImplementedError``) builds both, then
    drops the rest at once."""
    if type(quantizer) not in Rebuild.builds_both:
        quantizer.set_usage(rowwise=rowwise, columnwise=columnwise)
        try:
            return quantizer(tensor)
        except NotImplementedError:
            Rebuild.builds_both.add(type(quantizer))
        finally:
            if restore:
                quantizer.set_usage(rowwise=True, columnwise=True)
    quantizer.set_usage(rowwise=True, columnwise=True)
    out = quantizer(tensor)
    out.update_usage(rowwise_usage=rowwise, columnwise_usage=columnwise)
    return out
