"""Every expert of a GroupedLinear call quantized by one grouped TE call.

Where a plan saves no workspace (FSDP2's), a GroupedLinear call quantizes
each expert's gathered weight in forward and again in backward. TE's
split-quantize path does it one expert at a time: a Python call and one to
four kernel launches per expert, in every microbatch, which leaves a step
with many experts bound by the host (the reason stock TE, which caches its
copies across microbatches, is faster there). TE 2.20 also has kernels that
quantize many tensors at once, but only from one contiguous tensor, and
FSDP2 gives each expert's weight its own buffer; so :func:`quantize_experts`
concatenates the experts (one copy kernel) and quantizes them in one call:

* per-tensor delayed scaling (``Float8Quantizer``): ``tex.split_quantize``
  with each expert's own quantizer (its scale; its amax is recorded as a
  per-expert quantization records it);
* per-tensor current scaling and FP8 block scaling
  (``Float8CurrentScalingQuantizer``, ``Float8BlockQuantizer``):
  ``tex.group_quantize``, which computes each expert's amax or block scales
  on its own rows, with the first expert's quantizer (the experts' are
  alike: checked, see :func:`_alike`).

Each gives, expert by expert, the bytes and scales TE's per-expert
``quantize`` gives (checked bit for bit on the GPU for every sm_90 recipe:
``benchmarks/grouped_quantize_probe.py``). The price is a transient copy
of the experts' high-precision weights while they are quantized. Any other
quantizer (MXFP8, NVFP4, a custom or debug one, amax reduction) returns None
and the caller quantizes expert by expert, as TE does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..te import _compat as te

__all__ = ["quantize_experts", "grouped_method"]

#: Quantizer class -> how its experts are quantized at once (None: one by one).
_METHODS: dict[type, Callable | None] = {}
#: ``id``s of quantizer lists found alike, with the list itself (so an id is
#: never reused while it is here); bounded, since TE may make new lists.
_ALIKE: dict[tuple[int, ...], Sequence] = {}
_ALIKE_MAX = 4096


def quantize_experts(quantizers: Sequence, weights: Sequence, rowwise: bool, columnwise: bool) -> list | None:
    """``weights`` (high precision, one per expert) quantized at once with
    ``quantizers`` (one per expert), each holding only the usages named; or
    None where no grouped TE call gives what per-expert quantization gives."""
    method = grouped_method(quantizers, weights)
    if method is None:
        return None
    return method(quantizers, weights, rowwise, columnwise)


def grouped_method(quantizers: Sequence, weights: Sequence) -> Callable | None:
    """The grouped quantization of these experts, or None (see the module docstring)."""
    kind = type(quantizers[0])
    method = _METHODS[kind] if kind in _METHODS else _learn(kind)
    if method is None or len(weights) < 2 or len(quantizers) != len(weights):
        return None
    first = weights[0]
    if any(w is None or w.dtype != first.dtype or w.shape[1:] != first.shape[1:] or not w.is_contiguous()
           or isinstance(w, te.QuantizedTensorStorage) for w in weights):
        return None
    return method if _alike(quantizers) else None


def _learn(kind: type) -> Callable | None:
    """TE's own quantizer classes, by name and module: a subclass (a
    custom quantizer) may quantize differently, so it is never grouped."""
    method = None
    if kind.__module__.startswith("transformer_engine."):
        method = {"Float8Quantizer": _split, "Float8CurrentScalingQuantizer": _group,
                  "Float8BlockQuantizer": _group}.get(kind.__name__)
    _METHODS[kind] = method
    return method


def _alike(quantizers: Sequence) -> bool:
    """Every quantizer of the same class and settings as the first, none
    reducing its amax across ranks (the grouped kernels do not): then the
    first quantizes every expert as its own would."""
    key = tuple(map(id, quantizers))
    if key in _ALIKE:
        return True
    first = quantizers[0]
    settings = _settings(first)
    if settings is None or any(type(q) is not type(first) or _settings(q) != settings for q in quantizers):
        return False
    if len(_ALIKE) >= _ALIKE_MAX:
        _ALIKE.clear()
    _ALIKE[key] = quantizers
    return True


def _settings(quantizer: Any) -> tuple | None:
    if getattr(quantizer, "with_amax_reduction", False):
        return None
    return tuple(getattr(quantizer, name, None) for name in (
        "dtype", "force_pow_2_scales", "amax_epsilon", "block_scaling_dim", "all_gather_usage", "internal"))


def _stacked(weights: Sequence) -> tuple[torch.Tensor, list[int]]:
    return torch.cat(list(weights), dim=0), [w.shape[0] for w in weights]


def _split(quantizers: Sequence, weights: Sequence, rowwise: bool, columnwise: bool) -> list:
    """Delayed scaling: each expert with its own quantizer. TE's fused
    multi-tensor cast builds both usages; the unneeded one is dropped at
    once, as the per-expert rebuild drops it (D9)."""
    for quantizer in quantizers:
        quantizer.set_usage(rowwise=True, columnwise=True)
    stacked, rows = _stacked(weights)
    outs = te.tex.split_quantize(stacked, rows, list(quantizers))
    return _keep_only(outs, rowwise, columnwise)


def _group(quantizers: Sequence, weights: Sequence, rowwise: bool, columnwise: bool) -> list:
    """Current and block scaling: one grouped kernel, every expert scaled on its own rows."""
    quantizer = quantizers[0]
    stacked, _ = _stacked(weights)
    quantizer.set_usage(rowwise=rowwise, columnwise=columnwise)
    try:
        grouped = te.tex.group_quantize(stacked, quantizer, len(weights), None)
    except NotImplementedError:  # per-tensor FP8 on Hopper: no columnwise data alone
        quantizer.set_usage(rowwise=True, columnwise=True)
        grouped = te.tex.group_quantize(stacked, quantizer, len(weights), None)
    experts = getattr(grouped, "quantized_tensors", None) or grouped.split_into_quantized_tensors()
    return _keep_only(experts, rowwise, columnwise)


def _keep_only(outs: Sequence, rowwise: bool, columnwise: bool) -> list:
    outs = list(outs)
    for out in outs:
        usages = out.get_usages()
        if (usages.get("rowwise") and not rowwise) or (usages.get("columnwise") and not columnwise):
            out.update_usage(rowwise_usage=rowwise, columnwise_usage=columnwise)
    return outs
