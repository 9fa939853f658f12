"""One line each of what a shipped policy is for, keeps and trades.

``explain`` prints these under each policy's heading and the README's policy
table is made of them (``tests/unit/test_readme.py`` keeps the two equal),
so the short words a newcomer reads first are the ones the code carries.
The policies' docstrings and ``docs/decisions.md`` hold the details.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from ._selection import POLICY_NAMES

__all__ = ["PolicySummary", "POLICY_SUMMARIES", "DECISIONS_DOC"]

#: Where the deliberate differences from TE (D1 to D11) are written down.
DECISIONS_DOC = "docs/decisions.md"


@dataclass(frozen=True)
class PolicySummary:
    """A shipped policy in four short cells. ``construct`` is the Python
    expression that builds it (names from ``workspace_manager``); ``option``
    names the entry of :data:`DECISIONS_DOC` of an option that is off by
    default (None: a default, or a policy only ever pinned)."""

    name: str
    construct: str
    use: str
    keeps: str
    trade_off: str
    option: str | None = None

    def lines(self) -> tuple[tuple[str, str], ...]:
        """(label, text) pairs, in the order ``explain`` prints them."""
        use = self.use
        if self.option is not None:
            use += f"; option, off by default ({DECISIONS_DOC}, {self.option.split('-')[0]})"
        cells = (("for", use), ("keeps", self.keeps), ("trade-off", self.trade_off))
        return tuple((label, text.replace("`", "")) for label, text in cells)

    def markdown_row(self) -> str:
        """The README's table row of this policy."""
        use = self.use
        if self.option is not None:
            use += f"; option ([{self.option.split('-')[0]}]({DECISIONS_DOC}#{self.option.lower()}))"
        cells = (f"`{self.name}`", use, self.keeps, self.trade_off)
        return "| " + " | ".join(cells) + " |"


_SUMMARIES = (
    PolicySummary(
        "plain", "WorkspacePolicy()",
        use="whole weights: one GPU, DDP, tensor parallel",
        keeps="forward's workspace until backward; with microbatches, a cached copy per weight",
        trade_off="TE's: backward quantizes nothing",
    ),
    PolicySummary(
        "fsdp2", "FSDP2WorkspacePolicy()",
        use="weights sharded by FSDP2's `fully_shard`",
        keeps="nothing past the GEMM; derived columnwise data freed after backward",
        trade_off="TE's: backward quantizes the gathered weight again (per microbatch)",
    ),
    PolicySummary(
        "recompute", "RecomputeWorkspacePolicy(inner=WorkspacePolicy())",
        use="whole weights under `te.checkpoint` or `LayerNormMLP(checkpoint=True)`",
        keeps="nothing from the first pass; the recompute pass saves what backward reads",
        trade_off="TE's: one quantization per pass",
    ),
    PolicySummary(
        "fsdp2_recompute", "RecomputeWorkspacePolicy(inner=FSDP2WorkspacePolicy())",
        use="`fully_shard`-ed weights under `te.checkpoint`",
        keeps="nothing: backward quantizes the gathered weight again, as TE does",
        trade_off="TE's: one quantization per pass, one more in backward",
    ),
    PolicySummary(
        "distributed_weight", "DistributedWeightWorkspacePolicy()",
        use="TE `DistributedWeight` (e.g. GTP)",
        keeps="nothing: backward gathers the weight again",
        trade_off="TE's: backward gathers and quantizes again",
    ),
    PolicySummary(
        "lean", "LeanWorkspacePolicy()",
        use="whole bf16 weights, memory scarcer than time; only pinned",
        keeps="nothing from forward to backward: backward quantizes again for dgrad",
        trade_off="one more quantization per weight per step",
    ),
    PolicySummary(
        "keep_for_backward", "KeepForBackwardWorkspacePolicy()",
        use="`fully_shard`-ed bf16 weights, time scarcer than memory; only pinned",
        keeps="forward's columnwise copy until this layer's backward",
        trade_off="1 byte per kept parameter buys backward's quantization (`apply_workspace_budget` pins it)",
    ),
    PolicySummary(
        "fsdp2_microbatch_cache", "FSDP2WorkspacePolicy(microbatch_cache=MicrobatchCache.EXACT_FORMATS)",
        use="`fully_shard(..., reshard_after_forward=False)` with microbatches",
        keeps="one workspace per weight for the step (formats that requantize exactly)",
        trade_off="a copy per weight for the step buys later microbatches' quantizations",
        option="D4-option-fsdp2-keep-caches-across-microbatches",
    ),
    PolicySummary(
        "fsdp2_recompute_build_once",
        "RecomputeWorkspacePolicy(inner=FSDP2WorkspacePolicy(), recompute_copy=RecomputeCopy.BUILD_ONCE)",
        use="`fully_shard`-ed weights under `te.checkpoint`",
        keeps="the recompute pass's columnwise copy, until that layer's backward",
        trade_off="+1.8 to +2.3% peak (measured) buys that backward's quantization",
        option="D3-option-recompute-pass-builds-once",
    ),
)

#: The summary of each shipped policy, by its ``explain`` name.
POLICY_SUMMARIES: Mapping[str, PolicySummary] = MappingProxyType({s.name: s for s in _SUMMARIES})

if tuple(POLICY_SUMMARIES) != POLICY_NAMES:  # pragma: no cover - a new policy needs its summary
    raise RuntimeError(f"POLICY_SUMMARIES {tuple(POLICY_SUMMARIES)} differ from POLICY_NAMES {POLICY_NAMES}")
