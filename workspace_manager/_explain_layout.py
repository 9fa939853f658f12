"""The decision table's layout: ``explain``'s text and JSON.

What the rows are and the facts they state is ``_explain.py``'s; this
module says how a row reads: its setting in short words, its plan in
cells, the rows grouped per heading and merged where they print the same,
wrapped to a width, and one legend of every word the tables print.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ._context import QuantizerCapabilities, RecomputePass, RecomputeScope, ShardGather, Sharding, WorkspaceContext
from ._errors import UnknownProfileError, UnknownRecipeError
from ._explain import DecisionRow, decision_table, quantizer_label, recipe_names, registered_module_kinds
from ._plan import BackwardSource, ColumnwiseSource, Release, Usage, WorkspaceOrigin, WorkspacePlan
from ._profiles import PROFILES, RECIPE_PROFILES
from ._selection import named_policy

__all__ = ["explain", "MIN_WIDTH", "profile_choices", "selected_profiles", "setting_words", "plan_cells", "LEGEND",
           "legend_terms", "render_legend", "render_text", "render_json", "group_settings", "SettingBlock",
           "setting_blocks", "TextOptions", "module_kinds_text"]


def setting_words(ctx: WorkspaceContext) -> str:
    """The setting of ``ctx`` in the table's short words (each in the
    legend), e.g. ``fsdp2_reshard train hp_weight mb:first``."""
    parts = ["unsharded" if ctx.sharding is Sharding.NONE else ctx.sharding.value]
    if ctx.recompute is not RecomputePass.NONE:
        own = "(own)" if ctx.recompute_scope is RecomputeScope.MODULE else ""
        parts.append(f"recompute:{ctx.recompute.value}{own}")
    parts.append("train" if ctx.grad_enabled else "no_grad")
    if not ctx.input_requires_grad:
        parts.append("no_dgrad")
    parts.append("qparam" if ctx.is_quantized_param else "hp_weight")
    if ctx.shard_gather is not ShardGather.NONE:
        parts.append(f"gather:{ctx.shard_gather.value}")
    parts.append(f"mb:{ctx.microbatch.value}")
    if ctx.backward_override.value != "none":
        parts.append(f"override:{ctx.backward_override.value}")
    return " ".join(parts)


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

#: The meaning of every term the tables print: setting words, cell values,
#: column names. Short names, not definitions: the values they name are
#: defined in ``_context.py`` and ``_plan.py``, the policies in ``_policy.py``
#: ([Note: where the policies are described]). The legend joins them with
#: "; ", so no meaning holds one.
LEGEND: dict[str, str] = {
    # settings
    "unsharded": "whole weight on each rank (one GPU, DDP, tensor parallel)",
    "fsdp2_reshard": "FSDP2, reshard_after_forward=True (gathered again for backward)",
    "fsdp2_keep": "FSDP2, reshard_after_forward=False (kept until backward)",
    "fsdp2_any": "both FSDP2 shardings alike",
    "recompute:first(any)": "te.checkpoint's or LayerNormMLP's own first forward",
    "recompute:recompute(any)": "te.checkpoint's or LayerNormMLP's own recompute pass",
    "distributed_weight": "TE DistributedWeight (e.g. GTP): the module gathers it",
    "recompute:first": "te.checkpoint's first forward, recomputed before backward",
    "recompute:recompute": "te.checkpoint's recompute pass, just before backward",
    "recompute:first(own)": "first forward of LayerNormMLP(checkpoint=True), the one module with its own recompute",
    "recompute:recompute(own)": "LayerNormMLP(checkpoint=True)'s recompute, in backward",
    "train": "grad enabled",
    "no_grad": "grad disabled",
    "no_dgrad": "the input needs no gradient, so backward computes no dgrad",
    "hp_weight": "high-precision weight",
    "qparam": "quantized parameter (te.quantized_model_init)",
    "gather:one_rank": "a quantized all-gather is set up for the weight, FSDP2 over one rank",
    "gather:many_ranks": "a quantized all-gather is set up for the weight, FSDP2 over two ranks or more",
    "gather:set_up": "a quantized all-gather is set up for the weight, at any world size alike",
    "mb:none": "is_first_microbatch=None (no gradient accumulation)",
    "mb:first": "is_first_microbatch=True (a step's first microbatch)",
    "mb:later": "is_first_microbatch=False (a later one, same weight)",
    "mb:any": "every microbatch position alike",
    "override:high_precision": "backward_override='high_precision' (dgrad reads the high-precision weight)",
    "override:dequantized": "backward_override='dequantized' (dgrad reads the dequantized rowwise weight)",
    # columns
    "cache": "the module's cached workspace",
    "forward": "the usages forward quantizes",
    "backward": "what dgrad gets (source:usages)",
    "dgrad col": "the source of its columnwise data",
    "release": "freed after backward",
    "param": "what a quantized parameter keeps",
    "quantizers": "those sharing the plan (blank: all)",
    "for": "the quantizers of the row below (none: all)",
    # cell values
    "bypass": "not cached",
    "fill": "quantize and store in the cache",
    "reuse": "use the cached workspace as it is",
    "read_only": "read the cache if it is there, never write it",
    "shard": "made from the shard before FSDP2's all-gather, once per step (the gather sends it quantized)",
    "-": "none",
    "row": "rowwise data (fprop)",
    "col": "columnwise data (dgrad)",
    "row+col": "both",
    "saved_ws": "the workspace saved in forward",
    "saved_param": "the quantized parameter",
    "requant": "requantized from the high-precision weight",
    "regather": "the distributed weight, gathered again",
    "hp": "the high-precision weight (no quantized copy)",
    "fwd": "made by forward, with the rowwise data",
    "derived": "made from rowwise data",
    "gathered": "sent by FSDP2's all-gather",
    "derived_col": "derived columnwise data (FSDP2 cannot free it)",
    "all but": "all except those named",
}
#: Cell values spelled as a column's name: what they mean in the cells.
_CELL_MEANINGS = {"cache": "the cached workspace (release)", "param": "the quantized parameter's own (dgrad col)"}


@dataclass(frozen=True)
class _Group:
    """The quantizers of one setting that share one plan."""

    plan: WorkspacePlan
    names: tuple[str, ...]
    notes: tuple[str, ...]


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
        plans = by_setting.setdefault(row.policy, {}).setdefault(setting_words(row.context), {})
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
    """The six plan cells of a row, in the table's short words. The cache
    cell says ``shard`` for a workspace made from the shard (once per step,
    the copy every call of the step reads; its cache action is ``bypass``)."""
    backward = _SOURCE[plan.backward_source]
    if plan.backward_usage is not Usage.NONE:
        backward += ":" + _USAGE[plan.backward_usage]
    release = "+".join(v for k, v in _RELEASE.items() if k in plan.release) or "-"
    cache = "shard" if plan.workspace_origin is WorkspaceOrigin.SHARD else plan.cache.value
    return (cache, _USAGE[plan.forward_usage], backward, _COLUMNWISE[plan.columnwise_source],
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


@dataclass(frozen=True)
class SettingBlock:
    """One heading of the text table (a setting without its microbatch
    position) and its rows: (position, the groups of quantizers that share a
    plan). Merged blocks say ``mb:any`` or ``fsdp2_any`` where every
    position, or both FSDP2 shardings, give the same plans."""

    heading: str
    rows: tuple[tuple[str, tuple[_Group, ...]], ...]


def _split_setting(setting: str) -> tuple[str, str]:
    """(heading, row key): the microbatch position is the row key, so that a
    heading holds the up to three positions of one setting."""
    words = setting.split()
    key = next((w for w in words if w.startswith("mb:")), "")
    return " ".join(w for w in words if w != key), key


def _blocks(settings: dict[str, list[_Group]]) -> list[SettingBlock]:
    by_heading: dict[str, list[tuple[str, tuple[_Group, ...]]]] = {}
    for setting, groups in settings.items():
        heading, key = _split_setting(setting)
        by_heading.setdefault(heading, []).append((key, tuple(groups)))
    return [SettingBlock(h, tuple(r)) for h, r in by_heading.items()]


def _shown(groups: tuple[_Group, ...], why: bool) -> tuple:
    """What the table prints of a row's groups: cells and quantizers (and,
    with ``why``, the reasons). Rows that print the same may be merged."""
    return tuple((plan_cells(g.plan), g.names, g.notes if why else ()) for g in groups)


def _merge_microbatches(block: SettingBlock, why: bool) -> SettingBlock:
    """One ``mb:any`` row where every microbatch position prints the same."""
    shown = {_shown(groups, why) for _, groups in block.rows}
    if len(block.rows) > 1 and len(shown) == 1:
        return SettingBlock(block.heading, (("mb:any", block.rows[0][1]),))
    return block


@dataclass(frozen=True)
class _Merge:
    """Setting words that ``merged`` stands for where every one of them
    prints the same rows, the rest of the heading being equal."""

    words: tuple[str, ...]
    merged: str


#: The heading words merged where they agree (the microbatch position, the
#: row key, is merged by :func:`_merge_microbatches`).
_MERGES = (
    _Merge((Sharding.FSDP2_RESHARD.value, Sharding.FSDP2_KEEP.value), "fsdp2_any"),
    _Merge(("recompute:first", "recompute:first(own)"), "recompute:first(any)"),
    _Merge(("recompute:recompute", "recompute:recompute(own)"), "recompute:recompute(any)"),
    _Merge((f"gather:{ShardGather.ONE_RANK.value}", f"gather:{ShardGather.MANY_RANKS.value}"), "gather:set_up"),
)


def _merge_words(blocks: list[SettingBlock], merge: _Merge, why: bool) -> list[SettingBlock]:
    """One block with ``merge.merged`` where the blocks with each of
    ``merge.words`` print the same, in the place of the first of them."""
    def split(block: SettingBlock) -> tuple[str | None, tuple[str, ...]]:
        words = block.heading.split()
        at = next((i for i, w in enumerate(words) if w in merge.words), None)
        return (None, ()) if at is None else (words[at], (*words[:at], "\0", *words[at + 1:]))

    alike: dict[tuple[str, ...], dict[str, tuple]] = {}
    for block in blocks:
        word, rest = split(block)
        if word is not None:
            alike.setdefault(rest, {})[word] = tuple((k, _shown(g, why)) for k, g in block.rows)
    merged = {rest for rest, by in alike.items() if len(by) == len(merge.words) and len(set(by.values())) == 1}
    out: list[SettingBlock] = []
    for block in blocks:
        word, rest = split(block)
        if rest not in merged:
            out.append(block)
        elif word == next(iter(alike[rest])):
            out.append(SettingBlock(" ".join(merge.merged if w == "\0" else w for w in rest), block.rows))
    return out


def setting_blocks(
    rows: list[DecisionRow], *, merge: bool = True, why: bool = False
) -> dict[str, list[SettingBlock]]:
    """Per policy, the text table's headings with their rows. With ``merge``,
    settings whose microbatch positions (or FSDP2 shardings) print the same
    are one (with ``why``, their reasons must agree too)."""
    out = {}
    for policy, settings in group_settings(rows).items():
        blocks = _blocks(settings)
        if merge:
            blocks = [_merge_microbatches(b, why) for b in blocks]
            for word_merge in _MERGES:
                blocks = _merge_words(blocks, word_merge, why)
        out[policy] = blocks
    return out


@dataclass(frozen=True)
class _Layout:
    """The columns' widths, the line width, whether reasons are printed,
    the quantizers of the policy's table (for ``all but ...``) and whether
    the table has a quantizers column (else a row's quantizers go on a
    ``for ...:`` line above it)."""

    widths: tuple[int, ...]
    width: int
    why: bool
    everyone: tuple[str, ...]
    column: bool = True


def _quantizers(names: tuple[str, ...], room: int, everyone: tuple[str, ...]) -> str:
    """The quantizers of a row, listed; ``all but ...`` instead where the
    list does not fit ``room`` and naming the others is shorter."""
    listed = ", ".join(names)
    others = [n for n in everyone if n not in names]
    if len(listed) <= room or not others or len(others) >= len(names) or set(names) - set(everyone):
        return listed
    return "all but " + ", ".join(others)


def _row_head(key: str, group: _Group, layout: _Layout) -> str:
    """A row's key and plan cells, padded to the columns, up to the quantizers column."""
    cells = (key, *plan_cells(group.plan))
    return _INDENT + "  ".join(c.ljust(w) for c, w in zip(cells, layout.widths)) + "  "


