"""The decision table's data: policy x setting x capabilities -> plan.

``python -m workspace_manager explain`` prints it; reviewers read it to see
why a workspace is alive in a given setting. This module says which rows
the table has and the facts it states: the TE recipe that selects each
capability profile, and the module kinds its plans apply to, which
bindings register (:func:`register_module_kind`). How the rows are grouped,
abbreviated, merged and wrapped is ``_explain_layout.py``'s.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from ._context import (BackwardOverride, QuantizerCapabilities, RecomputePass, ShardGather, Sharding, WorkspaceContext,
                       valid_contexts)
from ._errors import ContextTypeError
from ._plan import WorkspacePlan
from ._policy import Policy
from ._selection import POLICY_NAMES, named_policy

__all__ = ["DecisionRow", "decision_table", "POLICY_CHOICES", "quantizer_label", "recipe_names",
           "ModuleKindEntry", "register_module_kind", "registered_module_kinds"]


@dataclass(frozen=True)
class DecisionRow:
    """One row of the table: a shipped policy's name, a context and its plan."""

    policy: str
    context: WorkspaceContext
    plan: WorkspacePlan

    def to_dict(self) -> dict:
        """The row as ``explain --json`` prints it."""
        c = self.context
        return {
            "policy": self.policy,
            "quantizer": c.capabilities.name,
            "recipe": recipe_names().get(c.capabilities.name),
            "context": {
                "sharding": c.sharding.value,
                "recompute": c.recompute.value,
                "recompute_scope": c.recompute_scope.value,
                "grad_enabled": c.grad_enabled,
                "input_requires_grad": c.input_requires_grad,
                "weight": c.weight.value,
                "microbatch": c.microbatch.value,
                "backward_override": c.backward_override.value,
                "shard_gather": c.shard_gather.value,
            },
            "plan": self.plan.to_dict(),
        }


def _policy_choices() -> dict[str, Policy]:
    return {name: named_policy(name) for name in POLICY_NAMES}


#: Policy names accepted by ``explain --policy``: the shipped policies with
#: their defaults, then with an option switched on (``POLICY_NAMES``).
POLICY_CHOICES = POLICY_NAMES


def _contexts(policy: Policy, capabilities: QuantizerCapabilities, full: bool,
              gather: bool = False) -> Iterator[WorkspaceContext]:
    """The settings shown for a policy: its shardings x passes x weight x
    grad x microbatch (with ``full``, dgrad and backward_override too; with
    ``full`` or ``gather``, the FSDP2 settings with a quantized all-gather
    set up, ``ShardGather``, beside those without)."""
    # A policy of recompute passes plans the other calls as its inner policy
    # does, which that policy's own table shows: its table shows the passes.
    passes = sorted(policy.recompute_passes - {RecomputePass.NONE}, key=list(RecomputePass).index)
    return valid_contexts(
        capabilities,
        shardings=sorted(policy.shardings, key=list(Sharding).index),
        passes=passes or [RecomputePass.NONE],
        dgrads=[True, False] if full else [True],
        overrides=list(BackwardOverride) if full else [BackwardOverride.NONE],
        gathers=list(ShardGather) if (full or gather) else [ShardGather.NONE],
    )


def decision_table(
    profiles: Iterable[QuantizerCapabilities],
    policies: Iterable[str] | None = None,
    *,
    full: bool = False,
    gather: bool = False,
) -> list[DecisionRow]:
    """Every (policy, setting, profile) combination with its plan (the
    settings :func:`_contexts` shows)."""
    choices = _policy_choices()
    names = list(policies) if policies is not None else list(choices)
    rows = []
    for name in names:
        policy = choices[name]
        for caps in profiles:
            for ctx in _contexts(policy, caps, full, gather):
                rows.append(DecisionRow(name, ctx, policy.plan(ctx)))
    return rows


def recipe_names() -> dict[str, str]:
    """Profile name -> recipe name, for the profiles a TE recipe selects."""
    from ._profiles import RECIPE_PROFILES

    return {caps.name: recipe for recipe, caps in RECIPE_PROFILES.items()}


def quantizer_label(profile: str) -> str:
    """The name a TE user knows: the recipe's, else the profile's."""
    return recipe_names().get(profile, profile)


# -- the module kinds the plans apply to -----------------------------------------
@dataclass(frozen=True)
class ModuleKindEntry:
    """A module kind whose calls a binding plans, as ``explain`` names it:
    ``name`` as its users know the module (``"GroupedLinear"``), ``note``
    what one call plans where that is more than one weight's plan
    (``"one plan for all its experts"``), or ``""``."""

    name: str
    note: str = ""


#: Name -> entry, in the order registered; filled by the bindings.
_MODULE_KINDS: dict[str, ModuleKindEntry] = {}


def register_module_kind(name: str, note: str = "") -> None:
    """Name a module kind in ``explain``'s legend. A binding calls this for
    each of its kinds when it is imported (``te_integration`` does), since
    the core names no module of any framework. Registering a name again
    replaces its note and keeps its place."""
    if not isinstance(name, str) or not name.strip():
        raise ContextTypeError(f"register_module_kind: name must be a non-empty string; received {name!r}")
    if not isinstance(note, str):
        raise ContextTypeError(f"register_module_kind: note must be a string; received {note!r}")
    _MODULE_KINDS[name] = ModuleKindEntry(name, note)


def registered_module_kinds() -> tuple[ModuleKindEntry, ...]:
    """The module kinds registered in this process, in the order registered:
    none where no binding was imported (the CLI run on its own)."""
    return tuple(_MODULE_KINDS.values())
