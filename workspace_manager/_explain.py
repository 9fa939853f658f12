"""The decision table: policy x setting x capabilities -> plan, in words.

``python -m workspace_manager explain`` prints it; reviewers read it to see
why a workspace is alive in a given setting.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from ._context import (
    QuantizerCapabilities,
    RecomputePass,
    RecomputeScope,
    Sharding,
    WorkspaceContext,
)
from ._notes import plan_notes
from ._plan import BackwardSource, ColumnwiseSource, Release, Usage, WorkspacePlan
from ._selection import POLICY_NAMES, named_policy

__all__ = ["DecisionRow", "decision_table", "render_text", "render_json", "plan_notes", "POLICY_CHOICES",
           "LEGEND", "render_legend", "group_settings", "plan_cells", "quantizer_label"]


@dataclass(frozen=True)
class DecisionRow:
    policy: str
    context: WorkspaceContext
    plan: WorkspacePlan

    def setting(self) -> str:
        c = self.context
        parts = ["unsharded" if c.sharding is Sharding.NONE else c.sharding.value]
        if c.recompute is not RecomputePass.NONE:
            own = "(own)" if c.recompute_scope is RecomputeScope.MODULE else ""
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
            "recipe": _recipe_names().get(c.capabilities.name),
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
    return {name: named_policy(name) for name in POLICY_NAMES}


#: Policy names accepted by ``explain --policy``: the shipped policies with
#: their defaults, then with an option switched on (``POLICY_NAMES``).
POLICY_CHOICES = POLICY_NAMES


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


# -- the text table ------------------------------------------------------------
#: Short cell values of the text table. Every one has a line in the legend.
_USAGE = {Usage.NONE: "-", Usage.ROWWISE: "row", Usage.COLUMNWISE: "col", Usage.BOTH: "row+col"}
_SOURCE = {
    BackwardSource.NONE: "-",
    BackwardSource.SAVED_WORKSPACE: "saved_ws",
    BackwardSource.SAVED_PARAMETER: "saved_param",
    BackwardSource.REQUANTIZE: "requant",
    BackwardSource.REGATHER: "regather",
    BackwardSource.HIGH_PRECISION: "hp",
}
_COLUMNWISE = {
    ColumnwiseSource.NOT_NEEDED: "-",
    ColumnwiseSource.FORWARD: "fwd",
    ColumnwiseSource.PARAMETER: "param",
    ColumnwiseSource.DERIVED: "derived",
    ColumnwiseSource.REQUANTIZED: "requant",
    ColumnwiseSource.GATHERED: "gathered",
}
_RELEASE = {Release.DERIVED_COLUMNWISE: "derived_col", Release.CACHED_WORKSPACE: "cache"}

_COLUMNS = ("cache", "forward", "backward", "dgrad col", "release", "param", "quantizers")
_INDENT = "  "

#: One line per term the table prints: setting words, cell values, column names.
LEGEND: dict[str, str] = {
    # settings
    "unsharded": "the weight is whole on every rank (single GPU, DDP, tensor parallel)",
    "fsdp2_reshard": "FSDP2, fully_shard(..., reshard_after_forward=True): gathered again for backward",
    "fsdp2_keep": "FSDP2, fully_shard(..., reshard_after_forward=False): the gathered weight stays until backward",
    "distributed_weight": "TE DistributedWeight (e.g. GTP): the module gathers the weight itself",
    "recompute:first": "first forward inside te.checkpoint (its output is recomputed before backward)",
    "recompute:recompute": "the recompute pass of te.checkpoint, run just before backward",
    "recompute:first(own)": "first forward of LayerNormMLP(checkpoint=True), the module's own recompute",
    "recompute:recompute(own)": "recompute pass of LayerNormMLP(checkpoint=True), run by the module in backward",
    "train": "grad enabled: backward will run",
    "no_grad": "torch.no_grad() or inference: no backward",
    "no_dgrad": "the input needs no gradient: backward computes no dgrad",
    "hp_weight": "the parameter is high precision (bf16/fp32); TE quantizes it into a workspace",
    "qparam": "the parameter is already quantized (built under te.quantized_model_init)",
    "mb:none": "is_first_microbatch=None: no gradient accumulation, no cache",
    "mb:first": "is_first_microbatch=True: first microbatch of a step",
    "mb:later": "is_first_microbatch=False: a later microbatch, the weight has not changed",
    "override:high_precision": "backward_override='high_precision': dgrad reads the high-precision weight",
    "override:dequantized": "backward_override='dequantized': dgrad reads the dequantized rowwise weight",
    # columns
    "cache": "column: what happens to the module's cached workspace (microbatches)",
    "forward": "column: the usages forward quantizes",
    "backward": "column: what backward gets for dgrad, and its usages (source:usages)",
    "dgrad col": "column: where the columnwise data dgrad reads comes from",
    "release": "column: what is freed explicitly after backward",
    "param": "column: what a quantized parameter keeps between steps",
    "quantizers": "column: the quantizers that share the row's plan",
    # cell values
    "bypass": "cache: not cached, quantized for this call only",
    "fill": "cache: quantize and store in the cache",
    "reuse": "cache: use the cached workspace as it is",
    "read_only": "cache: read the cache if it is there, never write it",
    "-": "none, or not needed",
    "row": "rowwise data (fprop reads it)",
    "col": "columnwise data (dgrad reads it)",
    "row+col": "rowwise and columnwise data",
    "saved_ws": "backward: the workspace saved in forward",
    "saved_param": "backward: the quantized parameter itself",
    "requant": "quantized again from the high-precision weight in backward",
    "regather": "backward: the distributed weight is gathered again",
    "hp": "backward: the high-precision weight (no quantized copy)",
    "fwd": "dgrad col: made by forward, with the rowwise data",
    "derived": "dgrad col: derived from rowwise data, without requantizing",
    "gathered": "dgrad col: columnwise data arrives with FSDP2's all-gather",
    "derived_col": "release: derived columnwise data on the parameter, which FSDP2 cannot free (TE#2717)",
    "all": "quantizers: every quantizer shown agrees on the row",
}


@dataclass(frozen=True)
class _Group:
    """The quantizers of one setting that share one plan."""

    plan: WorkspacePlan
    names: tuple[str, ...]
    notes: tuple[str, ...]


def _recipe_names() -> dict[str, str]:
    """Profile name -> recipe name, for the profiles a TE recipe selects."""
    from ._profiles import RECIPE_PROFILES

    return {caps.name: recipe for recipe, caps in RECIPE_PROFILES.items()}


def quantizer_label(profile: str) -> str:
    """The name a TE user knows: the recipe's, else the profile's."""
    return _recipe_names().get(profile, profile)


def _merged_notes(rows: list[DecisionRow]) -> tuple[str, ...]:
    """The notes of rows that share a plan; a note that differs only in the
    quantizer's name is written once, naming all of them."""
    marker = "\x00"
    merged: dict[str, list[str]] = {}
    for row in rows:
        name = row.context.capabilities.name
        for note in row.plan.notes:
            names = merged.setdefault(note.replace(name, marker), [])
            if name not in names:
                names.append(name)
    return tuple(t.replace(marker, ", ".join(quantizer_label(x) for x in n)) for t, n in merged.items())


