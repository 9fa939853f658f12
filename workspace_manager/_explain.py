"""The decision table: policy x setting x capabilities -> plan, in words.

``python -m workspace_manager explain`` prints it; reviewers read it to see
why a workspace is alive in a given setting.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from ._context import (
    QuantizerCapabilities,
    RecomputePass,
    RecomputeScope,
    Sharding,
    WeightSource,
    WorkspaceContext,
)
from ._notes import plan_notes
from ._plan import Usage, WorkspacePlan

__all__ = ["DecisionRow", "decision_table", "render_text", "render_json", "plan_notes", "POLICY_CHOICES"]


@dataclass(frozen=True)
class DecisionRow:
    policy: str
    context: WorkspaceContext
    plan: WorkspacePlan

    def setting(self) -> str:
        c = self.context
        parts = ["unsharded" if c.sharding is Sharding.NONE else c.sharding.value]
        if c.recompute is not RecomputePass.NONE:
            own = "(module's own)" if c.recompute_scope is RecomputeScope.MODULE else ""
            parts.append(f"recompute:{c.recompute.value}{own}")
        parts.append("train" if c.grad_enabled else "no_grad")
        if not c.input_requires_grad:
            parts.append("no_dgrad")
        parts.append("qparam" if c.is_quantized_param else "hp_weight")
        parts.append(f"mb:{c.microbatch.value}")
        if c.backward_override.value != "none":
            parts.append(f"override:{c.backward_override.value}")
        return " ".join(parts)

    def to_dict(self) -> dict:
        c = self.context
        return {
            "policy": self.policy,
            "quantizer": c.capabilities.name,
            "context": {
                "sharding": c.sharding.value,
                "recompute": c.recompute.value,
                "recompute_scope": c.recompute_scope.value,
                "grad_enabled": c.grad_enabled,
                "input_requires_grad": c.input_requires_grad,
                "weight": c.weight.value,
                "microbatch": c.microbatch.value,
                "backward_override": c.backward_override.value,
            },
            "plan": self.plan.to_dict(),
        }


def _policy_choices() -> dict[str, object]:
    from ._policy import (
        DistributedWeightWorkspacePolicy,
        FSDP2WorkspacePolicy,
        RecomputeWorkspacePolicy,
        WorkspacePolicy,
    )

    return {
        "plain": WorkspacePolicy(),
        "fsdp2": FSDP2WorkspacePolicy(),
        "recompute": RecomputeWorkspacePolicy(inner=WorkspacePolicy()),
        "fsdp2_recompute": RecomputeWorkspacePolicy(inner=FSDP2WorkspacePolicy()),
        "distributed_weight": DistributedWeightWorkspacePolicy(),
    }


#: Policy names accepted by ``explain --policy``.
POLICY_CHOICES = tuple(_policy_choices())


def _contexts(policy, capabilities: QuantizerCapabilities, full: bool) -> Iterator[WorkspaceContext]:
    """The settings shown for a policy: its shardings x passes x weight x
    grad x microbatch (and, with ``full``, dgrad and backward_override)."""
    from ._context import BackwardOverride, valid_contexts

    passes = [RecomputePass.FIRST, RecomputePass.RECOMPUTE] if policy.label == "recompute" else [RecomputePass.NONE]
    return valid_contexts(
        capabilities,
        shardings=sorted(policy.shardings, key=lambda s: list(Sharding).index(s)),
        passes=passes,
        dgrads=[True, False] if full else [True],
        overrides=list(BackwardOverride) if full else [BackwardOverride.NONE],
    )


def decision_table(
    profiles: Iterable[QuantizerCapabilities],
    policies: Iterable[str] | None = None,
    *,
    full: bool = False,
) -> list[DecisionRow]:
    """Every (policy, setting, profile) combination with its plan."""
    choices = _policy_choices()
    names = list(policies) if policies is not None else list(choices)
    rows = []
    for name in names:
        policy = choices[name]
        for caps in profiles:
            for ctx in _contexts(policy, caps, full):
                rows.append(DecisionRow(name, ctx, policy.plan(ctx)))
    return rows


def render_json(rows: list[DecisionRow]) -> str:
    return json.dumps([r.to_dict() for r in rows], indent=1)


_COLUMNS = ("setting", "cache", "forward", "backward gets", "dgrad columnwise", "release", "param keeps",
            "quantizers")


def _grouped(rows: list[DecisionRow]) -> dict[str, list[tuple[str, WorkspacePlan, list[str]]]]:
    """Per policy, one line per (setting, plan), listing the profiles that share it."""
    grouped: dict[str, dict[tuple[str, WorkspacePlan], list[str]]] = {}
    for row in rows:
        grouped.setdefault(row.policy, {}).setdefault((row.setting(), row.plan), []).append(
            row.context.capabilities.name
        )
    all_profiles = {r.context.capabilities.name for r in rows}
    out: dict[str, list[tuple[str, WorkspacePlan, list[str]]]] = {}
    for policy, lines in grouped.items():
        out[policy] = [
            (setting, plan, ["all"] if set(names) == all_profiles else names)
            for (setting, plan), names in lines.items()
        ]
    return out


def render_text(rows: list[DecisionRow]) -> str:
    """A fixed-width table per policy; plans shared by every profile are shown once."""
    blocks = []
    for policy, lines in _grouped(rows).items():
        cells = [
            (
                setting,
                plan.cache.value,
                plan.forward_usage.label,
                f"{plan.backward_source.value} ({plan.backward_usage.label})",
                plan.columnwise_source.value,
                plan.release.label,
                plan.parameter_keeps.label if plan.parameter_keeps is not Usage.NONE else "-",
                ",".join(names),
            )
            for setting, plan, names in lines
        ]
        widths = [max(len(col), *(len(c[i]) for c in cells)) for i, col in enumerate(_COLUMNS)]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        body = [fmt.format(*_COLUMNS), fmt.format(*("-" * w for w in widths))]
        body += [fmt.format(*c).rstrip() for c in cells]
        blocks.append(f"== policy: {policy} ==\n" + "\n".join(body))
    return "\n\n".join(blocks) + "\n"
