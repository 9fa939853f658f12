"""Every expert of a GroupedLinear call quantized by one grouped TE call.

Where a plan saves no workspace (FSDP2's), a GroupedLinear call quantizes
each expert's gathered weight in forward and again in backward. TE's
split-quantize path does it one expert at a time: a Python call and one to
four kernel launches per expert, in every microbatch, which leaves a step
with many experts bound by the host (the reason stock TE, which caches its
copies across microbatches, is faster there). :func:`quantize_experts`
quantizes them in one call:

* per-tensor delayed scaling (``Float8Quantizer``):
  ``tex.multi_tensor_quantize`` with each expert's own quantizer (its
  scale; its amax is recorded as a per-expert quantization records it). It
  reads every expert's own buffer and casts them all in one fused
  cast-transpose kernel;
* per-tensor current scaling and FP8 block scaling
  (``Float8CurrentScalingQuantizer``, ``Float8BlockQuantizer``):
  ``tex.group_quantize``, which computes each expert's amax or block scales
  on its own rows, with the first expert's quantizer (the experts' are
  alike: checked once per list of them and module, see :func:`_alike`). Its kernels read one contiguous
  tensor, and FSDP2 gives each expert's weight its own buffer, so the
  experts are concatenated first (one copy kernel, and a transient copy of
  their high-precision weights while they are quantized).

A grouped result is split into per-expert workspaces by
``te._compat.split_experts`` (TE's classes over the same views, without
TE's Python work per expert). Each way gives, expert by expert, the bytes
and scales TE's per-expert ``quantize`` gives (checked bit for bit on the
GPU for every sm_90 recipe by ``benchmarks/grouped_quantize_probe.py`` and
``tests/gpu/test_expert_split.py``). Any other quantizer (MXFP8, NVFP4, a
custom or debug one, amax reduction), or a TE build without these calls,
returns None and the caller quantizes expert by expert, as TE does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch

from ..te import _compat as te

__all__ = ["quantize_experts"]

#: Quantizer class -> how its experts are quantized at once (None: one by
#: one): a registry of TE's classes, filled as they are met.
_METHODS: dict[type, Callable | None] = {}


def quantize_experts(state: Any, quantizers: Sequence, weights: Sequence, rowwise: bool,
                     columnwise: bool) -> list | None:
    """``weights`` (high precision, one per expert) quantized at once with
    ``quantizers`` (one per expert, as many), each holding only the usages
    named; or None where no grouped TE call gives what per-expert
    quantization gives (see the module docstring).

    Little Python runs per expert: that is what the grouped call saves. The
    checks of the quantizers run once per list of them (:func:`_alike`),
    remembered in the calling module's ``state`` (its
    ``ModuleWorkspaceState``); experts that do not fit together (a missing
    one, another shape or dtype) give None."""
    kind = type(quantizers[0])
    method = _METHODS[kind] if kind in _METHODS else _learn(kind)
    first = weights[0]
    if method is None or first is None or isinstance(first, te.QuantizedTensorStorage):
        return None
    key = tuple(map(id, quantizers))
    known = state.alike
    if (known is None or known[0] != key) and not _alike(state, quantizers, key):
        return None
    return method(quantizers, weights, rowwise, columnwise)


def _learn(kind: type) -> Callable | None:
    """TE's own quantizer classes, by name and module: a subclass (a
    custom quantizer) may quantize differently, so it is never grouped."""
    method = None
    if kind.__module__.startswith("transformer_engine."):
        method = {"Float8Quantizer": _multi, "Float8CurrentScalingQuantizer": partial(_group, per_tensor=True),
                  "Float8BlockQuantizer": _group}.get(kind.__name__)
    if method is _multi and not hasattr(te.tex, "multi_tensor_quantize"):  # a TE build without it
        method = None
    _METHODS[kind] = method
    return method


def _alike(state: Any, quantizers: Sequence, key: tuple) -> bool:
    """Every quantizer of the same class and settings as the first, none
    reducing its amax across ranks (the grouped kernels do not): then the
    first quantizes every expert as its own would. Remembered in the
    module's state by the quantizers' ids (the module's latest list only:
    TE makes a list per call of the same quantizers), holding the list so
    that no id is reused meanwhile."""
    first = quantizers[0]
    settings = _settings(first)
    if settings is None or any(type(q) is not type(first) or _settings(q) != settings for q in quantizers):
        return False
    state.alike = (key, quantizers)
    return True


def _settings(quantizer: Any) -> tuple | None:
    if getattr(quantizer, "with_amax_reduction", False):
        return None
    return tuple(getattr(quantizer, name, None) for name in (
        "dtype", "force_pow_2_scales", "amax_epsilon", "block_scaling_dim", "all_gather_usage", "internal"))


def _multi(quantizers: Sequence, weights: Sequence, rowwise: bool, columnwise: bool) -> list | None:
    """Delayed scaling: each expert with its own quantizer (its scale, its
    amax recorded), straight from its own buffer. TE fuses the casts of
    many tensors into one kernel only where it builds both usages; the
    unneeded one is dropped at once, as the per-expert rebuild drops it (D9)."""
    first = weights[0]
    if any(w is None or w.dtype is not first.dtype or not w.is_contiguous() for w in weights):
        return None  # TE's kernel reads each buffer as a dense matrix of one type
    for quantizer in quantizers:
        quantizer.set_usage(rowwise=True, columnwise=True)
    outs = te.tex.multi_tensor_quantize(list(weights), list(quantizers))
    return list(outs) if rowwise and columnwise else _keep_only(outs, rowwise, columnwise)


def _stacked(weights: Sequence) -> tuple[torch.Tensor, int] | None:
    """The experts in one tensor (a transient copy: TE's grouped kernels read
    one tensor) and the rows of each; None where they do not fit together."""
    first = weights[0]
    try:
        stacked = torch.cat(weights)
    except (TypeError, RuntimeError):  # a missing expert, or another shape
        return None
    rows = first.shape[0]
    if stacked.dtype is not first.dtype or stacked.shape[0] != rows * len(weights):  # promoted, or uneven
        return None
    return stacked, rows


def _group(quantizers: Sequence, weights: Sequence, rowwise: bool, columnwise: bool, *,
           per_tensor: bool = False) -> list | None:
    """Current and block scaling: one grouped kernel (``tex.group_quantize``
    with the first quantizer), every expert scaled on its own rows.

    Per-tensor (current) scaling: TE splits the group into experts whose
    ``scale_inv`` are views of one buffer, 4 bytes apart, and cuBLAS reads a
    GEMM's scale from a 16-byte aligned address; so each expert gets its
    own row of a padded copy (one kernel) of the same values."""
    found = _stacked(weights)
    if found is None:
        return None
    stacked, rows = found
    quantizer, count = quantizers[0], len(quantizers)
    quantizer.set_usage(rowwise=rowwise, columnwise=columnwise)
    narrow = True
    try:
        grouped = te.tex.group_quantize(stacked, quantizer, count, None)
    except NotImplementedError:  # a format that cannot build columnwise data alone: both, then drop
        quantizer.set_usage(rowwise=True, columnwise=True)
        grouped, narrow = te.tex.group_quantize(stacked, quantizer, count, None), False
    experts = getattr(grouped, "quantized_tensors", None)  # TE may have split it already
    if experts is None:
        experts = te.split_experts(grouped, quantizer, count, (rows, stacked.shape[1]))
    if experts is None:  # not a layout split_experts reads: TE's own split, with its Python per expert
        experts = grouped.split_into_quantized_tensors()
    if per_tensor:
        inverse = grouped.scale_inv if grouped.scale_inv is not None else grouped.columnwise_scale_inv
        padded = torch.constant_pad_nd(inverse.reshape(count, 1), (0, _SCALE_ALIGNMENT - 1))[:, :1].unbind(0)
        for expert, row in zip(experts, padded):
            expert._scale_inv = row
    return list(experts) if narrow else _keep_only(experts, rowwise, columnwise)


#: float32 scales per 16 bytes: cuBLAS's alignment for a scale's address.
_SCALE_ALIGNMENT = 4


def _keep_only(outs: Sequence, rowwise: bool, columnwise: bool) -> list:
    outs = list(outs)
    for out in outs:
        usages = out.get_usages()
        if (usages.get("rowwise") and not rowwise) or (usages.get("columnwise") and not columnwise):
            out.update_usage(rowwise_usage=rowwise, columnwise_usage=columnwise)
    return outs
