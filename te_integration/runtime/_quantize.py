"""The ``quantize_weight`` seam: the cache and the forward usage from the plan.

Installed as ``quantize_weight`` in the globals of TE's module files, where
TE's forward quantizes each weight. For a weight of the drop-in call on top
of this thread's stack (:data:`~te_integration.runtime._call.ACTIVE`) it quantizes
with the plan's forward usage and through the plan's cache action; the
binding owns the cache, so TE's ``workspace``/``cache`` arguments are
ignored and no new workspace is returned (TE never stores one). Anything
else (stock modules, quantized parameters) runs TE's own function.
"""

from __future__ import annotations

from typing import Any

from workspace_manager import CacheAction

from . import _attribution
from ..te import _compat as te
from ._call import ACTIVE, ANY_WEIGHT, GATHERED_WEIGHT, CallRecord
from ._levers import Levers
from ._saved_tensors import PER_TENSOR_LAYOUTS, rowwise_parts
from ._freshness import version_of

__all__ = ["managed_quantize_weight", "expert_key", "expert_key_at", "expert_index", "expert_keys"]

_RECORDINGS = _attribution.ACTIVE_RECORDINGS


def managed_quantize_weight(*, tensor=None, quantizer=None, workspace=None, update_workspace=True,
                            skip_update_flag=None, fsdp_group=None, workspace_dtype=None, cache=False):
    """TE's ``quantize_weight`` with the cache and usage taken from the plan."""
    record = ACTIVE.record
    levers = None
    if record is not None:
        weights = record.weights
        if weights:
            first = weights[0]
            if first is tensor or first is GATHERED_WEIGHT or first is ANY_WEIGHT:  # the common case: the first
                levers = weights[1]
            else:
                levers = _levers_of(weights, tensor)
    if levers is None or levers.is_quantized_param:
        # Quantized parameters are never cached (TE only adds the usages their
        # own quantizer holds), and everything unplanned is stock TE; spelled
        # here, as stock modules and quantized parameters pass on every call.
        out, new = te.quantize_weight(tensor=tensor, quantizer=quantizer, workspace=workspace,
                                      update_workspace=update_workspace, skip_update_flag=skip_update_flag,
                                      fsdp_group=fsdp_group, workspace_dtype=workspace_dtype, cache=cache)
        if _RECORDINGS and levers is None and not isinstance(tensor, te.QuantizedTensorStorage):
            _attribution.forward_workspace(None, None, None, out, from_cache=bool(cache) or out is workspace,
                                           weight=tensor)
        return out, new
    # A GroupedLinear call plans its experts under one key; each expert's
    # cache entry and attribution has its own (found only where needed).
    part = record.part
    key = levers.key if part is None or part.experts is None else None
    if part is not None and part.quantize_all is not None:  # the call's first: every expert at once
        part.quantized, part.quantize_all = part.quantize_all(), None
    quantized = part.quantized if part is not None else None
    if quantized is not None:  # this expert's, from the grouped quantization (None: each on its own)
        index = part.index
        try:
            if part.experts[index] is tensor:
                part.index = index + 1
            else:
                index = expert_index(part, tensor)
        except IndexError:
            index = expert_index(part, tensor)
        out, hit = quantized[index], False
        if _RECORDINGS:
            key = expert_key_at(index)
    elif levers.cache is not CacheAction.BYPASS:
        key = key or expert_key(record, tensor)
        out, hit = _cached_quantize(record, levers, key, tensor, quantizer, skip_update_flag, workspace_dtype)
    else:  # the common case, spelled here: one Python call fewer per module call
        want_columnwise, hit = levers.forward_columnwise, False
        if quantizer.columnwise_usage is not want_columnwise or not quantizer.rowwise_usage:
            quantizer.set_usage(rowwise=True, columnwise=want_columnwise)
        # TE's quantize_weight makes this one call for a high-precision weight
        # without workspace or cache (a sentinel in _compat holds the line).
        # Made here, the seam's frame takes the place of TE's instead of adding
        # one: a GroupedLinear call adds no Python frame per expert.
        out = quantizer.quantize(tensor, dtype=workspace_dtype)
    if levers.saves_no_workspace and part is not None and part.dropped is not None:  # FC1, FC2 save differently
        part.dropped.append(out)
    if levers.saves_columnwise_only and not hit:  # a fresh workspace (a cache entry keeps what it holds)
        # Found now: TE's prepare_for_saving empties the storage before its
        # forward returns (see _saved_tensors). Per-tensor FP8 is spelled
        # inline (attribute reads only): it is every such call on Hopper.
        if type(out) in PER_TENSOR_LAYOUTS:
            data = out._data
            parts = [data] if data is not None and out._transpose is not None and not out._transpose_invalid else None
        else:
            parts = rowwise_parts(out)
        if parts:
            if record.rowwise_parts is None:
                record.rowwise_parts = parts
            else:  # one list per call, also for many experts (+= calls nothing)
                record.rowwise_parts += parts
    if _RECORDINGS:
        _attribution.forward_workspace(record.module, key or expert_key(record, tensor), levers.plan, out,
                                       from_cache=hit)
    return out, None


def _levers_of(weights: tuple, tensor: Any) -> Levers | None:
    """The levers of ``tensor`` if it is one of the call's weights."""
    for i in range(0, len(weights), 2):
        if weights[i] is tensor:
            return weights[i + 1]
    return None