def group_settings(rows: list[DecisionRow]) -> dict[str, dict[str, list[_Group]]]:
    """Per policy, per setting: the plans, each with the quantizers that share
    it. One group when the quantizers agree; ``("all",)`` names every quantizer."""
    by_setting: dict[str, dict[str, dict[WorkspacePlan, list[DecisionRow]]]] = {}
    for row in rows:
        plans = by_setting.setdefault(row.policy, {}).setdefault(row.setting(), {})
        plans.setdefault(row.plan, []).append(row)
    everyone = {r.context.capabilities.name for r in rows}
    out: dict[str, dict[str, list[_Group]]] = {}
    for policy, settings in by_setting.items():
        out[policy] = {}
        for setting, plans in settings.items():
            groups = []
            for plan, members in plans.items():
                names = tuple(quantizer_label(r.context.capabilities.name) for r in members)
                if len(plans) == 1 and {r.context.capabilities.name for r in members} == everyone:
                    names = ("all",)
                groups.append(_Group(plan, names, _merged_notes(members)))
            out[policy][setting] = groups
    return out


def plan_cells(plan: WorkspacePlan) -> tuple[str, ...]:
    """The six plan cells of a row, in the table's short words."""
    backward = _SOURCE[plan.backward_source]
    if plan.backward_usage is not Usage.NONE:
        backward += ":" + _USAGE[plan.backward_usage]
    release = "+".join(v for k, v in _RELEASE.items() if k in plan.release) or "-"
    return (plan.cache.value, _USAGE[plan.forward_usage], backward, _COLUMNWISE[plan.columnwise_source],
            release, _USAGE[plan.parameter_keeps])


