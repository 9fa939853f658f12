"""An optimizer step, as the binding sees it: :class:`Step`, and the tasks run at it.

One ``torch.optim`` step post-hook (installed with the first drop-in's
state, or by a recording; TE's ``FusedAdam`` is a ``torch.optim.Optimizer``,
so its steps run it too) describes each step as a :class:`Step` and runs
the step tasks on it. A step wrote exactly the parameters in the stepping
optimizer's param groups; a module counts as written when the step wrote
one of its own parameters (:meth:`Step.wrote`), directly or, under FSDP2,
through the sharded parameter FSDP2 gathers it from (FSDP2's own records,
``workspace_manager.fsdp2_parameters``). So one model's step leaves every
other model's copies as they are (docs/decisions.md, D12).

The guarantee never rests on that map being complete. Where it cannot be
read, a step counts as writing more, never less:

* an optimizer without ``param_groups``, or one holding a DTensor that no
  FSDP2 record names, wrote every module of every model
  (:attr:`Step.everything`);
* a drop-in FSDP2 manages whose parameters FSDP2's records do not list
  is written by every step (``ModuleWorkspaceState.sharded_sources``).

The tasks run in the order :data:`ORDER` declares, whatever order their
modules were imported in: each module registers its task under its name
(:func:`step_task`), so this module imports none of them.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from torch.optim.optimizer import register_optimizer_step_post_hook

from workspace_manager.extending import fsdp2_parameters

__all__ = ["Step", "ORDER", "step_task", "ensure_hook"]

#: The step tasks, in the order they run: the written modules' copies
#: count as old (their clock moves), the cache entries marked for release
#: at the step are dropped, quantized parameters' transposes are made again
#: from the data just written, sharded quantized parameters are trimmed
#: again, the quantized shards of a quantized all-gather are made again from
#: the shards just written (``_gather``), and an active recording takes its
#: timeline point.
ORDER = ("weights_written", "step_caches", "parameter_transposes", "shard_trim", "quantized_shards",
         "recording_point")

_TASKS: dict[str, Callable[[Step], None]] = {}
_LOCK = threading.Lock()
_HOOK: Any = None
#: Per optimizer: its param groups' signature and what a step of it writes
#: (weak: an optimizer's entry goes with it).
_PLACEMENTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def step_task(name: str) -> Callable[[Callable[[Step], None]], Callable[[Step], None]]:
    """Register the decorated ``task(step)`` as the step task ``name``, one
    of :data:`ORDER`; a name outside it, or taken by another function, is refused."""
    if name not in ORDER:
        raise ValueError(f"step_task: {name!r} is not a step task; the tasks are {', '.join(ORDER)} "
                         "(add a new one to _step_hook.ORDER, where it takes its place in the order)")

    def register(task: Callable[[Step], None]) -> Callable[[Step], None]:
        taken = _TASKS.get(name)
        if taken is not None and getattr(taken, "__qualname__", None) != getattr(task, "__qualname__", None):
            raise ValueError(f"step_task: {name!r} is already {taken.__qualname__}; each task has one function")
        _TASKS[name] = task
        return task

    return register


def ensure_hook() -> None:
    """Install the one optimizer-step hook, if not done yet."""
    global _HOOK
    if _HOOK is not None:
        return
    with _LOCK:
        if _HOOK is None:
            _HOOK = register_optimizer_step_post_hook(_after_optimizer_step)


def _after_optimizer_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    step = Step.of(optimizer)
    for name in ORDER:
        task = _TASKS.get(name)
        if task is not None:
            task(step)


class Step:
    """One optimizer step: which parameters it wrote (see the module docstring)."""

    __slots__ = ("ids", "everything", "why", "memo")

    def __init__(self, ids: frozenset[int], everything: bool = False, why: str = "") -> None:
        #: The ids of the parameters the step wrote.
        self.ids = ids
        #: The step may have written any parameter: every module counts as written.
        self.everything = everything
        #: Why :attr:`everything` is set.
        self.why = why
        #: What the tasks find once for the step and share (``_model.written_drop_ins``).
        self.memo: dict[str, Any] = {}

    @classmethod
    def of(cls, optimizer: Any) -> Step:
        """The step ``optimizer`` takes now."""
        ids, why = _placement(optimizer)
        return cls(ids, everything=ids is None, why=why)

    def wrote(self, module: Any) -> bool:
        """Whether the step wrote one of drop-in ``module``'s own parameters:
        a registered one, or (under FSDP2) the sharded one FSDP2 gathers it
        from (``ModuleWorkspaceState.sharded_sources``). Run for every drop-in
        at every step, so the common answers cost no call."""
        if self.everything:
            return True
        ids = self.ids
        for param in module._parameters.values():
            if id(param) in ids:
                return True
        sharded = module._wm_state.sharded_sources(module)
        return sharded is None or not ids.isdisjoint(sharded)

    def wrote_any(self, sources: Iterable[int] | None) -> bool:
        """Whether the step wrote one of the tensors with these ids (None:
        sources that could not be found, which any step may have written)."""
        return self.everything or sources is None or not self.ids.isdisjoint(sources)

    def written(self, modules: Iterable[Any]) -> tuple:
        """Those of the drop-ins ``modules`` the step wrote."""
        return tuple(m for m in modules if self.wrote(m))


def _placement(optimizer: Any) -> tuple[frozenset[int] | None, str]:
    """The ids a step of ``optimizer`` writes, remembered while its param
    groups keep their lists and lengths; None (with why) where they cannot
    all be placed, found again at the next step (FSDP2 may be applied since)."""
    groups = getattr(optimizer, "param_groups", None)
    if not isinstance(groups, list):
        return None, f"{type(optimizer).__name__} lists no param_groups"
    signature = tuple((id(group["params"]), len(group["params"])) for group in groups)
    try:
        known = _PLACEMENTS.get(optimizer)
    except TypeError:  # not weakly referable: placed again at each step
        known = None
    if known is None or known[0] != signature:
        known = (signature, *_place([p for group in groups for p in group["params"]]))
        if known[1] is not None:
            with contextlib.suppress(TypeError):
                _PLACEMENTS[optimizer] = known
    return known[1], known[2]


def _place(params: list) -> tuple[frozenset[int] | None, str]:
    """The ids of ``params``; None where one is a DTensor that no FSDP2
    record names: sharded by something whose gathered tensors the binding
    cannot find, so it cannot tell which modules compute from it."""
    dtensors = [p for p in params if hasattr(p, "_local_tensor") and hasattr(p, "device_mesh")]
    if dtensors:
        sharded = {id(record.sharded) for record in fsdp2_parameters()}
        for param in dtensors:
            if id(param) not in sharded:
                return None, (f"it holds a {type(param).__name__} parameter of shape {tuple(param.shape)} that "
                              "no FSDP2 record names")
    return frozenset(map(id, params)), ""
