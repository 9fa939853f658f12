"""Everything the binding does at an optimizer step, behind one hook.

Four things happen there: the step generation (:data:`STEPS`) moves on,
so that every quantized copy made before the step counts as stale
(``_freshness``: docs/decisions.md, D12), cached workspaces marked for
release are dropped, sharded quantized parameters whose columnwise data
reappeared are trimmed again, and an active attribution recording takes a
timeline point. One global ``torch.optim`` step post-hook, installed by the
first drop-in (TE's ``FusedAdam`` is a ``torch.optim.Optimizer``, so its
steps run it too), runs them in that order; the other modules register
their task here, so this module imports none of them.

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
_TASKS: list[Callable[[], None]] = []
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


def add_step_task(task: Callable[[], None]) -> None:
    """Run ``task()`` at every optimizer step, after the cache release."""
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


def release_after_step(module: Any, key: str) -> None:
    """Mark ``module``'s cached workspace ``key`` for release after the step."""
    with _LOCK:
        _PENDING.setdefault(module, set()).add(key)
    ensure_hook()


def _after_optimizer_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    STEPS.advance()
    if _PENDING:
        release_step_caches()
    for task in _TASKS:
        task()


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