def _fits_beside(key: str, group: _Group, layout: _Layout) -> bool:
    """Whether the quantizers of a row fit beside its cells (a name per line at worst)."""
    names = _quantizers(group.names, layout.width - len(_INDENT) * 3, layout.everyone)
    return len(_row_head(key, group, layout)) + max(len(n) for n in names.split(", ")) + ("," in names) <= layout.width


def _plan_lines(key: str, group: _Group, layout: _Layout) -> list[str]:
    """A row: its key, the plan's cells and the quantizers that share it
    (none where all do): beside the cells in the quantizers column, else on
    a line of their own above the row, ``for ...:``, which says whose row
    follows (below a row it would read as the next row's heading)."""
    width = layout.width
    head, under = _row_head(key, group, layout), _INDENT * 3
    names = _quantizers(group.names, width - len(under), layout.everyone)
    if group.names == ("all",):
        lines = [head.rstrip()]
    elif layout.column and _fits_beside(key, group, layout):
        lines = _wrap(names, width, head, " " * len(head), sep=", ")
    else:
        at = " " * (len(_INDENT) + layout.widths[0] + 2)  # where the cells start
        lines = [*_wrap(f"for {names}:", width, at, at + _INDENT * 2, sep=", "), head.rstrip()]
    if layout.why:
        for note in group.notes:
            lines += _wrap(f"why: {note}", width, under, under + "     ")
    return lines


