"""Finding and releasing stale quantized copies, in drop-in and stock TE models alike.

:func:`release_workspaces` frees every quantized copy a model holds (where
the binding cannot see the weights change or leave).

:func:`stale_workspaces` inspects a model now and lists every live
quantized copy whose bytes no longer match their source;
:func:`check_stale_reads` watches TE's GEMMs while a block runs and raises
(or counts) where one would read a stale FP8 transpose (``_gemm_watch``). Both are how a user
finds out whether a training run is affected (docs/attribution.md,
"Stale copies"); the drop-ins never make such a copy (D12).

What counts as stale, per copy:

* a per-tensor FP8 transpose flagged valid that is not the transpose of
  the tensor's rowwise data (exact, byte for byte);
* a transpose kept on the unsharded parameter FSDP2 reuses, after the
  reshard freed that parameter's data: the next all-gather refills the data
  and TE keeps the transpose, so the next forward reads the weights of the
  step before;
* a cached workspace older than its weight: for a drop-in exactly, from the
  stamp it was filled with; for a stock module, where nobody recorded when
  it was made, an FP8 copy whose dequantized values disagree with the
  weight by more than the format's rounding can explain (a copy a few
  small steps old may still pass: that check can miss, it cannot accuse).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch

from workspace_manager.extending import fsdp2_gathered_parameters

from ._argument_checks import expect_module
from ._attribution import te_modules
from ._freshness import HeldCopy, copy_nbytes, held_copies, is_per_tensor, release_module, version_of
from ._model import gather_states

__all__ = ["StaleKind", "StaleCopy", "StaleWorkspaceError", "stale_workspaces", "release_workspaces",
           "transpose_matches", "as_kernels_read"]


class StaleKind(enum.Enum):
    """Why a copy is stale."""

    #: A valid-flagged FP8 transpose unequal to the transpose of its data.
    TRANSPOSE_MISMATCH = "transpose_mismatch"
    #: A transpose on FSDP2's unsharded parameter that outlived the reshard
    #: of its data: the next all-gather pairs it with newer data.
    OUTLIVES_RESHARD = "outlives_reshard"
    #: A cached workspace made from older weights than the current ones.
    CACHE_OLDER_THAN_WEIGHT = "cache_older_than_weight"
    #: A quantized FSDP2 shard (D13) made before its weight's latest write:
    #: no GEMM reads it, since the next all-gather makes it again first.
    SHARD_OLDER_THAN_WEIGHT = "shard_older_than_weight"


@dataclass(frozen=True)
class StaleCopy:
    """One stale copy: the module's path in the model, the weight (a
    parameter name or a cache key), why, and its bytes."""

    module: str
    weight: str
    kind: StaleKind
    nbytes: int
    detail: str

    def __str__(self) -> str:
        return f"{self.module or '<model>'}.{self.weight}: {self.kind.value} ({self.nbytes} B): {self.detail}"


class StaleWorkspaceError(RuntimeError):
    """A GEMM was about to read a stale quantized copy (see :func:`check_stale_reads`)."""


def _transpose_of(data: torch.Tensor) -> torch.Tensor:
    """What TE's ``fp8_transpose`` makes of ``data``: its 2D view, transposed."""
    return data.reshape(-1, data.shape[-1]).t().contiguous()


