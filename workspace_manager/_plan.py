"""What a policy decides for one call: a :class:`WorkspacePlan`.

Four decisions govern a workspace's life; which field of a plan answers
which is said once, in [Note: workspace lifetime] in
``workspace_manager._policy``. Each field is an enum, defined here with the
meaning of its values; ``notes`` says why, in words.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from ._context import _require_type
from ._errors import ContextTypeError, InvalidPlanError

__all__ = ["CacheAction", "Usage", "BackwardSource", "ColumnwiseSource", "Release", "WorkspaceOrigin", "WorkspacePlan"]


class CacheAction(enum.Enum):
    """What the call does with the module's workspace cache."""

    #: Quantize a fresh workspace; the cache is neither read nor written.
    BYPASS = "bypass"
    #: Quantize into the cache (refreshing an existing entry in place).
    FILL = "fill"
    #: Use the cached workspace as it is; the weight has not changed since it
    #: was filled. If it is missing or lacks a planned usage, fill it.
    REUSE = "reuse"
    #: Use the cached workspace if it holds the planned usages; otherwise
    #: quantize a fresh one and do not store it.
    READ_ONLY = "read_only"

    @property
    def writes(self) -> bool:
        """The call may store a workspace in the cache."""
        return self in (CacheAction.FILL, CacheAction.REUSE)


class Usage(enum.Flag):
    """Directions of quantized data: rowwise feeds fprop, columnwise feeds dgrad."""

    NONE = 0
    ROWWISE = enum.auto()
    COLUMNWISE = enum.auto()
    BOTH = ROWWISE | COLUMNWISE

    @property
    def label(self) -> str:
        return {0: "none", 1: "rowwise", 2: "columnwise", 3: "rowwise+columnwise"}[self.value]


class BackwardSource(enum.Enum):
    """The quantized weight backward uses, and where it comes from."""

    #: No quantized weight reaches backward (no grad, no dgrad, or a
    #: first recompute pass whose saved tensors are dropped).
    NONE = "none"
    #: The workspace forward quantized (or took from the cache), saved for backward.
    SAVED_WORKSPACE = "saved_workspace"
    #: The quantized parameter itself, saved for backward (for FSDP2 it is
    #: the gathered parameter; backward's all-gather refills it).
    SAVED_PARAMETER = "saved_parameter"
    #: Nothing quantized is saved; backward quantizes the high-precision
    #: weight again (under FSDP2 the weight backward gathers).
    REQUANTIZE = "requantize"
    #: Nothing is saved; backward gathers the distributed weight again and
    #: quantizes it if it arrives in high precision (TE's ``DistributedWeight``).
    REGATHER = "regather"
    #: ``backward_override="high_precision"``: dgrad reads the high-precision weight.
    HIGH_PRECISION = "high_precision"

    @property
    def saves_quantized(self) -> bool:
        """Forward keeps a quantized tensor alive for backward."""
        return self in (BackwardSource.SAVED_WORKSPACE, BackwardSource.SAVED_PARAMETER)


class ColumnwiseSource(enum.Enum):
    """Where dgrad's columnwise data comes from."""

    #: dgrad does not read columnwise data.
    NOT_NEEDED = "not_needed"
    #: Built by the forward quantization (saved workspace or cache).
    FORWARD = "forward"
    #: Carried by the quantized parameter since it was created.
    PARAMETER = "parameter"
    #: Derived from rowwise data after the fact (needs a derivable format).
    DERIVED = "derived"
    #: Quantized from the high-precision weight in backward.
    REQUANTIZED = "requantized"
    #: Sent by FSDP2's backward all-gather (formats that cannot derive it).
    GATHERED = "gathered"


class Release(enum.Flag):
    """What is released once the call's backward is done."""

    NOTHING = 0
    #: Clear derived columnwise data (an FP8 transpose, derived columnwise
    #: blocks) on the quantized parameter after this call's backward: the
    #: quantizer allocated it, so FSDP2's reshard cannot free it (TE#2717).
    DERIVED_COLUMNWISE = enum.auto()
    #: Drop the module's cached workspace after the step's last backward,
    #: instead of keeping it until the next FILL.
    CACHED_WORKSPACE = enum.auto()

    @property
    def label(self) -> str:
        if self is Release.NOTHING:
            return "nothing"
        parts = [m.name.lower() for m in (Release.DERIVED_COLUMNWISE, Release.CACHED_WORKSPACE) if m in self]
        return "+".join(parts)