def _table_lines(blocks: list[SettingBlock], width: int, why: bool,
                 everyone: tuple[str, ...]) -> tuple[list[str], tuple[str, ...]]:
    """The column header, then per heading its rows; and the columns the
    header names. The quantizers column is there where its name fits and
    some row's quantizers fit beside it; otherwise rows name their
    quantizers on a ``for ...:`` line above them."""
    columns = ("", *_COLUMNS[:-1])
    widths = [len(c) for c in columns]
    rows = [(key if i == 0 else "", group) for block in blocks for key, groups in block.rows
            for i, group in enumerate(groups)]
    for key, group in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, (key, *plan_cells(group.plan)))]
    header = _INDENT + "  ".join(c.ljust(w) for c, w in zip(columns, widths))
    layout = _Layout(tuple(widths), width, why, everyone)
    column = len(header) + 2 + len(_COLUMNS[-1]) <= width and any(
        g.names != ("all",) and _fits_beside(k, g, layout) for k, g in rows)
    layout = _Layout(tuple(widths), width, why, everyone, column)
    lines = [header + "  " + _COLUMNS[-1] if column else header.rstrip()]  # indented words: no rule needed
    for block in blocks:
        lines += _wrap(block.heading, width, "", _INDENT)
        for key, groups in block.rows:
            for i, group in enumerate(groups):
                lines += _plan_lines(key if i == 0 else "", group, layout)
    return lines, _COLUMNS if column else _COLUMNS[:-1]


