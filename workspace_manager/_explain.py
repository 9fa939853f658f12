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
    Microbatch,
    QuantizerCapabilities,
    RecomputePass,
    RecomputeScope,
    Sharding,
    WeightSource,
    WorkspaceContext,
)
from ._plan import BackwardSource, CacheAction, ColumnwiseSource, Release, Usage, WorkspacePlan

__all__ = ["DecisionRow", "decision_table", "render_text", "render_json", "plan_notes", "POLICY_CHOICES"]


def plan_notes(
    ctx: WorkspaceContext,
    cache: CacheAction,
    forward: Usage,
    source: BackwardSource,
    columnwise: ColumnwiseSource,
    release: Release,
    keeps: Usage = Usage.NONE,
) -> tuple[str, ...]:
    """Why a plan is what it is, one short sentence per decision that needs one."""
    notes = [_cache_note(ctx, cache)]
    if source is BackwardSource.REGATHER:
        notes.append("nothing is saved; backward gathers the distributed weight again")
    elif source is BackwardSource.REQUANTIZE:
        notes.append("nothing quantized is saved; backward quantizes the weight it has again")
        if ctx.recompute is RecomputePass.RECOMPUTE:
            notes.append(
                "this pass quantizes with the first pass's scale, backward with its own: the rebuild "
                "is kept so that dgrad sees TE's bytes"
            )
    if columnwise is ColumnwiseSource.REQUANTIZED and not ctx.capabilities.requantization_safe:
        notes.append(
            f"{ctx.capabilities.name} does not requantize exactly: dgrad may see another "
            "quantization than fprop (TE 2.20 does the same)"
        )
    if source is BackwardSource.NONE and ctx.training and not ctx.input_requires_grad:
        notes.append("no dgrad: nothing is kept for backward")
    if columnwise is ColumnwiseSource.DERIVED:
        notes.append(f"columnwise derived from rowwise ({ctx.capabilities.name} allows it)")
    if Release.DERIVED_COLUMNWISE in release:
        notes.append("derived columnwise data cleared after backward; FSDP2 cannot free it (TE#2717)")
    if Release.CACHED_WORKSPACE in release:
        notes.append("cached workspace dropped after the step's last backward")
    if keeps is Usage.ROWWISE:
        notes.append("the sharded parameter keeps rowwise data only: its all-gather sends no more")
    return tuple(n for n in notes if n)


def _cache_note(ctx: WorkspaceContext, cache: CacheAction) -> str:
    if cache is CacheAction.FILL:
        return "first microbatch: quantize into the cache"
    if cache is CacheAction.REUSE:
        return "later microbatch: weight unchanged, reuse the cache"
    if cache is CacheAction.READ_ONLY:
        return "recompute pass: read the cache, never write it"
    if ctx.is_quantized_param:
        return "quantized parameter: nothing to cache"
    if ctx.sharding is Sharding.FSDP2_RESHARD:
        return "FSDP2 reshards after forward: no cached copy per layer (TE#2681)"
    if ctx.sharding is Sharding.DISTRIBUTED_WEIGHT:
        return "distributed weight: no cached copy of the gathered weight"
    if ctx.microbatch is Microbatch.NONE:
        return "no microbatch position: not cached"
    if ctx.grad_enabled and not ctx.capabilities.requantization_safe:
        return f"{ctx.capabilities.name} does not requantize exactly: reusing would differ from TE, not cached"
    return "no backward to drop a cache after: not cached"


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
