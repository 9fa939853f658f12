"""A byte budget for keeping forward's weight copies under FSDP2.

Under FSDP2, each layer's backward quantizes the weight it gathers again
for dgrad. :class:`~workspace_manager.KeepForBackwardWorkspacePolicy`
saves that quantization by keeping forward's columnwise copy until the
layer's backward, at one byte per parameter. :func:`apply_workspace_budget`
spends a byte budget on it, module by module, in the order backward runs:
the last registered modules first. The modules it chooses form a tail of
the model (the walk stops at the first module that no longer fits), so
each kept copy lives for the shortest stretch of the step that any copy
could.

Which modules are left alone: a module with another policy pinned (the
user's choice wins; unpin it with ``set_workspace_policy(m, None)`` to let
the budget manage it), and a module FSDP2 does not shard (the keep policy
plans only sharded weights). A module beyond the budget that a previous
call pinned is unpinned again, so calling with a smaller budget shrinks the
set; other modules beyond it stay unpinned and are planned per call
(FSDP2WorkspacePolicy).
"""

from __future__ import annotations

import enum
import math
import numbers
from dataclasses import dataclass
from typing import Any

import torch

from workspace_manager import KeepForBackwardWorkspacePolicy, PolicyMismatchError

from . import _argument_checks as checks
from ..te import _compat as te
from ._modules import ManagedModule, set_workspace_policy, workspace_state
from ._kind_registry import adapter_for

__all__ = ["apply_workspace_budget", "WorkspaceBudget", "BudgetEntry", "BudgetChoice"]

_FUNC = "apply_workspace_budget"
_KEEP = KeepForBackwardWorkspacePolicy()
_MIB = 2**20


class BudgetChoice(enum.Enum):
    """What :func:`apply_workspace_budget` did with one drop-in module."""

    #: Within the budget: KeepForBackwardWorkspacePolicy is pinned.
    KEPT = "kept"
    #: The budget was spent before this module: not pinned (per-call selection).
    OVER_BUDGET = "over budget"
    #: Another policy was pinned on it before the call: left as it was.
    PINNED = "other policy pinned"
    #: FSDP2 does not shard its weights: the keep policy does not plan it.
    NOT_SHARDED = "not sharded"


@dataclass(frozen=True)
class BudgetEntry:
    """One drop-in module: its name in the model, the bytes a kept copy of
    its weights costs (one byte per element of its high-precision weights,
    the full unsharded size), and the choice made."""

    fqn: str
    nbytes: int
    choice: BudgetChoice

    @property
    def kept(self) -> bool:
        return self.choice is BudgetChoice.KEPT


@dataclass(frozen=True)
class WorkspaceBudget:
    """The outcome of one :func:`apply_workspace_budget` call: the budget
    and one entry per drop-in module, in the order the budget was spent
    (backward order: the last registered module first)."""

    budget_bytes: int
    entries: tuple[BudgetEntry, ...]

    @property
    def kept_bytes(self) -> int:
        """Bytes the kept copies cost together (at most ``budget_bytes``)."""
        return sum(e.nbytes for e in self.entries if e.kept)

    @property
    def candidate_bytes(self) -> int:
        """Bytes a kept copy of every module the budget may manage would cost:
        a budget this large keeps them all."""
        managed = (BudgetChoice.KEPT, BudgetChoice.OVER_BUDGET)
        return sum(e.nbytes for e in self.entries if e.choice in managed)

    @property
    def kept(self) -> tuple[str, ...]:
        """The names of the modules the keep policy is pinned on."""
        return tuple(e.fqn for e in self.entries if e.kept)

    def __str__(self) -> str:
        width = max([len("module")] + [len(e.fqn or "(model)") for e in self.entries])
        lines = [
            f"workspace budget: {_mib(self.budget_bytes)} MiB; kept {_mib(self.kept_bytes)} MiB on "
            f"{len(self.kept)} of {len(self.entries)} modules ({_mib(self.candidate_bytes)} MiB would keep every "
            "module the budget manages)",
            f"  {'module'.ljust(width)}  {'bytes':>14}  {'MiB':>9}  kept",
        ]
        for e in self.entries:
            why = "yes" if e.kept else f"no ({e.choice.value})"
            lines.append(f"  {(e.fqn or '(model)').ljust(width)}  {e.nbytes:>14,}  {_mib(e.nbytes):>9}  {why}")
        return "\n".join(lines)


def _mib(nbytes: int) -> str:
    return f"{nbytes / _MIB:.1f}"