def expert_key(record: CallRecord, tensor) -> str:
    """The cache key of the GroupedLinear expert ``tensor`` is (TE's:
    ``weight0``, ``weight1``, ...); see :func:`expert_index`."""
    return expert_key_at(expert_index(record.part, tensor))


def expert_key_at(index: int) -> str:
    """``weight<index>``, made once per process."""
    return _EXPERT_KEYS[index] if index < len(_EXPERT_KEYS) else _more_expert_keys(index)


def expert_index(part: Any, tensor) -> int:
    """Which of the call's experts ``tensor`` is. TE quantizes the experts
    in order, so the expected one is checked first; a gathered
    ``DistributedWeight`` is none of the call's tensors, and takes the
    expected position. Each call moves the expected position on."""
    experts, index = part.experts, part.index
    if index >= len(experts) or experts[index] is not tensor:
        index = next((i for i, weight in enumerate(experts) if weight is tensor), index)
    part.index = index + 1
    return index


#: ``weight0``, ``weight1``, ...: made once per process.
_EXPERT_KEYS: list[str] = [f"weight{i}" for i in range(64)]


def _more_expert_keys(index: int) -> str:
    _EXPERT_KEYS.extend(f"weight{i}" for i in range(len(_EXPERT_KEYS), index + 1))
    return _EXPERT_KEYS[index]


def expert_keys(count: int) -> tuple[str, ...]:
    """The cache keys of ``count`` experts' weights."""
    if count > len(_EXPERT_KEYS):
        _more_expert_keys(count - 1)
    return tuple(_EXPERT_KEYS[:count])


def _cached_quantize(record: CallRecord, levers: Levers, key: str, tensor, quantizer, skip_update_flag,
                     workspace_dtype):
    """Quantize a high-precision weight through the module's cache as its
    plan says (FILL, REUSE or READ_ONLY) under ``key``; returns the
    workspace and whether it came from the cache. An entry older than the
    weight (made before an optimizer step, or before the weight's version
    counter moved) is refreshed, whatever the call's microbatch position
    says (docs/decisions.md, D12); the module's clock (``state.writes``)
    dates the entry."""
    state = record.state
    want_columnwise = levers.forward_columnwise
    if quantizer.columnwise_usage is not want_columnwise or not quantizer.rowwise_usage:
        quantizer.set_usage(rowwise=True, columnwise=want_columnwise)
    action = levers.cache
    pending = record.pending
    # This call's own fill first, then the module's cache.
    cached = pending[key] if pending is not None and key in pending else record.module._fp8_workspaces.get(key)
    stamp = (state.writes, version_of(tensor) if levers.cache_tracks_version else 0)
    if cached is not None:
        # An entry this state filled with the usages wanted serves as it is
        # (see ModuleWorkspaceState.filled); any other is checked in full.
        filled = state.filled.get(key)
        known = filled is not None and filled[0] == id(cached)
        if (known and (filled[1] or not want_columnwise)) or _usable(cached, tensor, quantizer, want_columnwise):
            fresh = known and filled[2] == stamp
            if fresh and action is not CacheAction.FILL and skip_update_flag is None:
                return cached, True  # what TE's quantize_weight returns for a hit it must not refresh
            if fresh or action is not CacheAction.READ_ONLY:
                out, _ = te.quantize_weight(tensor=tensor, quantizer=quantizer, workspace=cached,
                                            update_workspace=True, skip_update_flag=skip_update_flag,
                                            workspace_dtype=workspace_dtype)
                state.filled[key] = (id(cached), filled[1] if known else want_columnwise, stamp)
                return out, True
    if action is CacheAction.READ_ONLY:  # missed (or stale): a fresh workspace, not stored
        # TE's own uncached call, made here as in managed_quantize_weight.
        out = quantizer.quantize(tensor, dtype=workspace_dtype)
        return out, False
    out, new = te.quantize_weight(tensor=tensor, quantizer=quantizer, workspace=None, update_workspace=True,
                                  skip_update_flag=skip_update_flag, workspace_dtype=workspace_dtype, cache=True)
    if record.pending is None:
        record.pending = {}
    record.pending[key] = new
    state.filled[key] = (id(new), want_columnwise, stamp)
    return out, False


def commit_cache(record: CallRecord) -> None:
    """The call's GEMMs returned: the cache entries it filled become the module's."""
    record.module._fp8_workspaces.update(record.pending)


def _usable(workspace, tensor, quantizer, want_columnwise: bool) -> bool:
    """Stricter than TE's ``_is_weight_workspace_valid``: it also checks
    block-FP8 usages, missing rowwise data, shape and format."""
    if not te.is_weight_workspace_valid(workspace, quantizer):
        return False
    try:
        usages = workspace.get_usages()
    except (AttributeError, NotImplementedError):
        # Storages that cannot report their usages (TE's Python reference
        # quantizers) are judged by TE's own check alone, as stock TE does.
        usages = {"rowwise": True, "columnwise": True}
    if not usages.get("rowwise", False) or (want_columnwise and not usages.get("columnwise", False)):
        return False
    if tuple(workspace.shape) != tuple(tensor.shape):
        return False
    return type(getattr(workspace, "_quantizer", quantizer)) is type(quantizer)