def as_kernels_read(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s elements in the order TE's kernels read them: TE hands a
    kernel a data pointer and a shape, never strides, so the elements are
    the ``numel`` bytes from the pointer on. That differs from the
    tensor's own view where the view is not contiguous: TE 2.20.2's
    ``as_strided`` on a ``Float8Tensor`` (FSDP2's first all-gather makes the
    unsharded parameter so, ``reshard_after_forward=False``) gives the
    transpose the data's strides swapped, a view whose element order is not
    the buffer's while every kernel still reads the buffer."""
    if tensor.is_contiguous():
        return tensor.reshape(-1)
    available = tensor.untyped_storage().nbytes() // tensor.element_size() - tensor.storage_offset()
    if available < tensor.numel():
        raise ValueError(f"as_kernels_read: a tensor of {tensor.numel()} elements with strides "
                         f"{tuple(tensor.stride())} has only {available} in its storage from its offset")
    return tensor.as_strided((tensor.numel(),), (1,))


def transpose_matches(tensor: Any) -> bool | None:
    """Whether a per-tensor FP8 tensor's valid transpose, read as TE's
    kernels read it (:func:`as_kernels_read`), is the transpose of its data;
    None where there is nothing to compare (no valid transpose, or no data:
    freed by FSDP2, or a columnwise-only tensor)."""
    if not is_per_tensor(tensor) or tensor._transpose is None or tensor._transpose_invalid:
        return None
    data = tensor._data
    if data is None or data.untyped_storage().nbytes() == 0:
        return None
    # The data as TE's own transpose kernel takes it (``_create_transpose``
    # makes it contiguous first); the transpose as the GEMM reads it.
    return torch.equal(as_kernels_read(tensor._transpose), _transpose_of(data).reshape(-1))


def _mantissa_bits(tensor: Any) -> int | None:
    """3 for E4M3, 2 for E5M2 (TE's ``_fp8_dtype`` names it); None: not FP8 we know."""
    name = str(getattr(tensor, "_fp8_dtype", ""))
    return 3 if "E4M3" in name.upper() else 2 if "E5M2" in name.upper() else None


def disagrees_with(workspace: Any, weight: torch.Tensor) -> bool:
    """An FP8 copy's values disagree with ``weight`` by more than rounding
    at the copy's own scale explains: one full step of the FP8 grid at the
    value (twice round-to-nearest's error), a subnormal step near zero, and
    saturation at the format's largest value. False where it cannot judge."""
    bits = _mantissa_bits(workspace)
    if bits is None or getattr(workspace, "_data", None) is None or tuple(workspace.shape) != tuple(weight.shape):
        return False
    dequantized = workspace.dequantize(dtype=torch.float32)
    exact = weight.detach().to(dequantized.device, torch.float32)
    fp8 = torch.float8_e4m3fn if bits == 3 else torch.float8_e5m2
    info = torch.finfo(fp8)
    scale_inv = workspace._scale_inv.detach().float().reshape(())
    tolerance = exact.abs() * 2.0 ** -bits + info.smallest_normal * 2.0 ** -bits * scale_inv
    saturated = (dequantized.abs() >= info.max * scale_inv * (1 - 2.0 ** -8)) & \
                (exact.abs() >= dequantized.abs()) & (torch.sign(exact) == torch.sign(dequantized))
    return bool((((dequantized - exact).abs() > tolerance) & ~saturated).any())


def _cache_is_stale(copy: HeldCopy) -> str | None:
    """Why a cached workspace is older than its weight, or None."""
    module, key = copy.module, copy.weight
    weight = getattr(module, key, None)
    if not isinstance(weight, torch.Tensor):
        return None
    state = getattr(module, "_wm_state", None)
    filled = state.filled.get(key) if state is not None else None
    if filled is not None and filled[0] == id(copy.tensor):
        version = 0 if state.sharding(module).is_fsdp2 else version_of(weight)
        if filled[2] != (state.writes, version):
            return "made before the weight's latest optimizer step or in-place write"
    if disagrees_with(copy.tensor, weight):  # also where a write escaped the stamps
        return "its values disagree with the weight by more than FP8 rounding explains"
    return None


def _why_stale(copy: HeldCopy) -> tuple[StaleKind, str] | None:
    if copy.kind == "cached":
        why = _cache_is_stale(copy)
        if why is not None:
            return StaleKind.CACHE_OLDER_THAN_WEIGHT, why
    matches = transpose_matches(copy.tensor)
    if matches is False:
        return StaleKind.TRANSPOSE_MISMATCH, "the transpose flagged valid is not the transpose of the data"
    if copy.kind == "gathered_transpose" and not copy.tensor._transpose_invalid and _gathered_is_old(copy):
        return StaleKind.OUTLIVES_RESHARD, ("FSDP2's next all-gather refills this parameter's data from the "
                                            "updated shard and TE keeps this transpose, which holds older weights")
    return None


def _gathered_is_old(copy: HeldCopy) -> bool:
    """FSDP2 freed the gathered data (the reshard), or, where the shard is
    the whole tensor (one rank), the gathered data is not the shard's now."""
    data = copy.tensor._data
    if data is None:
        return False
    if data.untyped_storage().nbytes() == 0:
        return True
    param = dict(copy.module.named_parameters(recurse=False)).get(copy.weight)
    shard = getattr(param, "_local_tensor", None)
    shard_data = getattr(shard, "_data", None)
    return shard_data is not None and shard_data.shape == data.shape and not torch.equal(shard_data, data)


def stale_workspaces(model: torch.nn.Module) -> list[StaleCopy]:
    """Every live quantized copy in ``model``'s TE modules (drop-in or
    stock) whose bytes no longer match their source, with the module path
    (see the module docstring for what counts). Empty: nothing stale now.

    Call it between steps (after ``optimizer.step()``, before the next
    forward) to see what the next step would read; it reads every copy's
    bytes, so it costs a pass over them."""
    expect_module("stale_workspaces", "model", model)
    gathered = fsdp2_gathered_parameters(model)
    found = []
    for path, module in te_modules(model):
        for copy in held_copies(module, gathered):
            why = _why_stale(copy)
            if why is not None:
                found.append(StaleCopy(path, copy.weight, why[0], copy_nbytes(copy), why[1]))
    return found + _stale_shards(model)


def _stale_shards(model: torch.nn.Module) -> list[StaleCopy]:
    """The quantized FSDP2 shards (D13) made before their weight's latest
    write outside an optimizer step (a step makes them again at once)."""
    return [StaleCopy("", name, StaleKind.SHARD_OLDER_THAN_WEIGHT, shard.nbytes,
                      "written since it was made; the next all-gather makes it again before any GEMM reads it")
            for gather in gather_states(model) for name, shard, current in gather.shards() if not current]


def release_workspaces(model: torch.nn.Module) -> int:
    """Free every quantized weight copy ``model``'s TE modules hold, drop-in
    and stock alike: cached workspaces, the derived FP8 transposes of
    quantized parameters, those of the unsharded parameters FSDP2 keeps
    between all-gathers, and the quantized shards of a quantized all-gather
    (``enable_quantized_gather``: call it on every rank then, since the next
    all-gather makes each shard again with a collective). Returns the bytes released (storages whose last
    reference this dropped are freed; the caching allocator keeps them for
    reuse until ``torch.cuda.empty_cache()``).

    Call it where the binding cannot see the weights change or leave: after
    an optimizer that steps outside ``torch.optim``, after an offload that
    swaps ``param.data``, or before a phase that needs the memory (training
    to rollout). Every copy is made again, from the current weights, where
    the next call needs it. It also moves the clock of each drop-in in
    ``model`` on, so that it treats what it made before as stale; another
    model's drop-ins keep theirs.
    """
    expect_module("release_workspaces", "model", model)
    gathered = fsdp2_gathered_parameters(model)
    released = 0
    for _, module in te_modules(model):
        state = getattr(module, "_wm_state", None)
        if state is not None:
            state.note_written()
        released += release_module(module, gathered)
    # The quantized shards of a quantized all-gather: the next all-gather
    # makes each again, with its own reduction (call this on every rank).
    return released + sum(gather.release() for gather in gather_states(model))