class WorkspaceOrigin(enum.Enum):
    """Where the workspace the call's GEMMs read is made."""

    #: In the call, from the weight it receives: a high-precision weight (the
    #: whole weight, or the one FSDP2's all-gather brought) is quantized; a
    #: quantized parameter is taken as it is. TE's behaviour.
    CALL = "call"
    #: From the local FSDP2 shard, before the all-gather, once per optimizer
    #: step: each rank quantizes its shard with the whole weight's scale and
    #: FSDP2 gathers the quantized bytes, so the call receives the workspace
    #: ready-made (rowwise data; columnwise data is derived from it after the
    #: gather). The quantized shard is held until the weight is written again.
    SHARD = "shard"


@dataclass(frozen=True, slots=True)
class WorkspacePlan:
    """The four workspace decisions for one call, in eight fields: cache
    (``cache``, ``workspace_origin``); forward usage (``forward_usage``, ``parameter_keeps``);
    backward (``backward_source``, ``columnwise_source``,
    ``backward_usage``); release (``release``).

    Plans are values: equal inputs give equal plans, and plans hash, so a
    binding may memoize them per context.
    """

    cache: CacheAction
    """Is the workspace cached across calls, and is it refreshed this call."""
    forward_usage: Usage
    """Usages the forward quantization builds (for a quantized parameter:
    the usage forward reads; the parameter keeps the usages it has)."""
    backward_source: BackwardSource
    """What backward gets: saved workspace, saved parameter, or a rebuild."""
    backward_usage: Usage
    """Usages backward reads on that weight: columnwise for quantized dgrad,
    rowwise for ``backward_override="dequantized"``, none otherwise."""
    columnwise_source: ColumnwiseSource
    """Where dgrad's columnwise data comes from."""
    release: Release
    """What is released after backward."""
    parameter_keeps: Usage = Usage.NONE
    """For a quantized parameter: the usages its own (for FSDP2: sharded)
    copy keeps between steps; none for a high-precision weight."""
    notes: tuple[str, ...] = field(default=(), compare=False)
    """Why the plan is what it is, in words, for tables and reports."""
    # Last, after ``notes``: plans built with positional fields keep their meaning.
    workspace_origin: WorkspaceOrigin = WorkspaceOrigin.CALL
    """Where the workspace is made: in the call (TE's way), or from the FSDP2
    shard before its all-gather, once per optimizer step."""

    def __post_init__(self) -> None:
        _check_types(self)
        for problem in _contradictions(self):
            raise InvalidPlanError(f"Inconsistent WorkspacePlan {self.summary()}: {problem}")

    @property
    def saves_quantized(self) -> bool:
        return self.backward_source.saves_quantized

    def summary(self) -> str:
        return (
            f"cache={self.cache.value} forward={self.forward_usage.label} "
            f"backward={self.backward_source.value}({self.backward_usage.label}) "
            f"columnwise={self.columnwise_source.value} release={self.release.label}"
            + (f" parameter_keeps={self.parameter_keeps.label}" if self.parameter_keeps is not Usage.NONE else "")
            + (f" origin={self.workspace_origin.value}" if self.workspace_origin is not WorkspaceOrigin.CALL else "")
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "cache": self.cache.value,
            "forward_usage": self.forward_usage.label,
            "backward_source": self.backward_source.value,
            "backward_usage": self.backward_usage.label,
            "columnwise_source": self.columnwise_source.value,
            "release": self.release.label,
            "parameter_keeps": self.parameter_keeps.label,
            "workspace_origin": self.workspace_origin.value,
            "notes": list(self.notes),
        }


def _check_types(plan: WorkspacePlan) -> None:
    """Each decision is its enum (a string such as ``"bypass"`` is refused
    naming the members), so that the rules below compare like with like."""
    for name, expected in _FIELD_TYPES:
        value = getattr(plan, name)
        if type(value) is not expected:  # a member of the enum passes at once: plans are made per call
            _require_type("WorkspacePlan", name, value, expected)
    if not isinstance(plan.notes, tuple) or not all(isinstance(note, str) for note in plan.notes):
        raise ContextTypeError(f"WorkspacePlan.notes must be a tuple of str; received {plan.notes!r}")