def _summary_lines(policy: str, width: int) -> list[str]:
    """The policy's constructor and its one-line summaries, wrapped."""
    from ._summary import POLICY_SUMMARIES

    summary = POLICY_SUMMARIES.get(policy)
    if summary is None:
        return []
    lines = _wrap(summary.construct, width, _INDENT, _INDENT * 3, sep=", ")
    pad = max(len(label) for label, _ in summary.lines()) + 2
    for label, text in summary.lines():
        lines += _wrap(text, width, _INDENT + f"{label}:".ljust(pad), _INDENT + " " * pad)
    return lines


#: The modules line where no binding registered its module kinds.
_ANY_MODULE = ("every module call alike: a plan depends on the call, not on the module kind (no binding has "
               "registered its module kinds in this process)")


def module_kinds_text() -> str:
    """The legend's modules line: which module calls the plans apply to.
    A plan depends on the call, not on the module kind, so one table holds
    for every kind a binding registered (``register_module_kind``); where
    none did (the CLI runs without a binding), the line says so."""
    kinds = registered_module_kinds()
    if not kinds:
        return _ANY_MODULE
    noted: dict[str, list[str]] = {}  # a note said of several kinds is said once
    for kind in kinds:
        if kind.note:
            noted.setdefault(kind.note, []).append(kind.name)
    notes = "; ".join(f"{_and([*names])}: {note}" for note, names in noted.items())
    return f"{_and([k.name for k in kinds])} calls alike" + (f" ({notes})" if notes else "")


def _and(names: list[str]) -> str:
    """``a, b and c``."""
    return ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else names[0]


def legend_terms(blocks: Iterable[SettingBlock], profiles: Iterable[str], *, capabilities: bool = False,
                 all_but: bool = False, columns: Iterable[str] = _COLUMNS,
                 above: bool = False) -> dict[str, dict[str, str]]:
    """The legend's paragraphs (columns, settings, cells, quantizers): term
    -> meaning for every term the tables of ``blocks`` print, each column
    their headers name (``columns``), and each quantizer of ``profiles``.
    ``all_but``: a table lists ``all but ...``; ``above``: a row's
    quantizers on a ``for ...:`` line above it."""
    settings: dict[str, None] = {}
    values: dict[str, None] = {}
    for block in blocks:
        settings.update(dict.fromkeys(block.heading.split()))
        for key, groups in block.rows:
            settings[key] = None
            for group in groups:
                for cell in plan_cells(group.plan):
                    values.update(dict.fromkeys(_cell_terms(cell)))
    if all_but:
        values["all but"] = None
    order = list(LEGEND)  # settings and cells in the legend's order, not the tables'
    return {
        "columns": {t: LEGEND[t] for t in (*_COLUMNS, "for") if t in columns or (t == "for" and above)},
        "settings": {t: LEGEND[t] for t in sorted(settings, key=order.index)},
        "cells": {t: _CELL_MEANINGS.get(t, LEGEND[t]) for t in sorted(values, key=order.index)},
        "quantizers": _quantizer_terms(list(dict.fromkeys(profiles)), capabilities),
    }


