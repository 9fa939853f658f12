"""A drop-in module call is one record: :class:`CallRecord`.

A drop-in's ``prepare_forward`` makes the record and pushes it on this
thread's stack of calls (:data:`ACTIVE`); its ``end_forward`` pops it. TE
calls both around exactly its own autograd Function (``module/linear.py``,
``layernorm_linear.py``, ``layernorm_mlp.py``: ``prepare_forward`` before
the ``try`` whose ``finally`` calls ``end_forward``), so the record is
popped after an exception too. Everything the seams learn or decide during
the call lives in the record and nowhere else: the sharding read for it,
each weight's levers, the cache entries it fills, the rowwise tensors
backward will not read. What backward must do afterwards goes on TE's
autograd ctx as a :class:`~te_integration.runtime._release.BackwardWork`, since
autograd may run backward on another thread, after the record is gone.

A TE module called before or after that window, inside a user subclass's
``forward`` (a LoRA adapter, say), finds no record of its own on top and is
planned as itself: stock TE for a stock module, its own plan for a drop-in.
Per thread, since autograd runs a recompute pass's forward on its own thread.
"""

from __future__ import annotations

import threading
from typing import Any

from workspace_manager import RecomputePass, Sharding

from ..te import _compat as te

__all__ = ["ACTIVE", "ANY_WEIGHT", "CallPart", "CallRecord", "GATHERED_WEIGHT", "new_record", "recompute_pass",
           "is_distributed", "refuse_reentry"]


class CallPart:
    """A module kind's own data for one call (:attr:`CallRecord.part`).

    A kind that needs more than the shared fields subclasses it in its own
    file; the shared seams read only the fields below, which are None
    unless the kind sets them, so a record of any kind answers them."""

    __slots__ = ()

    #: The call's weights that are quantized one by one under their own
    #: cache keys (GroupedLinear's experts), or None.
    experts: tuple | None = None
    #: Workspaces the ``quantize_weight`` seam collects for the kind
    #: (LayerNormMLP with FC1 and FC2 planned to save differently), or None.
    dropped: list | None = None
    #: ``quantize_all()``: every one of :attr:`experts` quantized at once (a
    #: list, or None where no grouped quantization is exact), for a call
    #: whose workspaces neither are cached nor outlive its forward
    #: (GroupedLinear under FSDP2's plan); the ``quantize_weight`` seam runs
    #: it at the call's first quantization and keeps the list in
    #: :attr:`quantized`. None: each expert is quantized on its own.
    quantize_all: Any = None
    quantized: list | None = None


class CallRecord:
    """One drop-in module call, from its ``prepare_forward`` to its ``end_forward``.

    Only what every kind shares; a kind's own data is :attr:`part`.
    :func:`new_record` sets every field; ``_modules.prepare_forward``, the
    hot path, sets the same fields inline (a Python ``__init__`` would be one
    call more per module call), and ``tests/unit/test_call_record.py``
    checks that both leave no field unset."""

    __slots__ = ("module", "state", "kind", "sharding", "previous", "weights", "pending", "rowwise_parts",
                 "pushed_by_seam", "run", "part")

    #: The drop-in module, its :class:`~te_integration.runtime._state.ModuleWorkspaceState` and :class:`ModuleKind`.
    module: Any
    state: Any
    kind: Any
    #: The module's sharding, read once for the call.
    sharding: Sharding
    #: The record below this one on the thread's stack (None at the bottom).
    previous: CallRecord | None
    #: The call's weights with their levers, flat: ``(tensor, levers, tensor, levers, ...)``.
    weights: tuple
    #: Cache entries this call filled, stored in the module's cache only once
    #: TE's forward returned (a failed call leaves the cache as it was); or None.
    pending: dict[str, Any] | None
    #: Rowwise tensors of fresh workspaces that backward will not read (to
    #: leave out of what the ctx saves, see ``_saved_tensors``); or None.
    rowwise_parts: list | None
    #: Pushed by a Function seam rather than by ``prepare_forward`` (the
    #: module's own recompute in backward, te.ops's fuser call), and so popped by it.
    pushed_by_seam: bool
    #: ``run(record, te_method, ctx, args)`` where running TE's method is more
    #: than calling it for this call (set by the adapter's ``begin``); or None.
    run: Any
    #: The kind's own data for this call (a :class:`CallPart`), or None.
    part: CallPart | None


def new_record(module: Any, state: Any, sharding: Sharding, previous: CallRecord | None,
               pushed_by_seam: bool = False) -> CallRecord:
    """A record with every field set (for the paths that are not per module call)."""
    record = CallRecord()
    record.module, record.state, record.kind, record.sharding = module, state, state.kind, sharding
    record.previous, record.weights, record.pending, record.rowwise_parts = previous, (), None, None
    record.pushed_by_seam, record.run, record.part = pushed_by_seam, None, None
    return record


class _ActiveCalls(threading.local):
    """This thread's stack of drop-in calls: ``record`` is the top (None:
    no drop-in's TE forward is running here); each record links to the
    one below. The hot paths read and write ``record`` directly: an
    attribute of a thread-local costs no Python call."""

    record: CallRecord | None = None

    def module(self) -> Any:
        """The module of the call on top, or None."""
        record = self.record
        return record.module if record is not None else None


ACTIVE = _ActiveCalls()

#: Stands for a distributed weight's slot in a call's weights: TE quantizes
#: the weight it gathered, a tensor the seams never see before.
GATHERED_WEIGHT = object()
#: Stands for every tensor the call quantizes, planned under one key
#: (GroupedLinear's experts; its part lists them for their cache keys).
ANY_WEIGHT = object()


def refuse_reentry(module: Any) -> None:
    """Raise if ``module`` is already in a call on this thread: a module
    called inside its own forward has no plan the binding could keep apart
    from the outer call's."""
    record = ACTIVE.record
    while record is not None:
        if record.module is module:
            raise RuntimeError(
                f"{type(module).__name__} was called inside its own forward (between its prepare_forward and "
                "end_forward). te_integration plans one call of a module at a time; call a separate module "
                "instance inside, or call this one after its forward returns."
            )
        record = record.previous


def recompute_pass() -> RecomputePass:
    """Where ``te.checkpoint`` says the call is. TE sets its flags only while
    FP8 is on, the only time a workspace exists. The hot paths ask only
    inside a recompute region (TE's ``_IN_ACTIVATION_RECOMPUTE_REGION``,
    read as an attribute)."""
    if not te.is_fp8_activation_recompute_enabled():
        return RecomputePass.NONE
    return RecomputePass.RECOMPUTE if te.in_fp8_activation_recompute_phase() else RecomputePass.FIRST


def is_distributed(weight: Any) -> bool:
    """A TE ``DistributedWeight``: TE's own check validates a flagged weight
    (the seams ask only for a flagged one: one getattr per call)."""
    return bool(getattr(weight, "is_distributed_weight", False)) and te.is_distributed_weight(weight)