_FIELD_TYPES = (("cache", CacheAction), ("forward_usage", Usage), ("backward_source", BackwardSource),
                ("backward_usage", Usage), ("columnwise_source", ColumnwiseSource), ("release", Release),
                ("parameter_keeps", Usage), ("workspace_origin", WorkspaceOrigin))


def _contradictions(plan: WorkspacePlan) -> list[str]:
    """Rules every plan obeys, whatever policy built it."""
    problems = []
    if plan.forward_usage not in (Usage.ROWWISE, Usage.BOTH):
        problems.append("forward_usage must include rowwise (fprop reads it)")
    if plan.parameter_keeps not in (Usage.NONE, Usage.ROWWISE, Usage.BOTH):
        problems.append("a quantized parameter keeps rowwise data (its all-gather and fprop read it)")
    if plan.backward_source in (BackwardSource.NONE, BackwardSource.HIGH_PRECISION):
        if plan.backward_usage is not Usage.NONE:
            problems.append(f"backward_source={plan.backward_source.value} reads no quantized weight")
    elif plan.backward_usage is Usage.NONE:
        problems.append(f"backward_source={plan.backward_source.value} but backward_usage is none")
    needs_columnwise = Usage.COLUMNWISE in plan.backward_usage
    if needs_columnwise != (plan.columnwise_source is not ColumnwiseSource.NOT_NEEDED):
        problems.append("columnwise_source must be not_needed exactly when backward reads no columnwise data")
    if plan.columnwise_source is ColumnwiseSource.FORWARD and (
        Usage.COLUMNWISE not in plan.forward_usage or plan.backward_source is not BackwardSource.SAVED_WORKSPACE
    ):
        problems.append("columnwise from forward needs a saved workspace built with columnwise usage")
    if plan.columnwise_source is ColumnwiseSource.REQUANTIZED and plan.backward_source not in (
        BackwardSource.REQUANTIZE,
        BackwardSource.REGATHER,
    ):
        problems.append("columnwise can be requantized only by a backward that requantizes or re-gathers")
    if plan.backward_source is BackwardSource.REQUANTIZE and needs_columnwise:
        if plan.columnwise_source is not ColumnwiseSource.REQUANTIZED:
            problems.append("a backward that requantizes for dgrad gets columnwise data by requantizing")
    if plan.columnwise_source is ColumnwiseSource.PARAMETER and plan.backward_source is not BackwardSource.SAVED_PARAMETER:
        problems.append("columnwise from the parameter needs backward_source=saved_parameter")
    if plan.columnwise_source is ColumnwiseSource.GATHERED and plan.backward_source not in (
        BackwardSource.SAVED_PARAMETER,
        BackwardSource.REGATHER,
    ):
        problems.append("columnwise from a gather needs a saved parameter or a re-gathered weight")
    if plan.workspace_origin is WorkspaceOrigin.SHARD:
        problems.extend(_shard_origin_contradictions(plan))
    return problems


def _shard_origin_contradictions(plan: WorkspacePlan) -> list[str]:
    """A workspace made from the shard arrives with FSDP2's all-gather as
    rowwise data: it is the gathered parameter, cached by no module, and
    dgrad's columnwise data can only be derived from it (nothing high
    precision arrives to requantize from)."""
    problems = []
    if plan.cache is not CacheAction.BYPASS:
        problems.append("a workspace made from the shard is cached by no module (cache must be bypass)")
    if plan.forward_usage is not Usage.ROWWISE:
        problems.append("a workspace made from the shard arrives with rowwise data only (forward_usage=rowwise)")
    if plan.backward_source not in (BackwardSource.NONE, BackwardSource.SAVED_PARAMETER):
        problems.append("a workspace made from the shard reaches backward as the gathered parameter "
                        "(backward_source saved_parameter, or none)")
    if plan.columnwise_source not in (ColumnwiseSource.NOT_NEEDED, ColumnwiseSource.DERIVED):
        problems.append("dgrad's columnwise data of a workspace made from the shard is derived after the gather")
    if plan.parameter_keeps is not Usage.NONE:
        problems.append("a workspace made from the shard belongs to a high-precision parameter (parameter_keeps=none)")
    return problems