def apply_workspace_budget(model: torch.nn.Module, budget_bytes: int) -> WorkspaceBudget:
    """Pin :class:`~workspace_manager.KeepForBackwardWorkspacePolicy` on the
    drop-in modules of ``model`` whose backward runs first, as long as their
    kept copies fit in ``budget_bytes``; return what was chosen.

    Call it after ``fully_shard`` (the sharding decides which modules the
    keep policy can plan) and before training, or between steps to change
    the budget. A module costs one byte per element of its high-precision
    GEMM weights, counted at their full (gathered) size, since a gathered
    copy is what stays alive; scales are not counted (under 0.1% of that
    for per-tensor and 128x128-block FP8, 3% for MXFP8), and NVFP4's half
    byte per element is counted as a whole one. Quantized parameters cost nothing: the keep policy plans
    them as FSDP2WorkspacePolicy does. See the module docstring for which
    modules are left alone. ``last_plans(module)`` shows the keep plan on
    the chosen modules after their next call.

    Raises TypeError for a ``model`` that is no module or a budget that is
    no integer, ValueError for a negative budget or a model without drop-in
    modules, and :class:`~workspace_manager.PolicyMismatchError` when FSDP2
    shards none of them (called before ``fully_shard``). A refused call
    changes nothing.
    """
    checks.expect_module(_FUNC, "model", model)
    _check_budget(budget_bytes)
    candidates = _survey(model)
    entries = _spend(candidates, int(budget_bytes))
    for candidate, entry in zip(candidates, entries):
        if entry.kept:
            set_workspace_policy(candidate.module, _KEEP)
        elif entry.choice is BudgetChoice.OVER_BUDGET and candidate.module.workspace_policy == _KEEP:
            set_workspace_policy(candidate.module, None)  # pinned by an earlier, larger budget
    return WorkspaceBudget(int(budget_bytes), entries)


@dataclass(frozen=True)
class _Candidate:
    """A drop-in module, its cost, and its choice where the budget has no say."""

    fqn: str
    module: torch.nn.Module
    nbytes: int
    fixed: BudgetChoice | None


def _check_budget(budget_bytes: Any) -> None:
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, numbers.Integral):
        raise TypeError(f"{_FUNC}: budget_bytes must be an int (a number of bytes); received "
                        f"{type(budget_bytes).__name__} {budget_bytes!r:.80}. For a fraction of a size, "
                        "round it: int(0.25 * total).")
    if budget_bytes < 0:
        raise ValueError(f"{_FUNC}: budget_bytes must be >= 0; received {budget_bytes}. "
                         "0 keeps no copy.")


def _survey(model: torch.nn.Module) -> list[_Candidate]:
    """The drop-ins in backward order. Raises, changing nothing, when there
    is nothing the budget could manage."""
    drop_ins = [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, ManagedModule)]
    if not drop_ins:
        raise ValueError(
            f"{_FUNC}: model ({type(model).__name__}) holds no te_integration drop-in module. Build it under "
            "te_integration.managed_construction() or call te_integration.convert_model(model) first, then "
            "fully_shard, then this.")
    candidates = [_Candidate(fqn, m, _copy_bytes(m), _fixed_choice(m)) for fqn, m in reversed(drop_ins)]
    if all(c.fixed is BudgetChoice.NOT_SHARDED for c in candidates):
        raise PolicyMismatchError(
            f"{_FUNC}: FSDP2 shards none of the {len(candidates)} drop-in modules of {type(model).__name__}; the "
            "keep policy plans only sharded weights. Call fully_shard on the model (or its layers) first, then "
            "apply_workspace_budget. (Unsharded training keeps forward's copy for backward already.)")
    return candidates


def _fixed_choice(module: torch.nn.Module) -> BudgetChoice | None:
    if not workspace_state(module).sharding(module).is_fsdp2:
        return BudgetChoice.NOT_SHARDED
    pinned = module.workspace_policy
    if pinned is not None and pinned != _KEEP:
        return BudgetChoice.PINNED
    return None


def _spend(candidates: list[_Candidate], budget: int) -> tuple[BudgetEntry, ...]:
    """Keep modules in order while their bytes fit; after the first that
    does not, none (the kept ones stay a tail of the model)."""
    entries, left, spent = [], budget, False
    for c in candidates:
        choice = c.fixed
        if choice is None:
            spent = spent or c.nbytes > left
            choice = BudgetChoice.OVER_BUDGET if spent else BudgetChoice.KEPT
            left -= c.nbytes if choice is BudgetChoice.KEPT else 0
        entries.append(BudgetEntry(c.fqn, c.nbytes, choice))
    return tuple(entries)


def _copy_bytes(module: torch.nn.Module) -> int:
    """One byte per element of the module's high-precision GEMM weights, at
    their full size (a DTensor's shape is the unsharded one)."""
    total = 0
    for name in _weight_names(module):
        param = getattr(module, name, None)
        if param is None or isinstance(getattr(param, "_local_tensor", param), te.QuantizedTensorStorage):
            continue
        total += math.prod(param.shape)
    return total


def _weight_names(module: torch.nn.Module) -> tuple[str, ...]:
    """The parameters TE quantizes as GEMM weights, as the module's kind says (its adapter)."""
    return adapter_for(module._wm_kind).gemm_weights(module)
