"""Workspace attribution: which quantized weight copies are alive, where, and why.

A binding records each workspace it sees (module path, weight, kind, the
plan behind it) in a :class:`WorkspaceLedger`. The ledger never holds a
workspace: it keeps weak references to the storages of its buffers, so an
entry is alive exactly as long as the memory is, whoever holds it (a cache,
autograd's saved tensors, FSDP2). A storage shared by two entries counts
once.

The pure questions are answered here, without TE:

* :func:`workspace_kind`: what kind of holder a forward workspace has;
* :func:`expected_lifetime`: until when its plan says it may live;
* :func:`buffers_of`: the plain tensors a quantized tensor is made of,
  split by direction.

``te_integration`` records into the default ledger and builds reports and
timelines from it (``workspace_report``, ``record_workspaces``).
"""

from __future__ import annotations

import enum
import itertools
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .._errors import ContextTypeError
from .._plan import BackwardSource, CacheAction, Release, Usage, WorkspacePlan

__all__ = [
    "WorkspaceKind",
    "Lifetime",
    "WorkspaceRecord",
    "LiveWorkspace",
    "TimelinePoint",
    "WorkspaceLedger",
    "WorkspaceReport",
    "workspace_kind",
    "expected_lifetime",
    "buffers_of",
]


class WorkspaceKind(enum.Enum):
    """Who holds a quantized copy of a weight."""

    #: In the module's workspace cache (``_fp8_workspaces``).
    CACHED = "cached"
    #: Made in forward and saved on the autograd graph for backward.
    SAVED_FOR_BACKWARD = "saved for backward"
    #: Made in forward for the forward GEMM only.
    FORWARD_ONLY = "forward only"
    #: Columnwise data (an FP8 transpose, columnwise blocks) on a quantized
    #: parameter, derived or kept by the parameter itself.
    PARAMETER_COLUMNWISE = "columnwise on a quantized parameter"
    #: The rowwise data of a quantized parameter FSDP2 gathered: FSDP2's
    #: all-gather output, freed by FSDP2 when it reshards.
    GATHERED = "FSDP2 gathered"
    #: A rank's quantized FSDP2 shard of a high-precision weight whose
    #: all-gather sends it (docs/decisions.md, D13): made at the optimizer
    #: step, held until the weight is written again.
    QUANTIZED_SHARD = "quantized FSDP2 shard"
    #: Made by a module the manager does not plan (stock TE): seen, not planned.
    UNPLANNED = "unplanned"


class Lifetime(enum.Enum):
    """Until when a plan lets a workspace live."""

    CALL = "until the forward call returns"
    BACKWARD = "until the call's backward"
    STEP = "until the optimizer step"
    KEPT = "kept across steps"
    FSDP2 = "until FSDP2 reshards"
    UNPLANNED = "not planned"

    @property
    def ends_by_step(self) -> bool:
        """Alive after the optimizer step means the plan was not carried out."""
        return self in (Lifetime.CALL, Lifetime.BACKWARD, Lifetime.STEP)


def workspace_kind(plan: WorkspacePlan, *, from_cache: bool) -> WorkspaceKind:
    """The holder of a high-precision weight's forward workspace under ``plan``.

    A workspace the cache holds outlives the call's backward, so it is
    ``CACHED`` even when backward also reads it.
    """
    if from_cache or plan.cache in (CacheAction.FILL, CacheAction.REUSE):
        return WorkspaceKind.CACHED
    if plan.backward_source is BackwardSource.SAVED_WORKSPACE:
        return WorkspaceKind.SAVED_FOR_BACKWARD
    return WorkspaceKind.FORWARD_ONLY


def expected_lifetime(kind: WorkspaceKind, plan: WorkspacePlan | None, *, sharded: bool = False) -> Lifetime:
    """How long ``plan`` lets a workspace of ``kind`` live. ``sharded``: the
    workspace is on an FSDP2 shard (not on a gathered parameter)."""
    if plan is None or kind is WorkspaceKind.UNPLANNED:
        return Lifetime.UNPLANNED
    if kind is WorkspaceKind.CACHED:
        return Lifetime.STEP if Release.CACHED_WORKSPACE in plan.release else Lifetime.KEPT
    if kind is WorkspaceKind.SAVED_FOR_BACKWARD:
        return Lifetime.BACKWARD
    if kind is WorkspaceKind.FORWARD_ONLY:
        return Lifetime.CALL
    if kind is WorkspaceKind.GATHERED:
        return Lifetime.FSDP2
    if kind is WorkspaceKind.QUANTIZED_SHARD:
        return Lifetime.KEPT  # made again at each step that writes the weight
    return _parameter_columnwise_lifetime(plan, sharded)


