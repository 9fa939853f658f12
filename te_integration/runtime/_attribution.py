"""Who holds which quantized weight bytes in a TE model, and why.

Two sources feed one :class:`~workspace_manager.WorkspaceLedger`:

* the seams, while recording is on: each workspace TE's ``quantize_weight``
  returns, with the plan of the call (drop-in modules) or none (stock TE
  modules, observed through the same seam);
* inspection, whenever a report or a timeline point is taken: each TE
  module's workspace cache, and the columnwise data (and, under FSDP2, the
  gathered data) of its quantized parameters.

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

from workspace_manager import (
    Usage,
    WorkspaceKind,
    WorkspaceLedger,
    WorkspaceReport,
    detect_fsdp2_sharding,
    workspace_kind,
)

from ..te import _compat as te
from ._step_hook import add_step_task, ensure_hook
from ._argument_checks import expect_bool, expect_module
from ._registry import adapters

__all__ = ["workspace_report", "record_workspaces", "WorkspaceRecording"]


def _allocated() -> int | None:
    return torch.cuda.memory_allocated() if torch.cuda.is_available() else None


#: The ledger the seams record into.
LEDGER = WorkspaceLedger(allocated=_allocated)
_NAMES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
#: The TE module whose forward is running (set by the recording's hooks).
_CURRENT: contextvars.ContextVar[Any] = contextvars.ContextVar("te_wm_observed_module", default=None)


def _name(module: Any) -> str:
    return _NAMES.get(module) or f"{type(module).__name__}@{id(module):x}"


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


# -- the seams' side (called only while LEDGER.enabled) ------------------------------
def forward_workspace(module: Any, key: str | None, plan: Any, workspace: Any, *, from_cache: bool,
                      weight: Any = None) -> None:
    """A workspace ``quantize_weight`` returned for ``weight``. ``plan``
    None: a stock module (the one whose forward the recording's hooks saw start)."""
    owner = module if module is not None else _CURRENT.get()
    if owner is None or not isinstance(workspace, te.QuantizedTensorStorage):
        return
    if plan is None:
        kind = WorkspaceKind.CACHED if from_cache else WorkspaceKind.UNPLANNED
        key = key or _weight_name(owner, weight)
    else:
        kind = workspace_kind(plan, from_cache=from_cache)
    LEDGER.record(owner, _name(owner), key, kind, plan, workspace)


def current_module() -> Any:
    return _CURRENT.get()


def tag(ctx: Any, module: Any) -> None:
    """Remember on the autograd ctx which module's backward it is."""
    if module is not None:
        ctx._te_wm_owner = weakref.ref(module)


def marks_backward(ctx: Any) -> bool:
    """Whether a recording wants timeline points around ``ctx``'s backward
    (one global read when no recording is active)."""
    return _RECORDING is not None and getattr(ctx, "_te_wm_owner", None) is not None


def backward_mark(ctx: Any, phase: str) -> None:
    ref = getattr(ctx, "_te_wm_owner", None)
    module = ref() if ref is not None else None
    if module is not None and _RECORDING is not None:
        _RECORDING.mark(f"backward {phase}", "backward", module)


# -- inspection -------------------------------------------------------------------
def inspect_module(module: Any) -> None:
    """Record what ``module`` holds now: cached workspaces and the
    non-parameter data of its quantized parameters."""
    name = _name(module)
    for key, ws in list(getattr(module, "_fp8_workspaces", {}).items()):
        plan = _plan_of(module, key)
        LEDGER.record(module, name, key, WorkspaceKind.CACHED, plan, ws)
    for pname, param in module.named_parameters(recurse=False):
        local = getattr(param, "_local_tensor", param)
        if not isinstance(local, te.QuantizedTensorStorage):
            continue
        plan = _plan_of(module, pname) or _parameter_plan(module, local)
        sharded = local is not param
        if sharded:
            LEDGER.record(module, name, pname, WorkspaceKind.PARAMETER_COLUMNWISE, plan, local,
                          usage=Usage.COLUMNWISE, sharded=True)
            continue
        if _sharding(module).is_fsdp2:
            LEDGER.record(module, name, pname, WorkspaceKind.GATHERED, plan, local, usage=Usage.ROWWISE)
        LEDGER.record(module, name, pname, WorkspaceKind.PARAMETER_COLUMNWISE, plan, local, usage=Usage.COLUMNWISE)


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
    for fqn, module in modules:
        _NAMES[module] = fqn or type(module).__name__
        inspect_module(module)
    return WorkspaceReport(tuple(LEDGER.live([m for _, m in modules])))


_RECORDING: WorkspaceRecording | None = None


class WorkspaceRecording:
    """An active recording over one model: its timeline and reports."""

    def __init__(self, model: torch.nn.Module, timeline: bool) -> None:
        self.model = model
        self.modules = [m for _, m in te_modules(model)]
        self.timeline_on = timeline
        self.timeline: list = []

    def mark(self, label: str, phase: str = "", module: Any = None) -> None:
        """Add a timeline point now (the hooks add one at each TE module's
        forward and backward boundary; call it for others, e.g. "step end")."""
        if not self.timeline_on:
            return
        for m in self.modules:
            inspect_module(m)
        self.timeline.append(LEDGER.snapshot(label, phase, _name(module) if module is not None else "", self.modules))

    def report(self) -> WorkspaceReport:
        return workspace_report(self.model)

    def timeline_dicts(self) -> list[dict]:
        return [p.as_dict() for p in self.timeline]


def record_workspaces(model: torch.nn.Module, *, timeline: bool = True) -> contextlib.AbstractContextManager:
    """Record every workspace ``model``'s TE modules (drop-in or stock) make
    while the block runs; with ``timeline``, a point at each forward and
    backward boundary and at each optimizer step. Off by default: outside
    this block the seams do one attribute check per call. Arguments are
    checked at the call; a model without TE modules records nothing."""
    expect_module("record_workspaces", "model", model)
    expect_bool("record_workspaces", "timeline", timeline)
    return _recording(model, timeline)


@contextlib.contextmanager
def _recording(model: torch.nn.Module, timeline: bool) -> Iterator[WorkspaceRecording]:
    global _RECORDING
    if _RECORDING is not None:
        raise RuntimeError("record_workspaces is already active; recordings do not nest")
    recording = WorkspaceRecording(model, timeline)
    for fqn, module in te_modules(model):
        _NAMES[module] = fqn or type(module).__name__
    handles = [h for m in recording.modules for h in _hooks(m, recording)]
    ensure_hook()  # the binding's one optimizer-step hook calls _step_point
    _RECORDING, LEDGER.enabled = recording, True
    try:
        yield recording
    finally:
        _RECORDING, LEDGER.enabled = None, False
        for h in handles:
            h.remove()


def _step_point(stepped: list) -> None:
    if _RECORDING is not None:
        _RECORDING.mark("optimizer step", "step")
        LEDGER.next_step()


add_step_task(_step_point)


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
