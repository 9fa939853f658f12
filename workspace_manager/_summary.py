"""One line each of what a shipped policy is for, keeps and trades.

A digest of the normative text, which is the policies' own: the docstrings
of ``_policy.py`` (each policy class, each option enum, and [Note:
workspace lifetime] for the four decisions). ``explain`` prints these lines
under each policy's heading, and the README's policy table is made of them
(``tests/unit/test_readme.py`` keeps the two equal), so the short words a
newcomer reads first are the ones the code carries. Each entry's
constructor is derived from the shipped policy itself (:func:`constructor`),
and measured figures live in ``docs/decisions.md`` alone, which the option
entries link.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from types import MappingProxyType

from ._policy import Policy
from ._selection import POLICY_NAMES, named_policy

__all__ = ["PolicySummary", "POLICY_SUMMARIES", "DECISIONS_DOC", "constructor"]

#: Where the deliberate differences from TE (D1 to D11) are written down.
DECISIONS_DOC = "docs/decisions.md"


def constructor(policy: Policy) -> str:
    """The Python expression that builds ``policy`` (names from
    ``workspace_manager``): its class, the policies it wraps, and the
    options that differ from their defaults, e.g.
    ``FSDP2WorkspacePolicy(microbatch_cache=MicrobatchCache.EXACT_FORMATS)``."""
    args = []
    for f in fields(policy):
        value = getattr(policy, f.name)
        if not f.init or (not isinstance(value, Policy) and f.default is not MISSING and value == f.default):
            continue
        shown = constructor(value) if isinstance(value, Policy) else (
            f"{type(value).__name__}.{value.name}" if isinstance(value, enum.Enum) else repr(value))
        args.append(f"{f.name}={shown}")
    return f"{type(policy).__name__}({', '.join(args)})"


@dataclass(frozen=True)
class PolicySummary:
    """A shipped policy in short cells: what it is ``for`` (``use``), what
    it keeps, what it trades. ``option`` names the entry of
    :data:`DECISIONS_DOC` of an option that is off by default (None: a
    default, or a policy only ever pinned); ``entry`` the entry of a
    difference from TE that is not an option off by default."""

    name: str
    use: str
    keeps: str
    trade_off: str
    option: str | None = None
    entry: str | None = None

    @property
    def construct(self) -> str:
        """The expression that builds the shipped policy of this name."""
        return constructor(named_policy(self.name))

    def lines(self) -> tuple[tuple[str, str], ...]:
        """(label, text) pairs, in the order ``explain`` prints them."""
        use = self.use
        if self.option is not None:
            use += f"; option, off by default ({DECISIONS_DOC}, {self.option.split('-')[0]})"
        if self.entry is not None:
            use += f" ({DECISIONS_DOC}, {self.entry.split('-')[0]})"
        cells = (("for", use), ("keeps", self.keeps), ("trade-off", self.trade_off))
        return tuple((label, text.replace("`", "")) for label, text in cells)

    def markdown_row(self) -> str:
        """The README's table row of this policy."""
        use = self.use
        if self.option is not None:
            use += f"; option ([{self.option.split('-')[0]}]({DECISIONS_DOC}#{self.option.lower()}))"
        if self.entry is not None:
            use += f" ([{self.entry.split('-')[0]}]({DECISIONS_DOC}#{self.entry.lower()}))"
        cells = (f"`{self.name}`", use, self.keeps, self.trade_off)
        return "| " + " | ".join(cells) + " |"


_SUMMARIES = (
    PolicySummary(
        "plain",
        use="whole weights: one GPU, DDP, tensor parallel",
        keeps="forward's workspace until backward; with microbatches, a cached copy per weight",
        trade_off="TE's: backward quantizes nothing",
    ),
    PolicySummary(
        "fsdp2",
        use="weights sharded by FSDP2's `fully_shard`",
        keeps="nothing past the GEMM; with a quantized gather, the shard per step",
        trade_off="TE's: backward quantizes the gathered weight again (per microbatch)",
        entry="D13-fsdp2-the-workspace-follows-the-shard",
    ),
    PolicySummary(
        "recompute",
        use="whole weights under `te.checkpoint` or `LayerNormMLP(checkpoint=True)`",
        keeps="nothing from the first pass; the recompute pass saves what backward reads",
        trade_off="TE's: one quantization per pass",
    ),
    PolicySummary(
        "fsdp2_recompute",
        use="`fully_shard`-ed weights under `te.checkpoint`",
        keeps="nothing: backward quantizes the gathered weight again, as TE does",
        trade_off="TE's: one quantization per pass, one more in backward",
    ),
    PolicySummary(
        "distributed_weight",
        use="TE `DistributedWeight` (e.g. GTP)",
        keeps="nothing: backward gathers the weight again",
        trade_off="TE's: backward gathers and quantizes again",
    ),
    PolicySummary(
        "lean",
        use="whole bf16 weights, memory scarcer than time; only pinned",
        keeps="nothing from forward to backward: backward quantizes again for dgrad",
        trade_off="one more quantization per weight per step",
    ),
    PolicySummary(
        "keep_for_backward",
        use="`fully_shard`-ed bf16 weights, time scarcer than memory; only pinned",
        keeps="forward's columnwise copy until this layer's backward",
        trade_off="1 byte per kept parameter buys backward's quantization (`apply_workspace_budget` pins it)",
    ),
    PolicySummary(
        "fsdp2_microbatch_cache",
        use="`fully_shard(..., reshard_after_forward=False)` with microbatches",
        keeps="one workspace per weight for the step (formats that requantize exactly)",
        trade_off="a copy per weight for the step buys later microbatches' quantizations",
        option="D4-option-fsdp2-keep-caches-across-microbatches",
    ),
    PolicySummary(
        "fsdp2_recompute_build_once",
        use="`fully_shard`-ed weights under `te.checkpoint`",
        keeps="the recompute pass's columnwise copy, until that layer's backward",
        trade_off="more peak memory (measured in the option's entry) buys that backward's quantization",
        option="D3-option-recompute-pass-builds-once",
    ),
    PolicySummary(
        "fsdp2_quantized_gather_on",
        use="`fully_shard`-ed weights with a quantized gather, one GPU too; only pinned",
        keeps="the quantized shard (1 byte per parameter per rank) for the step",
        trade_off="that shard buys every call's quantization and half the gathered bytes",
        entry="D13-fsdp2-the-workspace-follows-the-shard",
    ),
)

#: The summary of each shipped policy, by its ``explain`` name.
POLICY_SUMMARIES: Mapping[str, PolicySummary] = MappingProxyType({s.name: s for s in _SUMMARIES})

if tuple(POLICY_SUMMARIES) != POLICY_NAMES:  # pragma: no cover - a new policy needs its summary
    raise RuntimeError(f"POLICY_SUMMARIES {tuple(POLICY_SUMMARIES)} differ from POLICY_NAMES {POLICY_NAMES}")
