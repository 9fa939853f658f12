"""One model's workspace state: :class:`ModelWorkspaceState`.

FSDP2 keeps one ``FSDPStateContext`` per root module, shared by every
FSDP2 state below it; the binding keeps one :class:`ModelWorkspaceState` per
model, pointed at by every drop-in's
:class:`~te_integration.runtime._state.ModuleWorkspaceState`. It holds what
belongs to the model rather than to one module: its drop-ins, the cache
entries they marked for release at the model's next optimizer step, at
each step which of its drop-ins the step wrote, and the quantized shards of
its quantized FSDP2 all-gather (``_gather``), where one is set up. What belongs to one module
(its plans, the clock its copies are stamped with) stays in that module's state.

Which model a drop-in belongs to is decided as FSDP2 decides its root: the
model ``convert_model`` was given, or, for a drop-in made as one
(``te_integration.Linear(...)``, ``managed_construction``) and never
converted as part of a larger model, a model of its own, made at its first
use; converting an enclosing model later takes it in. The freshness of a
copy never depends on that grouping: a step is matched against each
module's own parameters (``_step_hook.Step.wrote``).

The process keeps only a registry of the live model states (weakly, so a
model's state goes with its last module), which the step hook walks.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

from ._step_hook import Step, step_task

__all__ = ["ModelWorkspaceState", "model_state", "model_for_root", "live_models", "gather_states",
           "written_drop_ins", "release_step_caches"]

#: Every live model state (the step hook walks them) ...
_MODELS: weakref.WeakSet = weakref.WeakSet()
#: ... and the one of each root module, as FSDP2 maps a root to its state.
_BY_ROOT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


class ModelWorkspaceState:
    """The workspace state of one model (see the module docstring)."""

    __slots__ = ("_root", "_members", "_pending", "gather", "__weakref__")

    def __init__(self, root: Any) -> None:
        self._root = weakref.ref(root)
        #: The model's drop-ins.
        self._members: weakref.WeakSet = weakref.WeakSet()
        #: drop-in -> cache keys to drop at the model's next optimizer step.
        self._pending: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        #: The model's quantized shards (``workspace_manager.gather.ShardGatherState``),
        #: where ``enable_quantized_gather`` set its quantized all-gather up; else None.
        self.gather: Any = None

    def __repr__(self) -> str:
        root = self._root()
        name = type(root).__name__ if root is not None else "gone"
        return f"ModelWorkspaceState({name}, {len(self._members)} drop-ins)"

    @property
    def root(self) -> Any:
        """The model's root module (None once it is gone)."""
        return self._root()

    def members(self) -> list:
        """The model's drop-ins."""
        return list(self._members)

    def add(self, module: Any, state: Any) -> None:
        """Make drop-in ``module`` (with its ``state``) one of this model's,
        taking its pending releases along from the model it leaves."""
        previous = state.model
        if previous is self:
            return
        state.model = self
        self._members.add(module)
        if previous is not None:
            previous._members.discard(module)
            keys = previous._pending.pop(module, None)
            if keys:
                self._pending.setdefault(module, set()).update(keys)

    def written(self, step: Step) -> tuple:
        """The drop-ins of this model that ``step`` wrote (the step's tasks
        ask :func:`written_drop_ins`, which finds them once per step)."""
        return step.written(self._members)

    # -- cache entries released at the step ------------------------------------------
    def release_after_step(self, module: Any, key: str) -> None:
        """Mark ``module``'s cached workspace ``key`` for release at the
        model's next optimizer step (each backward of a step marks it: the
        module cannot tell which backward is the step's last)."""
        with _LOCK:
            self._pending.setdefault(module, set()).add(key)

    def release_step_caches(self, modules: Any = None) -> int:
        """Drop the marked cache entries of ``modules`` (default: every
        drop-in of the model); returns how many were dropped. Dropping
        removes the module's reference only: a pending backward that saved
        the workspace keeps its own."""
        with _LOCK:
            chosen = list(self._pending.keys()) if modules is None else [m for m in modules if m in self._pending]
            dropped = 0
            for module in chosen:
                for key in self._pending.pop(module, ()):
                    dropped += module._fp8_workspaces.pop(key, None) is not None
        return dropped


def model_state(module: Any, state: Any) -> ModelWorkspaceState:
    """The model state of drop-in ``module`` (its ``state``'s), made for
    the module alone where it belongs to none yet."""
    model = state.model
    if model is None:
        model = model_for_root(module)
        model.add(module, state)
    return model


def model_for_root(root: Any) -> ModelWorkspaceState:
    """The model state whose root is ``root``, made if there is none."""
    with _LOCK:
        model = _BY_ROOT.get(root)
        if model is None:
            model = _BY_ROOT[root] = ModelWorkspaceState(root)
            _MODELS.add(model)
    return model


def live_models() -> list[ModelWorkspaceState]:
    """Every model state alive now."""
    return list(_MODELS)


def gather_states(model: Any) -> list:
    """The quantized-shard states (``ModelWorkspaceState.gather``) of the
    models whose root is ``model`` or one of its submodules."""
    modules = {id(m) for m in model.modules()}
    return [state.gather for state in live_models() if state.gather is not None and id(state.root) in modules]


def written_drop_ins(step: Step) -> tuple[tuple[ModelWorkspaceState, tuple], ...]:
    """``(model, its drop-ins the step wrote)`` of each model the step wrote,
    found once per step for all its tasks."""
    found = step.memo.get("written")
    if found is None:
        pairs = ((model, model.written(step)) for model in live_models())
        found = step.memo["written"] = tuple((model, written) for model, written in pairs if written)
    return found


@step_task("weights_written")
def _weights_written(step: Step) -> None:
    """The step wrote these drop-ins' parameters: their copies count as old."""
    for _, written in written_drop_ins(step):
        for module in written:
            module._wm_state.note_written()


@step_task("step_caches")
def _drop_step_caches(step: Step) -> None:
    for model, written in written_drop_ins(step):
        if model._pending:
            model.release_step_caches(written)


def release_step_caches(model: Any = None) -> int:
    """Drop the cached workspaces marked for release at the step (see
    :meth:`ModelWorkspaceState.release_after_step`) in the drop-ins of
    ``model``, or of every model where None. Returns how many were dropped.
    Call it after the step's last backward where no ``torch.optim``
    optimizer steps (a ``torch.optim`` step drops those of the modules it
    wrote by itself)."""
    if model is None:
        return sum(state.release_step_caches() for state in live_models())
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"release_step_caches: model must be a torch.nn.Module or None; "
                        f"received {type(model).__name__}")
    by_model: dict[int, tuple[ModelWorkspaceState, list]] = {}
    for module in model.modules():
        state = getattr(module, "_wm_state", None)
        if state is not None and state.model is not None:
            by_model.setdefault(id(state.model), (state.model, []))[1].append(module)
    return sum(owner.release_step_caches(modules) for owner, modules in by_model.values())
