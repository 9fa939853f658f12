"""No GEMM reads a quantized copy made from older data than its weight (D12).

A quantized copy can outlive the data it was made from in four ways, and
the binding answers each one here, for every module kind and every plan
(no policy can choose a stale read):

* **A quantized parameter's derived columnwise data** (per-tensor FP8's
  transpose on Hopper). TE marks it invalid after in-place ops that go
  through the tensor (``Float8Tensor._reset_caches``), but TE's
  ``FusedAdam`` writes DelayedScaling FP8 parameters through raw pointers
  and never does, and FSDP2's all-gather refills the reused gathered
  tensor's data while keeping its transpose. The seams stamp each quantized
  weight a drop-in reads with the module's clock
  (``ModuleWorkspaceState.writes``, moved by the optimizer steps that wrote
  the module's parameters: ``_step_hook``) and the tensor's version
  counter; the first call after either moved marks the transpose invalid
  (:func:`refresh_parameter`), and TE derives it again from the current
  data where a GEMM needs it: every dgrad path calls
  ``update_usage(columnwise_usage=True)`` first. The price is one transpose
  per weight per step of its own optimizer.
* **A cached workspace** (microbatches): stamped when filled; a call that
  finds it older refreshes it in place, whatever ``is_first_microbatch``
  says (``_quantize``). Under FSDP2 every all-gather moves the gathered
  weight's version counter while the weight changes only at the step, so
  there the clock alone decides.
* **A module moved** (``module.to``, ``.cpu()``): the drop-ins' ``_apply``
  releases every quantized copy the module holds (:func:`release_module`).
* **Anything the binding cannot see** (an optimizer outside ``torch.optim``,
  ``param.data`` swapped by an offload framework, a phase switch):
  ``release_workspaces`` (``_stale``), which also moves the clocks of the
  model's drop-ins on.

Only per-tensor FP8 has derived data TE keeps flagged valid across writes;
TE rebuilds the other formats' columnwise data with their rowwise data on
every write it makes (``quantize_``, FSDP2's gathers), and those are left as
TE keeps them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


from workspace_manager.attribution import buffers_of

from ..te import _compat as te
from ._model import written_drop_ins
from ._step_hook import Step, step_task

__all__ = ["HeldCopy", "held_copies", "refresh_parameter", "refresh_experts", "release_module", "is_per_tensor",
           "version_of", "copy_nbytes", "placement"]

#: The attribute a quantized weight's stamp lives in: ``(clock, version)``
#: when a drop-in last made sure its derived data is current.
STAMP = "_te_wm_fresh"


def is_per_tensor(tensor: Any) -> bool:
    """Per-tensor FP8's layout: rowwise ``_data``, a derived ``_transpose``
    and TE's flag that says whether the transpose is current."""
    return hasattr(tensor, "_transpose_invalid") and hasattr(tensor, "_data")


def refresh_parameter(weight: Any, writes: int) -> None:
    """The seams found ``weight``'s stamp older than its module's clock
    (``writes``) or its version: mark its derived transpose invalid, so that
    the next use derives it from the current data, and stamp it current."""
    if is_per_tensor(weight) and weight._data is not None:
        reset = getattr(type(weight), "_reset_caches", None)
        if reset is not None:
            reset(weight)  # TE's own invalidation (it keeps a columnwise-only tensor's data)
        else:
            weight._transpose_invalid = True
    setattr(weight, STAMP, (writes, version_of(weight)))


def version_of(tensor: Any) -> int:
    """``tensor``'s version counter, or 0 for a tensor that keeps none: an
    inference tensor (made under ``torch.inference_mode``), whose counter
    torch refuses to read. Such a tensor can change only inside inference
    mode, where nothing trains; the module's clock still moves at its steps."""
    try:
        return tensor._version
    except (AttributeError, RuntimeError):
        return 0


def refresh_experts(experts: tuple, writes: int) -> None:
    """:func:`refresh_parameter` for each expert whose stamp is old."""
    for weight in experts:
        if getattr(weight, STAMP, None) != (writes, version_of(weight)):
            refresh_parameter(weight, writes)