def _parameter_columnwise_lifetime(plan: WorkspacePlan, sharded: bool) -> Lifetime:
    if sharded:
        # The shard keeps what parameter_keeps says; the rest is trimmed at
        # the optimizer step.
        return Lifetime.KEPT if Usage.COLUMNWISE in plan.parameter_keeps else Lifetime.STEP
    if Release.DERIVED_COLUMNWISE in plan.release:
        return Lifetime.BACKWARD
    return Lifetime.KEPT


def buffers_of(quantized: Any) -> dict[str, Any]:
    """The plain tensors ``quantized`` is made of, by attribute name.

    Quantized tensors keep their data, scales and transposes as tensor
    attributes (TE: ``_data``, ``_transpose``, ``_rowwise_data``,
    ``_columnwise_scale_inv``...; the testing kit's reference quantizer:
    ``rowwise``, ``columnwise``, ``scale``). Nested quantized tensors and
    tensor subclasses are not buffers.
    """
    import torch

    plain = (torch.Tensor, torch.nn.Parameter)
    attrs = getattr(quantized, "__dict__", {})
    return {name: value for name, value in attrs.items() if type(value) in plain}


def is_scale(name: str) -> bool:
    """Scales and amaxes describe data; they may be shared with longer-lived
    tensors (FSDP2 hands a shard's scale to the gathered parameter), so they
    count only while data of their workspace is alive."""
    lowered = name.lower()
    return "scale" in lowered or "amax" in lowered


def direction_of(name: str) -> Usage:
    """The direction a buffer serves, from its attribute name. Shared
    scales count as rowwise: they exist as long as any data does."""
    lowered = name.lower()
    return Usage.COLUMNWISE if ("columnwise" in lowered or "transpose" in lowered) else Usage.ROWWISE


@dataclass(frozen=True)
class WorkspaceRecord:
    """One workspace as recorded: what it is and why it exists."""

    module: str
    weight: str
    kind: WorkspaceKind
    lifetime: Lifetime
    decision: str
    """The plan that made it (``WorkspacePlan.summary()``), or why none applies."""
    step: int
    seq: int


@dataclass(frozen=True)
class LiveWorkspace:
    """A recorded workspace with what of it is alive now."""

    record: WorkspaceRecord
    usage: Usage
    nbytes: int

    @property
    def leftover(self) -> bool:
        return self.record.lifetime.ends_by_step

    def as_dict(self) -> dict[str, Any]:
        r = self.record
        return {"module": r.module, "weight": r.weight, "kind": r.kind.value, "usage": self.usage.label,
                "bytes": self.nbytes, "lifetime": r.lifetime.value, "decision": r.decision, "step": r.step}


@dataclass(frozen=True)
class TimelinePoint:
    """Live workspace bytes at one forward/backward boundary."""

    label: str
    phase: str
    module: str
    by_module: Mapping[str, int]
    allocated: int | None

    @property
    def total(self) -> int:
        return sum(self.by_module.values())

    def as_dict(self) -> dict[str, Any]:
        return {"label": self.label, "phase": self.phase, "module": self.module, "by_module": dict(self.by_module),
                "total_bytes": self.total, "allocated_bytes": self.allocated}


@dataclass
class _Buffer:
    ref: Any  # a weak reference to the storage
    nbytes: int
    usage: Usage
    is_data: bool