def _wrap(text: str, width: int, first: str, rest: str, sep: str = " ") -> list[str]:
    """``text`` split at ``sep`` into lines of at most ``width``, the first
    starting with ``first``, the others with ``rest`` (a word longer than a
    line gets a line of its own)."""
    lines: list[str] = []
    line = ""
    for word in text.split(sep):
        prefix = rest if lines else first
        joined = f"{line}{sep}{word}" if line else word
        if line and len(prefix) + len(joined) > width:
            lines.append(prefix + line + sep.rstrip())
            line = word
        else:
            line = joined
    return lines + [(rest if lines else first) + line]


def _cell_terms(cell: str) -> list[str]:
    """The legend terms of one cell: the cell itself, else its parts."""
    if cell in LEGEND:
        return [cell]
    return [t for part in cell.split(":") for t in ([part] if part in LEGEND else part.split("+"))]


def _plan_lines(key: str, group: _Group, widths: list[int], width: int, why: bool) -> list[str]:
    cells = (key, *plan_cells(group.plan))
    head = _INDENT + "  ".join(c.ljust(w) for c, w in zip(cells, widths)) + "  "
    if len(head) + max(len(n) + 1 for n in group.names) <= width:
        lines = _wrap(", ".join(group.names), width, head, " " * len(head), sep=", ")
    else:  # no room beside the plan: the quantizers go below it
        lines = [head.rstrip()] + _wrap(", ".join(group.names), width, _INDENT * 3, _INDENT * 3, sep=", ")
    if why:
        for note in group.notes:
            lines += _wrap(f"why: {note}", width, _INDENT * 3, _INDENT * 3 + "     ")
    return lines


def _split_setting(setting: str) -> tuple[str, str]:
    """(heading, row key): the microbatch position is the row key, so that a
    heading holds the up to three positions of one setting."""
    words = setting.split()
    key = next((w for w in words if w.startswith("mb:")), "")
    return " ".join(w for w in words if w != key), key


def _legend_terms(rows: list[DecisionRow]) -> dict[str, str]:
    """Term -> meaning for every term the table of ``rows`` prints, in the
    order: columns, settings, cell values, quantizers."""
    settings: dict[str, None] = {}
    values: dict[str, None] = {}
    for policy_settings in group_settings(rows).values():
        for setting, groups in policy_settings.items():
            settings.update(dict.fromkeys(setting.split()))
            for group in groups:
                for cell in plan_cells(group.plan):
                    values.update(dict.fromkeys(_cell_terms(cell)))
                if group.names == ("all",):
                    values["all"] = None
    terms = {t: LEGEND[t] for t in (*_COLUMNS, *settings, *values)}
    for profile in dict.fromkeys(r.context.capabilities.name for r in rows):
        recipe = _recipe_names().get(profile)
        terms[quantizer_label(profile)] = (
            f"TE recipe; its weight quantizer's capability profile is {profile}"
            if recipe else "capability profile that no TE recipe selects by default"
        )
    return terms


def render_legend(rows: list[DecisionRow], width: int = 120) -> str:
    """One line per term that the table of ``rows`` prints (wrapped to ``width``)."""
    terms = _legend_terms(rows)
    pad = max(len(t) for t in terms)
    lines = ["legend:"]
    for term, meaning in terms.items():
        lines += _wrap(f"{term.ljust(pad)}  {meaning}", width, _INDENT, _INDENT + " " * (pad + 2))
    return "\n".join(lines)


def render_text(rows: list[DecisionRow], *, width: int = 120, why: bool = False) -> str:
    """Per policy, a heading per setting without its microbatch position,
    then a row per position: its plan once if every quantizer agrees, else
    one row per group of quantizers that agree, under each other. Then the
    legend. Lines are at most ``width`` wide, save a single word longer than a line."""
    grouped = group_settings(rows)
    columns = ("", *_COLUMNS[:-1])
    widths = [len(c) for c in columns]
    for settings in grouped.values():
        for setting, groups in settings.items():
            for group in groups:
                cells = (_split_setting(setting)[1], *plan_cells(group.plan))
                widths = [max(w, len(c)) for w, c in zip(widths, cells)]
    header = _INDENT + "  ".join(c.ljust(w) for c, w in zip(columns, widths)) + "  " + _COLUMNS[-1]
    blocks = []
    for policy, settings in grouped.items():
        body = [f"== policy: {policy} ==", header, _INDENT + "-" * (len(header) - len(_INDENT))]
        heading = None
        for setting, groups in settings.items():
            top, key = _split_setting(setting)
            if top != heading:
                body.append(top)
                heading = top
            for i, group in enumerate(groups):
                body += _plan_lines(key if i == 0 else "", group, widths, width, why)
        blocks.append("\n".join(body))
    return "\n\n".join(blocks + [render_legend(rows, width)]) + "\n"