@dataclass(frozen=True)
class HeldCopy:
    """A quantized copy a TE module holds beyond its parameters' own data."""

    module: Any
    #: The parameter name, or the cache key (``weight``, ``weight0``, ``fc1_weight``...).
    weight: str
    #: ``cached`` (a workspace cache entry), ``transpose`` (a quantized
    #: parameter's derived transpose) or ``gathered_transpose`` (the same on
    #: the unsharded parameter FSDP2 keeps between all-gathers).
    kind: str
    tensor: Any


def held_copies(module: Any, gathered: list | None = None) -> Iterator[HeldCopy]:
    """Every quantized copy ``module`` holds: its cached workspaces, the
    derived transposes of its quantized parameters (the local shard's under
    FSDP2) and of the unsharded parameters FSDP2 keeps for it (``gathered``:
    ``fsdp2_gathered_parameters``'s list, found once per model). A
    transpose marked invalid still holds its buffer, so it is listed too."""
    for key, workspace in list(getattr(module, "_fp8_workspaces", {}).items()):
        if workspace is not None:
            yield HeldCopy(module, key, "cached", workspace)
    for name, param in module.named_parameters(recurse=False):
        local = getattr(param, "_local_tensor", param)
        if isinstance(local, te.QuantizedTensorStorage) and is_per_tensor(local) and local._transpose is not None \
                and local._data is not None:
            yield HeldCopy(module, name, "transpose", local)
    for owner, name, tensor in gathered or ():
        # FSDP2's tensor: its data is FSDP2's to free, a transpose is TE's.
        if owner is module and is_per_tensor(tensor) and tensor._transpose is not None:
            yield HeldCopy(module, name, "gathered_transpose", tensor)


@step_task("parameter_transposes")
def _refresh_written(step: Step) -> None:
    """At the step: the quantized parameters' transposes of the drop-ins the
    step wrote are made again from the data it just wrote (the next forward
    would mark them invalid; done now, no valid-flagged stale transpose
    exists between steps, and the parameter keeps the usages its plan says,
    ``parameter_keeps``). TE's transpose kernel writes into the existing
    buffer: no memory moves."""
    for _, written in written_drop_ins(step):
        for module in written:
            state = module._wm_state
            if state.holds_quantized:
                _refresh_parameters(module, state.writes)


def _refresh_parameters(module: Any, writes: int) -> None:
    for param in module._parameters.values():
        local = getattr(param, "_local_tensor", param)
        if not isinstance(local, te.QuantizedTensorStorage):
            continue
        kept = is_per_tensor(local) and local._transpose is not None and local._data is not None
        refresh_parameter(local, writes)
        if kept:
            local.update_usage(columnwise_usage=True)


def copy_nbytes(copy: HeldCopy) -> int:
    """Bytes that dropping ``copy`` lets go (a transpose, or a whole cache entry)."""
    if copy.kind == "cached":
        tensors = buffers_of(copy.tensor).values()
    else:
        tensors = [copy.tensor._transpose]
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors if t is not None}
    return sum(storages.values())


def _drop(copy: HeldCopy) -> int:
    nbytes = copy_nbytes(copy)
    if copy.kind == "cached":
        copy.module._fp8_workspaces.pop(copy.weight, None)
    else:
        te.clear_columnwise_cache(copy.tensor)  # TE derives it again where a GEMM needs it
    return nbytes


def release_module(module: Any, gathered: list | None = None) -> int:
    """Drop every quantized copy ``module`` holds (see :func:`held_copies`);
    returns the bytes dropped. A drop-in also forgets which cache entries
    it filled. Backward passes still pending keep what they saved."""
    released = sum(_drop(copy) for copy in list(held_copies(module, gathered)))
    state = getattr(module, "_wm_state", None)
    if state is not None:
        state.filled.clear()
    return released


def placement(module: Any) -> tuple:
    """Where ``module``'s own parameters live: ``_apply`` compares it."""
    return tuple((p.device, p.dtype) for p in module.parameters(recurse=False))