@dataclass
class _Tracked:
    record: WorkspaceRecord
    buffers: dict[int, _Buffer] = field(default_factory=dict)
    owner: Callable[[], Any] = lambda: None  # the module, weakly

    def live(self) -> tuple[Usage, int, list[int]]:
        """What is alive: nothing once no data buffer is (scales alone do not
        keep a workspace alive)."""
        alive = [(k, b, n) for k, b in self.buffers.items() if (n := _current_nbytes(b))]
        if not any(b.is_data for _, b, _ in alive):
            return Usage.NONE, 0, []
        usage = Usage.NONE
        for _, b, _ in alive:
            usage |= b.usage
        return usage, sum(n for _, _, n in alive), [k for k, _, _ in alive]


def _check_record_arguments(kind: Any, plan: Any, usage: Any) -> None:
    expected = (("kind", kind, WorkspaceKind, "WorkspaceKind.SAVED_FOR_BACKWARD"),
                ("usage", usage, Usage, "Usage.BOTH"))
    for name, value, cls, example in expected:
        if not isinstance(value, cls):
            raise ContextTypeError(f"WorkspaceLedger.record: {name} must be a {cls.__name__} (e.g. {example}); "
                                   f"received {value!r} ({type(value).__name__})")
    if plan is not None and not isinstance(plan, WorkspacePlan):
        raise ContextTypeError("WorkspaceLedger.record: plan must be a WorkspacePlan (from policy.plan(ctx)) or None "
                               f"for a workspace no policy planned; received {plan!r} ({type(plan).__name__})")


def _current_nbytes(buf: _Buffer) -> int:
    """The storage's size now: 0 once it is freed, and also once it is
    resized to nothing (how FSDP2 frees a gathered parameter while the
    storage object lives on)."""
    if buf.ref.expired():
        return 0
    import torch

    revive = getattr(torch.UntypedStorage, "_new_with_weak_ptr", None)
    if revive is None:  # a torch without it: the size when recorded
        return buf.nbytes
    storage = revive(buf.ref.cdata)
    return 0 if storage is None else storage.nbytes()


class WorkspaceLedger:
    """Every workspace recorded, as weak references to its storages.

    ``enabled`` is read by bindings before they record anything (off by
    default, so that a step with recording off runs one attribute check
    per call); :meth:`record` itself always records, so reports can add
    what they find by inspection. ``allocated`` returns the device's
    allocated bytes for timeline points (None where there is no device).
    """

    def __init__(self, allocated: Callable[[], int | None] = lambda: None) -> None:
        self.enabled = False
        self.step = 0
        self.timeline: list[TimelinePoint] = []
        self._allocated = allocated
        self._tracked: list[_Tracked] = []
        self._by_storage: dict[int, _Tracked] = {}
        self._seq = itertools.count()
        self._lock = threading.Lock()

    def record(self, owner: Any, module: str, weight: str, kind: WorkspaceKind, plan: WorkspacePlan | None,
               quantized: Any, *, usage: Usage = Usage.BOTH, sharded: bool = False,
               decision: str | None = None) -> WorkspaceRecord | None:
        """Record the buffers of ``quantized`` serving ``usage``. Storages
        already attributed to a live entry are not counted again; returns
        None when nothing new was recorded."""
        from torch.multiprocessing.reductions import StorageWeakRef

        _check_record_arguments(kind, plan, usage)
        wanted = [(n, t) for n, t in buffers_of(quantized).items() if direction_of(n) & usage]
        with self._lock:
            self._prune()
            fresh: dict[int, _Buffer] = {}
            for name, tensor in wanted:
                storage = tensor.untyped_storage()
                key = storage._cdata
                if key in self._by_storage or key in fresh or storage.nbytes() == 0:
                    continue
                fresh[key] = _Buffer(StorageWeakRef(storage), storage.nbytes(), direction_of(name), not is_scale(name))
            if not any(b.is_data for b in fresh.values()):
                return None
            record = WorkspaceRecord(
                module=module, weight=weight, kind=kind, lifetime=expected_lifetime(kind, plan, sharded=sharded),
                decision=decision or (plan.summary() if plan is not None else "no plan: stock TE"),
                step=self.step, seq=next(self._seq),
            )
            tracked = _Tracked(record, fresh, _owner_ref(owner))
            self._tracked.append(tracked)
            self._by_storage.update(dict.fromkeys(fresh, tracked))
            return record

    def live(self, owners: Iterable[Any] | None = None) -> list[LiveWorkspace]:
        """What is alive now (of ``owners``' workspaces, or all)."""
        wanted = None if owners is None else {id(o) for o in owners}
        out = []
        with self._lock:
            self._prune()
            for tracked in self._tracked:
                if wanted is not None and id(tracked.owner()) not in wanted:
                    continue
                usage, nbytes, _ = tracked.live()
                out.append(LiveWorkspace(tracked.record, usage, nbytes))
        return out

    def snapshot(self, label: str, phase: str, module: str = "", owners: Iterable[Any] | None = None) -> TimelinePoint:
        """Live bytes per module now, as a timeline point (not stored)."""
        by_module: dict[str, int] = {}
        for entry in self.live(owners):
            by_module[entry.record.module] = by_module.get(entry.record.module, 0) + entry.nbytes
        return TimelinePoint(label, phase, module, by_module, self._allocated())

    def mark(self, label: str, phase: str, module: str = "", owners: Iterable[Any] | None = None) -> TimelinePoint:
        """Add a :meth:`snapshot` to ``timeline``."""
        point = self.snapshot(label, phase, module, owners)
        self.timeline.append(point)
        return point

    def next_step(self) -> None:
        self.step += 1

    def clear(self) -> None:
        """Forget every entry and timeline point (the workspaces stay as they are)."""
        with self._lock:
            self._tracked, self._by_storage, self.timeline = [], {}, []

    def _prune(self) -> None:
        """Forget entries whose data is gone or whose module is gone, and
        storages no longer alive (their addresses may be reused)."""
        kept = []
        for tracked in self._tracked:
            _, _, alive = tracked.live()
            keep = bool(alive) and tracked.owner() is not None
            for key in tracked.buffers:
                if not (keep and key in alive) and self._by_storage.get(key) is tracked:
                    del self._by_storage[key]
            if keep:
                tracked.buffers = {k: tracked.buffers[k] for k in alive}
                kept.append(tracked)
        self._tracked = kept

