"""Everything the binding does at an optimizer step, behind one hook.

Four things happen there: the step generation (:data:`STEPS`) moves on,
so that every quantized copy made before the step counts as stale
(``_freshness``: docs/decisions.md, D12), cached workspaces marked for
release are dropped, sharded quantized parameters whose columnwise data
reappeared are trimmed again, and an active attribution recording takes a
timeline point. One global ``torch.optim`` step post-hook, installed by the
first drop-in (TE's ``FusedAdam`` is a ``torch.optim.Optimizer``, so its
steps run it too), runs them in that order; the other modules register
their task here, so this module imports none of them. A task is handed the
tracked modules the stepping optimizer wrote (those holding one of its
parameters): a process that trains two models, each with its optimizer,
does not remake one model's transposes at the other's step. The generation
still moves at every step, so a copy a task did not remake is found old by
the stamps at its next use (``_freshness``): the scoping saves work, it
cannot let a stale copy through.

Cache release: a plan with ``Release.CACHED_WORKSPACE`` (FSDP2 with
``reshard_after_forward=False``, microbatches and the microbatch cache
option, ``MicrobatchCache.EXACT_FORMATS``, off by default) keeps one workspace per
weight for every microbatch of a step. The module cannot tell which
backward is the step's last, so each backward marks the entry, and the
entries are dropped at the next optimizer step, or when the user calls
:func:`release_step_caches`. Dropping only removes the module's reference:
a pending backward that saved the workspace keeps its own.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

__all__ = ["release_step_caches", "STEPS"]


class StepGeneration:
    """How many optimizer steps (and explicit releases) the process has
    seen: a copy stamped with an older value was made from older weights.
    One int attribute, read inline by the hot paths."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0

    def advance(self) -> None:
        self.value += 1


#: The process's step generation (see :class:`StepGeneration`).
STEPS = StepGeneration()

_PENDING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_TRACKED: weakref.WeakSet = weakref.WeakSet()
_TASKS: list[Callable[[list[Any]], None]] = []
#: Per optimizer: its param groups' signature and the ids of its parameters.
_OPTIMIZER_PARAMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()
_HOOK: Any = None


def ensure_hook() -> None:
    """Install the one optimizer-step hook, if not done yet."""
    global _HOOK
    if _HOOK is not None:
        return
    with _LOCK:
        if _HOOK is None:
            _HOOK = register_optimizer_step_post_hook(_after_optimizer_step)


def add_step_task(task: Callable[[list[Any]], None]) -> None:
    """Run ``task(modules)`` at every optimizer step, after the cache
    release, with the tracked modules that step wrote (:func:`stepped`)."""
    if task not in _TASKS:
        _TASKS.append(task)


def track(module: Any) -> None:
    """Check ``module``'s quantized parameters after every optimizer step
    from now on: their transposes are invalidated (``_freshness``) and, under
    FSDP2, their shards trimmed (``_shards``)."""
    _TRACKED.add(module)
    ensure_hook()


def tracked() -> list[Any]:
    return list(_TRACKED)


def _parameter_ids(optimizer: Any) -> frozenset[int] | None:
    """The ids of ``optimizer``'s parameters, remembered while its param
    groups keep their lists and lengths; None: it has no param groups."""
    groups = getattr(optimizer, "param_groups", None)
    if not isinstance(groups, list):
        return None
    signature = tuple((id(group["params"]), len(group["params"])) for group in groups)
    try:
        known = _OPTIMIZER_PARAMS.get(optimizer)
    except TypeError:  # not weakly referable: found again at each step
        known = None
    if known is None or known[0] != signature:
        known = (signature, frozenset(id(p) for group in groups for p in group["params"]))
        with contextlib.suppress(TypeError):
            _OPTIMIZER_PARAMS[optimizer] = known
    return known[1]


def stepped(optimizer: Any) -> list[Any]:
    """The tracked modules holding a parameter of ``optimizer`` (every
    tracked module where the optimizer lists no param groups)."""
    ids = _parameter_ids(optimizer)
    modules = tracked()
    if ids is None:
        return modules
    return [m for m in modules if any(id(p) in ids for p in m._parameters.values() if p is not None)]


def release_after_step(module: Any, key: str) -> None:
    """Mark ``module``'s cached workspace ``key`` for release after the step."""
    with _LOCK:
        _PENDING.setdefault(module, set()).add(key)
    ensure_hook()


def _after_optimizer_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    STEPS.advance()
    if _PENDING:
        release_step_caches()
    if _TASKS:
        modules = stepped(optimizer)
        for task in _TASKS:
            task(modules)


def release_step_caches(model: torch.nn.Module | None = None) -> int:
    """Drop the cached workspaces marked for release after the step, in
    ``model`` (or everywhere). Returns how many were dropped. Call it after
    the step's last backward when no ``torch.optim`` optimizer steps."""
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"release_step_caches: model must be a torch.nn.Module or None; "
                        f"received {type(model).__name__}")
    with _LOCK:
        modules = list(_PENDING.keys())
        if model is not None:
            inside = {id(m) for m in model.modules()}
            modules = [m for m in modules if id(m) in inside]
        dropped = 0
        for module in modules:
            for key in _PENDING.pop(module, ()):
                dropped += module._fp8_workspaces.pop(key, None) is not None
    return dropped