def _quantizer_terms(profiles: list[str], capabilities: bool) -> dict[str, str]:
    """Name -> meaning of each quantizer; the TE recipes in one entry where
    none was named (their capabilities are ``--recipe``'s to show)."""
    if not capabilities and profiles and all(p in recipe_names() for p in profiles):
        return {", ".join(map(quantizer_label, profiles)): "TE recipes (see --recipe)"}
    return {quantizer_label(p): _profile_meaning(p, capabilities) for p in profiles}


#: The capabilities, in the words of QuantizerCapabilities' fields.
_CAPABILITIES = ("columnwise_derivable", "derived_caches", "requantization_safe")


def _profile_meaning(profile: str, capabilities: bool) -> str:
    """What a quantizer name in the table stands for; with ``capabilities``,
    the capabilities it has (the table's plans follow from them)."""
    what = (f"TE recipe, profile {profile}" if profile in recipe_names()
            else "a profile no TE recipe selects by default")
    caps = PROFILES.get(profile)
    if not capabilities or caps is None:
        return what
    held = [f for f in _CAPABILITIES if getattr(caps, f)]
    return f"{what}, with {', '.join(held) or 'none of ' + ', '.join(_CAPABILITIES)}"


def _legend_lines(terms: dict[str, dict[str, str]], width: int) -> list[str]:
    """One paragraph per category: its name, then ``term: meaning`` joined
    by ``; ``. A line breaks in a meaning, never in a term (``dgrad col``)."""
    keep = "\x00"  # stands for a space that must not break a line

    def unbroken(term: str) -> str:  # a list of terms may break after its commas
        return ", ".join(part.replace(" ", keep) for part in term.split(", "))

    lines = ["legend:"]
    paragraphs = [(category, "; ".join(f"{unbroken(term)}: {meaning}" for term, meaning in entries.items()))
                  for category, entries in terms.items() if entries]
    for category, text in [*paragraphs, ("modules", module_kinds_text())]:
        lines += [line.replace(keep, " ") for line in _wrap(f"{category}  {text}", width, _INDENT, _INDENT * 2)]
    return lines


@dataclass(frozen=True)
class TextOptions:
    """How :func:`render_text` lays the table out. ``width``: the most
    columns a line takes. ``why``: each plan's reasons under it. ``merge``:
    one row (``mb:any``, ``fsdp2_any``) for settings that print the same
    (``explain --full`` turns it off). ``capabilities``: the legend gives each
    quantizer's capabilities (``explain`` does when quantizers are named)."""

    width: int = 80
    why: bool = False
    merge: bool = True
    capabilities: bool = False


def render_legend(rows: list[DecisionRow], options: TextOptions = TextOptions()) -> str:
    """The one legend of the tables of ``rows``: every term they print (wrapped to the width)."""
    return "\n".join(_render(rows, options)[1])


def _render(rows: list[DecisionRow], options: TextOptions) -> tuple[list[str], list[str]]:
    """(each policy's text, the legend lines of all of them)."""
    width, blocks_of = options.width, setting_blocks(rows, merge=options.merge, why=options.why)
    texts, all_blocks, all_but, above, columns = [], [], False, False, set()
    for policy, blocks in blocks_of.items():
        profiles = list(dict.fromkeys(r.context.capabilities.name for r in rows if r.policy == policy))
        names = tuple(quantizer_label(p) for p in profiles)
        table, shown = _table_lines(blocks, width, options.why, names)
        all_but |= any(line.lstrip().startswith(("all but ", "for all but ")) for line in table)
        above |= any(line.lstrip().startswith("for ") and line.endswith(":") for line in table)
        columns.update(shown)
        texts.append("\n".join([f"== policy: {policy} ==", *_summary_lines(policy, width), "", *table]))
        all_blocks += blocks
    profiles = dict.fromkeys(r.context.capabilities.name for r in rows)
    terms = legend_terms(all_blocks, profiles, capabilities=options.capabilities, all_but=all_but, columns=columns,
                         above=above)
    return texts, _legend_lines(terms, width)


