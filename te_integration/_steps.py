"""Release of cached workspaces at the end of a training step.

A plan with ``Release.CACHED_WORKSPACE`` (FSDP2 with
``reshard_after_forward=False`` and microbatches) keeps one workspace per
weight for every microbatch of a step. The module cannot tell which
backward is the step's last, so each backward marks the entry, and the
entries are dropped at the next optimizer step (a global
``torch.optim`` step hook, installed on first use), or when the user calls
:func:`release_step_caches`. Dropping only removes the module's reference:
a pending backward that saved the workspace keeps its own.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

__all__ = ["release_step_caches"]

_PENDING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()
_HOOK: Any = None


def release_after_step(module: Any, key: str) -> None:
    """Mark ``module``'s cached workspace ``key`` for release after the step."""
    global _HOOK
    with _LOCK:
        _PENDING.setdefault(module, set()).add(key)
        if _HOOK is None:
            _HOOK = register_optimizer_step_post_hook(_after_optimizer_step)


def _after_optimizer_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    release_step_caches()


def release_step_caches(model: torch.nn.Module | None = None) -> int:
    """Drop the cached workspaces marked for release after the step, in
    ``model`` (or everywhere). Returns how many were dropped. Call it after
    the step's last backward when no ``torch.optim`` optimizer steps."""
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