_UNOWNED = object()


def _owner_ref(owner: Any) -> Callable[[], Any]:
    """A weak reference to the module an entry belongs to; the entry goes
    with its module."""
    import weakref

    if owner is None:
        return lambda: _UNOWNED
    try:
        return weakref.ref(owner)
    except TypeError:  # an owner that cannot be weakly referenced is kept as is
        return lambda: owner


@dataclass(frozen=True)
class WorkspaceReport:
    """What is alive now, per module and in total, with the plan behind each entry."""

    entries: tuple[LiveWorkspace, ...]

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    @property
    def leftovers(self) -> tuple[LiveWorkspace, ...]:
        """Entries alive although their plan said they end by the optimizer
        step. Meaningful after a step (during one, saved workspaces are
        legitimately alive)."""
        return tuple(e for e in self.entries if e.leftover)

    def by_module(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for e in self.entries:
            out[e.record.module] = out.get(e.record.module, 0) + e.nbytes
        return out

    def by_kind(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for e in self.entries:
            out[e.record.kind.value] = out.get(e.record.kind.value, 0) + e.nbytes
        return out

    def as_dict(self) -> dict[str, Any]:
        return {"total_bytes": self.total_bytes, "by_module": self.by_module(), "by_kind": self.by_kind(),
                "leftovers": [e.as_dict() for e in self.leftovers], "entries": [e.as_dict() for e in self.entries]}

    def table(self) -> str:
        """A plain-text table, one row per workspace, then totals per module."""
        head = ("module", "weight", "kind", "usage", "KiB", "lifetime", "plan")
        rows = [(e.record.module, e.record.weight, e.record.kind.value, e.usage.label, f"{e.nbytes / 1024:.1f}",
                 e.record.lifetime.value + (" (LEFTOVER)" if e.leftover else ""), e.record.decision)
                for e in sorted(self.entries, key=lambda e: (e.record.module, e.record.weight, e.record.seq))]
        rows += [(m, "", "total", "", f"{b / 1024:.1f}", "", "") for m, b in sorted(self.by_module().items())]
        rows.append(("all modules", "", "total", "", f"{self.total_bytes / 1024:.1f}", "",
                     f"{len(self.leftovers)} leftover(s)"))
        widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
        lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in [head, *rows]]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()