def render_text(rows: list[DecisionRow], options: TextOptions = TextOptions()) -> str:
    """Per policy: its constructor and what it is for, keeps and trades; a
    heading per setting without its microbatch position, then a row per
    position (one ``mb:any`` row where they agree, with ``merge``): its plan
    once if every quantizer agrees, else one row per group of quantizers that
    agree, under each other. Then one legend of every term the tables use.
    Lines are at most ``width`` wide, save a single word longer than a line."""
    texts, legend = _render(rows, options)
    return "\n\n".join([*texts, "\n".join(legend)]) + "\n"


# -- explain: names in, the table out ------------------------------------------
#: The narrowest table width: below it the plan columns of ``--full`` do not fit.
MIN_WIDTH = 80


def profile_choices() -> dict[str, QuantizerCapabilities]:
    """The names ``quantizer`` accepts: every profile's, and the recipes' as aliases."""
    return {**PROFILES, **RECIPE_PROFILES}


def _names(what: str, given: str | Iterable[str] | None) -> list[str]:
    """``given`` as a list of names: one name, several, or none."""
    if given is None:
        return []
    names = [given] if isinstance(given, str) else list(given)
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"explain: {what} must be a name or names (str); received {name!r} ({type(name).__name__})")
    return names


def _in_any_case(name: str, known: Mapping[str, QuantizerCapabilities], error: type[KeyError], what: str):
    """``known``'s entry for ``name``, ignoring case; ``error`` names the choices."""
    found = {key.lower(): value for key, value in known.items()}.get(name.lower())
    if found is None:
        raise error(f"{name!r} is no {what}; choose from {', '.join(known)} (any case)")
    return found


def selected_profiles(quantizers: Iterable[str] | None, recipes: Iterable[str] | None) -> list[QuantizerCapabilities]:
    """The profiles the names pick (any case), each once, in the order first
    named: the recipes, then the quantizers; every TE recipe's when none is named."""
    named = [_in_any_case(n, RECIPE_PROFILES, UnknownRecipeError, "TE recipe") for n in recipes or []]
    named += [_in_any_case(n, profile_choices(), UnknownProfileError, "capability profile or TE recipe")
              for n in quantizers or []]
    if not named:
        return list(RECIPE_PROFILES.values())
    return list({caps.name: caps for caps in named}.values())


def explain(
    policy: str | Iterable[str] | None = None,
    recipe: str | Iterable[str] | None = None,
    quantizer: str | Iterable[str] | None = None,
    *,
    full: bool = False,
    why: bool = False,
    width: int = 80,
    as_json: bool = False,
    gather: bool = False,
) -> str:
    """The decision table, as ``python -m workspace_manager explain`` prints
    it with the same options: ``policy`` (names of :data:`POLICY_NAMES`),
    ``recipe`` (TE recipe class names) and ``quantizer`` (capability profiles
    or recipes) narrow it, each a name or several, in any case; ``full``
    adds the dgrad and ``backward_override`` rows and merges none;
    ``gather`` (also in ``full``) adds the FSDP2 settings where a binding set
    up a quantized all-gather (``ShardGather``), whose plans say where the
    workspace is made (``WorkspacePlan.workspace_origin``); ``why``
    prints each plan's reasons; ``width`` (at least 80) wraps the text;
    ``as_json`` gives the rows as JSON instead. Unknown names raise
    UnknownPolicyError, UnknownRecipeError or UnknownProfileError."""
    policies = list(dict.fromkeys(_policy_name(n) for n in _names("policy", policy)))
    recipes, quantizers = _names("recipe", recipe), _names("quantizer", quantizer)
    if type(width) is not int or width < MIN_WIDTH:
        raise ValueError(f"explain: width must be an int of at least {MIN_WIDTH} columns; received {width!r}")
    rows = decision_table(selected_profiles(quantizers, recipes), policies or None, full=full, gather=gather)
    if as_json:
        return render_json(rows) + "\n"
    named = bool(recipes or quantizers)
    return render_text(rows, TextOptions(width=width, why=why, merge=not full, capabilities=named))


def _policy_name(name: str) -> str:
    """The shipped policy's own name for ``name`` (any case); unknown names raise."""
    named_policy(name)  # raises UnknownPolicyError, naming the choices
    return name.lower()
