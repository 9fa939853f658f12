"""Who holds which quantized weight bytes in a TE model, and why.

Two sources feed a :class:`~workspace_manager.attribution.WorkspaceLedger`:

* the seams, while a recording covers the module: each workspace TE's
  ``quantize_weight`` returns, with the plan of the call (drop-in modules)
  or none (stock TE modules, observed through the same seam);
* inspection, whenever a report or a timeline point is taken: each TE
  module's workspace cache, and the columnwise data (and, under FSDP2, the
  gathered data) of its quantized parameters.

Each recording (:func:`record_workspaces`) keeps its own ledger and the
names of its model's modules, and takes an "optimizer step" point only at a
step that wrote its model's parameters; recordings of different models may
run at once. A report outside any recording inspects into a ledger of its
own. The process keeps only the list of the recordings active now
(:data:`ACTIVE_RECORDINGS`), through which the seams find the one covering
a module: empty, it is the one test the seams make.

Backward rebuilds happen inside TE's backward and are freed before it
returns; they are not observed (docs/te-integration.md).
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from workspace_manager import Usage
from workspace_manager.attribution import workspace_kind, WorkspaceKind, WorkspaceLedger, WorkspaceReport
from workspace_manager.extending import detect_fsdp2_sharding, fsdp2_parameters
from workspace_manager.gather import ShardGatherWeight

from ..te import _compat as te
from ._argument_checks import expect_bool, expect_module
from ._kind_registry import adapters
from ._step_hook import Step, ensure_hook, step_task

__all__ = ["workspace_report", "record_workspaces", "WorkspaceRecording", "ACTIVE_RECORDINGS"]


def _allocated() -> int | None:
    return torch.cuda.memory_allocated() if torch.cuda.is_available() else None


#: The recordings active now (a registry: each recording adds itself while
#: its block runs). Changed in place only, so the seams' ``if
#: ACTIVE_RECORDINGS:`` reads the same list wherever it was imported.
ACTIVE_RECORDINGS: list[WorkspaceRecording] = []
#: The TE module whose forward is running (set by the recording's hooks).
_CURRENT: contextvars.ContextVar[Any] = contextvars.ContextVar("te_wm_observed_module", default=None)


def recording_of(module: Any) -> WorkspaceRecording | None:
    """The active recording covering ``module``, or None."""
    for recording in ACTIVE_RECORDINGS:
        if id(module) in recording.module_ids:
            return recording
    return None


def _name_in(names: dict[int, str], module: Any) -> str:
    return names.get(id(module)) or f"{type(module).__name__}@{id(module):x}"


def _plan_of(module: Any, key: str) -> Any:
    state = getattr(module, "_wm_state", None)
    if state is None:
        return None
    return state.plan_of(key) or state.plan_of("weight")


def _weight_name(module: Any, tensor: Any) -> str:
    for name, param in module.named_parameters(recurse=False):
        if param is tensor:
            return name
    return "weight"


# -- the seams' side (called only while ACTIVE_RECORDINGS is not empty) --------------
def forward_workspace(module: Any, key: str | None, plan: Any, workspace: Any, *, from_cache: bool,
                      weight: Any = None) -> None:
    """A workspace ``quantize_weight`` returned for ``weight``. ``plan``
    None: a stock module (the one whose forward the recording's hooks saw start)."""
    owner = module if module is not None else _CURRENT.get()
    if owner is None or not isinstance(workspace, te.QuantizedTensorStorage):
        return
    recording = recording_of(owner)
    if recording is None:
        return
    if plan is None:
        kind = WorkspaceKind.CACHED if from_cache else WorkspaceKind.UNPLANNED
        key = key or _weight_name(owner, weight)
    else:
        kind = workspace_kind(plan, from_cache=from_cache)
    recording.ledger.record(owner, recording.name(owner), key, kind, plan, workspace)


def current_module() -> Any:
    return _CURRENT.get()


def tag(ctx: Any, module: Any) -> None:
    """Remember on the autograd ctx which module's backward it is."""
    if module is not None:
        ctx._te_wm_owner = weakref.ref(module)


def marks_backward(ctx: Any) -> bool:
    """Whether a recording may want timeline points around ``ctx``'s backward."""
    return bool(ACTIVE_RECORDINGS) and getattr(ctx, "_te_wm_owner", None) is not None


def backward_mark(ctx: Any, phase: str) -> None:
    ref = getattr(ctx, "_te_wm_owner", None)
    module = ref() if ref is not None else None
    recording = recording_of(module) if module is not None else None
    if recording is not None:
        recording.mark(f"backward {phase}", "backward", module)


# -- inspection -------------------------------------------------------------------
def inspect_module(module: Any, ledger: WorkspaceLedger, name: str, records: list = ()) -> None:
    """Record in ``ledger`` what ``module`` (called ``name``) holds now:
    cached workspaces and the non-parameter data of its quantized
    parameters: those it registers, and those FSDP2 keeps for it but it does
    not register now (``records``: ``fsdp2_parameters``'s list, found once
    per model): the shards while FSDP2 has the unsharded parameters in
    their place, the unsharded parameters after the reshard (a prefetched
    gather, a transpose TE kept)."""
    for key, ws in list(getattr(module, "_fp8_workspaces", {}).items()):
        plan = _plan_of(module, key)
        ledger.record(module, name, key, WorkspaceKind.CACHED, plan, ws)
    registered = set()
    for pname, param in module.named_parameters(recurse=False):
        registered.add(id(param))
        _record_parameter(ledger, module, name, pname, param)
    for record in records:
        if record.module is not module:
            continue
        for tensor in (record.sharded, record.unsharded):
            if tensor is not None and id(tensor) not in registered:
                _record_parameter(ledger, module, name, record.name, tensor, fsdp2=True)


def _record_parameter(ledger: WorkspaceLedger, module: Any, name: str, pname: str, param: Any,
                      fsdp2: bool | None = None) -> None:
    local = getattr(param, "_local_tensor", param)
    if isinstance(local, ShardGatherWeight):
        _record_quantized_shard(ledger, module, name, pname, local)
        return
    if not isinstance(local, te.QuantizedTensorStorage):
        return
    plan = _plan_of(module, pname) or _parameter_plan(module, local)
    if local is not param:  # a shard
        ledger.record(module, name, pname, WorkspaceKind.PARAMETER_COLUMNWISE, plan, local,
                      usage=Usage.COLUMNWISE, sharded=True)
        return
    _record_unsharded(ledger, module, name, pname, plan, local,
                      fsdp2=_sharding(module).is_fsdp2 if fsdp2 is None else fsdp2)


def _record_quantized_shard(ledger: WorkspaceLedger, module: Any, name: str, pname: str, local: Any) -> None:
    """The quantized shard a high-precision shard's all-gather sends (D13), while it is held."""
    shard = local._link.shard
    if shard is not None:
        ledger.record(module, name, pname, WorkspaceKind.QUANTIZED_SHARD, _plan_of(module, pname), shard,
                      usage=Usage.ROWWISE, sharded=True,
                      decision="made from the shard at the optimizer step; its all-gather sends it (D13)")


def _record_unsharded(ledger: WorkspaceLedger, module: Any, name: str, pname: str, plan: Any, tensor: Any, *,
                      fsdp2: bool) -> None:
    if fsdp2:  # its rowwise data is FSDP2's all-gather output
        ledger.record(module, name, pname, WorkspaceKind.GATHERED, plan, tensor, usage=Usage.ROWWISE)
    ledger.record(module, name, pname, WorkspaceKind.PARAMETER_COLUMNWISE, plan, tensor, usage=Usage.COLUMNWISE)


def _parameter_plan(module: Any, local: Any) -> Any:
    """A drop-in's plan for a training call on its quantized parameter, for
    inspections made before the module's first forward (stock: None)."""
    if not hasattr(module, "_wm_kind"):
        return None
    from ._shards import parameter_plan

    return parameter_plan(module, local._quantizer)


def _sharding(module: Any) -> Any:
    if hasattr(module, "_wm_kind"):
        from ._state import state_of

        return state_of(module).sharding(module)
    return detect_fsdp2_sharding(module)


def te_modules(model: torch.nn.Module) -> list[tuple[str, Any]]:
    """``(path, module)`` of every module of ``model`` that is an instance
    of a registered kind's TE class (stock or drop-in: drop-ins subclass it)."""
    classes = tuple(adapter.te_class for adapter in adapters())
    return [(n, m) for n, m in model.named_modules() if isinstance(m, classes)]


def workspace_report(model: torch.nn.Module) -> WorkspaceReport:
    """What quantized weight copies ``model``'s TE modules hold now, per
    module and in total, with the plan behind each.

    Cached workspaces and quantized-parameter data are found by inspection
    at any time; workspaces saved for backward appear only while recording
    (:func:`record_workspaces`), since only the seams see them made.
    ``print(report)`` gives a table; ``report.as_dict()`` the same for programs.
    A model without TE modules gives an empty report.
    """
    expect_module("workspace_report", "model", model)
    modules = te_modules(model)
    recording = next((r for r in map(recording_of, (m for _, m in modules)) if r is not None), None)
    # While a recording covers the model, its ledger also holds what the seams saw.
    ledger = recording.ledger if recording is not None else WorkspaceLedger(allocated=_allocated)
    return _report(ledger, modules, model)


def _report(ledger: WorkspaceLedger, modules: list[tuple[str, Any]], model: torch.nn.Module) -> WorkspaceReport:
    records = fsdp2_parameters(model)
    for fqn, module in modules:
        inspect_module(module, ledger, fqn or type(module).__name__, records)
    return WorkspaceReport(tuple(ledger.live([m for _, m in modules])))


class WorkspaceRecording:
    """An active recording over one model: its ledger, timeline and reports."""

    def __init__(self, model: torch.nn.Module, timeline: bool) -> None:
        self.model = model
        named = te_modules(model)
        self.modules = [m for _, m in named]
        #: ``id``s of the recorded modules (what the seams test).
        self.module_ids = frozenset(map(id, self.modules))
        self._names = {id(m): fqn or type(m).__name__ for fqn, m in named}
        self.ledger = WorkspaceLedger(allocated=_allocated)
        self.ledger.enabled = True
        self.timeline_on = timeline
        self.timeline: list = []

    def name(self, module: Any) -> str:
        """``module``'s path in the recorded model."""
        return _name_in(self._names, module)

    def mark(self, label: str, phase: str = "", module: Any = None) -> None:
        """Add a timeline point now (the hooks add one at each TE module's
        forward and backward boundary; call it for others, e.g. "step end")."""
        if not self.timeline_on:
            return
        records = fsdp2_parameters(self.model)
        for m in self.modules:
            inspect_module(m, self.ledger, self.name(m), records)
        label_module = self.name(module) if module is not None else ""
        self.timeline.append(self.ledger.snapshot(label, phase, label_module, self.modules))

    def wrote(self, step: Step) -> bool:
        """Whether ``step`` wrote a parameter of the recorded model (its TE
        modules' own, directly or through FSDP2's sharded ones)."""
        if step.everything:
            return True
        sources = [id(p) for m in self.modules for p in m._parameters.values() if p is not None]
        sources.extend(id(r.sharded) for r in fsdp2_parameters(self.model) if id(r.module) in self.module_ids)
        return step.wrote_any(sources)

    def report(self) -> WorkspaceReport:
        """What the recorded model's TE modules hold now, with what the
        seams saw made while the block ran (also after it ended: a
        workspace saved for a backward and still alive is a leftover)."""
        return _report(self.ledger, [(self.name(m), m) for m in self.modules], self.model)

    def timeline_dicts(self) -> list[dict]:
        return [p.as_dict() for p in self.timeline]


def record_workspaces(model: torch.nn.Module, *, timeline: bool = True) -> contextlib.AbstractContextManager:
    """Record every workspace ``model``'s TE modules (drop-in or stock) make
    while the block runs; with ``timeline``, a point at each forward and
    backward boundary and at each optimizer step that writes the model's
    parameters. Off by default: outside this block the seams test one list
    per call. Recordings of different models may be active at once; a
    module is in one at a time. Arguments are checked at the call; a model
    without TE modules records nothing."""
    expect_module("record_workspaces", "model", model)
    expect_bool("record_workspaces", "timeline", timeline)
    return _recording(model, timeline)


@contextlib.contextmanager
def _recording(model: torch.nn.Module, timeline: bool) -> Iterator[WorkspaceRecording]:
    recording = WorkspaceRecording(model, timeline)
    shared = [r.module_ids & recording.module_ids for r in ACTIVE_RECORDINGS]
    shared = [ids for ids in shared if ids]
    if shared:
        raise RuntimeError(f"record_workspaces is already active over {len(shared[0])} of this model's TE modules; "
                           "recordings of one module do not nest (record another model, or end the other block first)")
    handles = [h for m in recording.modules for h in _hooks(m, recording)]
    ensure_hook()  # the binding's one optimizer-step hook takes the step points
    ACTIVE_RECORDINGS.append(recording)
    try:
        yield recording
    finally:
        ACTIVE_RECORDINGS.remove(recording)
        recording.ledger.enabled = False
        for h in handles:
            h.remove()


@step_task("recording_point")
def _step_point(step: Step) -> None:
    """A timeline point in each recording whose model the step wrote."""
    for recording in list(ACTIVE_RECORDINGS):
        if recording.wrote(step):
            recording.mark("optimizer step", "step")
            recording.ledger.next_step()


def _hooks(module: Any, recording: WorkspaceRecording) -> list:
    tokens: list = []

    def pre(mod, args, kwargs=None):
        tokens.append(_CURRENT.set(mod))
        recording.mark("forward start", "forward", mod)

    def post(mod, args, output):
        if tokens:
            _CURRENT.reset(tokens.pop())
        recording.mark("forward end", "forward", mod)

    return [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
