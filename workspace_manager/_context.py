"""The vocabulary a policy reads: what a module call looks like.

A binding (for example ``te_integration``) describes each call once, at the
boundary, as a :class:`WorkspaceContext`; everything downstream reads enums
and typed fields instead of the ``Optional[bool]`` and ``is_fsdp2`` flags TE
threads through its modules.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from ._errors import ContextTypeError, InvalidContextError

__all__ = [
    "Sharding",
    "RecomputePass",
    "RecomputeScope",
    "WeightSource",
    "Microbatch",
    "BackwardOverride",
    "ShardGather",
    "QuantizerCapabilities",
    "WorkspaceContext",
    "valid_contexts",
]


class Sharding(enum.Enum):
    """How the module's weight is distributed across ranks."""

    #: A whole weight on every rank (single GPU, DDP, tensor parallel shards).
    NONE = "none"
    #: FSDP2 with ``reshard_after_forward=True``: the weight is gathered for
    #: forward, freed, and gathered again for backward (ZeRO-3).
    FSDP2_RESHARD = "fsdp2_reshard"
    #: FSDP2 with ``reshard_after_forward=False``: the gathered weight stays
    #: from forward to backward, and between microbatches (ZeRO-2 style).
    FSDP2_KEEP = "fsdp2_keep"
    #: A distributed weight (TE's ``DistributedWeight``, e.g. GTP) that
    #: backward gathers again instead of keeping the forward copy.
    DISTRIBUTED_WEIGHT = "distributed_weight"

    # Members are singletons compared by identity: hash them by identity too,
    # in C. Enum's own __hash__ is Python code, which the bindings' per-call
    # memo keys would pay for on every module call.
    __hash__ = object.__hash__

    @property
    def is_fsdp2(self) -> bool:
        return self in (Sharding.FSDP2_RESHARD, Sharding.FSDP2_KEEP)


class RecomputePass(enum.Enum):
    """Where the call sits in activation recompute (``te.checkpoint``,
    ``LayerNormMLP(checkpoint=True)``)."""

    #: Not inside an activation-recompute region.
    NONE = "none"
    #: The region's first forward: its outputs are kept, its saved tensors are not.
    FIRST = "first"
    #: The forward replayed during backward; its saved tensors feed the
    #: backward that follows at once.
    RECOMPUTE = "recompute"

    # Members are singletons compared by identity: hash them by identity too,
    # in C. Enum's own __hash__ is Python code, which the bindings' per-call
    # memo keys would pay for on every module call.
    __hash__ = object.__hash__


class RecomputeScope(enum.Enum):
    """Who reruns the forward in a recompute pass. It decides what TE hands
    to backward, and so what a plan must match for identical numerics."""

    #: A checkpoint around the module (``te.checkpoint``). Its recompute
    #: pass runs before the module's backward; what that backward gets is
    #: decided apart from the pass (under FSDP2, TE quantizes again there).
    REGION = "region"
    #: The module's own recompute (``LayerNormMLP(checkpoint=True)``), run
    #: inside its backward: TE hands the workspaces the pass builds
    #: straight to that backward.
    MODULE = "module"

    # Members are singletons compared by identity: hash them by identity too,
    # in C. Enum's own __hash__ is Python code, which the bindings' per-call
    # memo keys would pay for on every module call.
    __hash__ = object.__hash__


class WeightSource(enum.Enum):
    """What the module's weight parameter holds."""

    #: A high-precision parameter (bf16/fp16/fp32) that forward quantizes.
    HIGH_PRECISION = "high_precision"
    #: An already quantized parameter: built under ``quantized_model_init``,
    #: or handed over quantized by the FSDP2 all-gather.
    QUANTIZED_PARAM = "quantized_param"


class Microbatch(enum.Enum):
    """The call's place in a gradient-accumulation sequence (TE's
    ``is_first_microbatch``: None, True, False)."""

    #: The caller gave no microbatch position: weights may change between calls.
    NONE = "none"
    #: The first microbatch of a step: weights were just updated.
    FIRST = "first"
    #: A later microbatch of the same step: weights are unchanged since FIRST.
    LATER = "later"

    @classmethod
    def from_is_first_microbatch(cls, value: bool | None) -> Microbatch:
        """Adapt TE's tri-state ``is_first_microbatch`` argument."""
        if value is None:
            return cls.NONE
        if value is True:
            return cls.FIRST
        if value is False:
            return cls.LATER
        raise ContextTypeError(
            f"is_first_microbatch must be None, True or False; received {value!r} "
            f"({type(value).__name__})"
        )


class BackwardOverride(enum.Enum):
    """TE's ``backward_override``: how dgrad uses the weight."""

    #: dgrad runs in low precision on the quantized weight's columnwise data.
    NONE = "none"
    #: dgrad uses the high-precision weight; no quantized weight reaches backward.
    HIGH_PRECISION = "high_precision"
    #: dgrad dequantizes the forward (rowwise) quantized weight.
    DEQUANTIZED = "dequantized"

    @classmethod
    def from_te(cls, value: str | None) -> BackwardOverride:
        """Adapt TE's ``backward_override`` (None or a string)."""
        if value is None:
            return cls.NONE
        try:
            return cls(value)
        except ValueError:
            allowed = ", ".join(repr(m.value) for m in cls if m is not cls.NONE)
            raise InvalidContextError(
                f"backward_override must be None or one of {allowed}; received {value!r}"
            ) from None


class ShardGather(enum.Enum):
    """Whether a quantized all-gather is set up for the weight: a binding
    that can make FSDP2 gather a quantized copy of the local shard instead
    of the high-precision shard says so, and over how many ranks. The policy
    decides whether the workspace is then made from the shard
    (``WorkspacePlan.workspace_origin``); a binding sets the gather up only
    where it does, and reports it at every later call of the weight."""

    #: FSDP2 gathers the weight in its own dtype (or the weight is not
    #: sharded by FSDP2): nothing quantized can arrive from the all-gather.
    NONE = "none"
    #: A quantized all-gather is set up; FSDP2 shards the weight over one
    #: rank (a mesh of one GPU), so the all-gather moves no bytes.
    ONE_RANK = "one_rank"
    #: A quantized all-gather is set up; FSDP2 shards the weight over two
    #: ranks or more.
    MANY_RANKS = "many_ranks"

    # Members are singletons compared by identity: hash them by identity too,
    # in C. Enum's own __hash__ is Python code, which the bindings' per-call
    # memo keys would pay for on every module call.
    __hash__ = object.__hash__

    @classmethod
    def for_world_size(cls, world_size: int) -> ShardGather:
        """The member for a quantized all-gather set up over ``world_size`` ranks."""
        if type(world_size) is not int or world_size < 1:
            raise ContextTypeError(f"ShardGather.for_world_size expects a number of ranks (an int of at least 1); "
                                   f"received {world_size!r}")
        return cls.ONE_RANK if world_size == 1 else cls.MANY_RANKS


def _require_type(owner: str, name: str, value: Any, expected: type) -> None:
    """Raise a ContextTypeError naming the field, the value and what is allowed."""
    if type(value) is expected:  # the common case, decided at once: a member of the enum, a bool
        return
    if isinstance(expected, type) and issubclass(expected, enum.Enum):
        if not isinstance(value, expected):
            # __members__, not iteration: iterating a Flag skips NONE and the combined members
            allowed = ", ".join(f"{expected.__name__}.{member}" for member in expected.__members__)
            raise ContextTypeError(
                f"{owner}.{name} must be a {expected.__name__} member ({allowed}); "
                f"received {value!r} ({type(value).__name__})"
            )
        return
    # bool is checked exactly: 0/1 and numpy booleans are rejected so that a
    # typo such as passing a count does not silently turn into True.
    if type(value) is not expected:
        raise ContextTypeError(
            f"{owner}.{name} must be a {expected.__name__}; received {value!r} "
            f"({type(value).__name__})"
        )


def _check_fields(obj: Any) -> None:
    """Every field of ``obj`` named in its class's ``_FIELD_TYPES`` has its type."""
    owner = type(obj).__name__
    for name, expected in obj._FIELD_TYPES.items():
        _require_type(owner, name, getattr(obj, name), expected)


@dataclass(frozen=True, slots=True)
class QuantizerCapabilities:
    """What a weight quantizer's format can do; the registry maps quantizer
    classes to one of these.

    The policies read four facts; ``name`` only labels tables and errors.
    """

    name: str
    """A short label, e.g. ``"float8_per_tensor"``."""
    columnwise_derivable: bool
    """Columnwise (transposed) data can be made from rowwise data after the
    fact, bit for bit: per-tensor FP8 (a transpose), 2D block FP8 and 2D NVFP4.
    MXFP8, 1D block FP8 and hybrid formats must quantize each direction from
    the high-precision weight."""
    derived_caches: bool
    """The quantized tensor keeps derived data (an FP8 transpose, derived
    columnwise blocks) in memory the quantizer allocated itself. FSDP2 frees
    only what it allocated, so such data must be cleared explicitly.
    Accepted without ``columnwise_derivable``, on purpose: a format whose
    directions are storages of their own, possibly of other formats (TE's
    hybrid), derives neither direction from the other, yet one direction's
    storage may derive and keep data of its own; the TE binding gives a
    hybrid its columnwise sub-quantizer's value. For other formats the two
    claims together make FSDP2 plans clear data that never exists, and the
    testing kit reports that it cannot check the claim."""
    requantization_safe: bool
    """Quantizing the same high-precision weight again reproduces the first
    quantization exactly (TE's ``is_requantization_safe``). False for delayed
    scaling and stochastic rounding. With an unsafe quantizer, FSDP2 does not
    cache across microbatches, a ``te.checkpoint`` recompute pass under FSDP2
    leaves dgrad's copy to the backward rebuild (as TE does), and a plan that
    rebuilds in backward says so in its notes."""
    shard_quantization_exact: bool = False
    """Each rank can quantize its FSDP2 shard (dim-0 rows) on its own to the
    bytes a quantization of the whole weight gives those rows, once the ranks
    have reduced one statistic of their shards with a MAX all-reduce
    (per-tensor current scaling: the amax; 2D block scaling: the grid of
    block amaxes). The FSDP2 policy makes a workspace from the shard before
    the all-gather only for such formats, and only where they also
    requantize exactly and derive columnwise data (dgrad's data is derived
    after the gather). False by default: a format claims it only where the
    claim holds bit for bit; false for delayed scaling, whose scale comes
    from an amax history rather than the weight."""

    _FIELD_TYPES = {
        "name": str,
        "columnwise_derivable": bool,
        "derived_caches": bool,
        "requantization_safe": bool,
        "shard_quantization_exact": bool,
    }

    def __post_init__(self) -> None:
        _check_fields(self)
        if not self.name.strip():
            raise InvalidContextError("QuantizerCapabilities.name must be a non-empty string; received ''")


@dataclass(frozen=True, slots=True)
class WorkspaceContext:
    """One module call, as a policy sees it. Build it once per call at the
    binding boundary; it is immutable and hashable."""

    capabilities: QuantizerCapabilities
    """The weight quantizer's capabilities (from the registry)."""
    sharding: Sharding = Sharding.NONE
    """How the weight is distributed."""
    recompute: RecomputePass = RecomputePass.NONE
    """The activation-recompute pass, if any."""
    recompute_scope: RecomputeScope = RecomputeScope.REGION
    """Who reruns the forward; only ``REGION`` without a recompute pass."""
    grad_enabled: bool = True
    """``torch.is_grad_enabled()`` during the call. False with no recompute
    pass means inference."""
    input_requires_grad: bool = True
    """Backward computes the input gradient (dgrad) through this weight.
    Linear passes ``inp.requires_grad``; LayerNormLinear and LayerNormMLP
    pass True, since their norm parameters need dgrad whatever the input."""
    weight: WeightSource = WeightSource.HIGH_PRECISION
    """Whether the weight arrives high precision or already quantized."""
    microbatch: Microbatch = Microbatch.NONE
    """The position in a gradient-accumulation sequence."""
    backward_override: BackwardOverride = BackwardOverride.NONE
    """TE's ``backward_override``."""
    shard_gather: ShardGather = ShardGather.NONE
    """Whether a quantized all-gather is set up for an FSDP2 weight (only
    for a high-precision weight sharded by FSDP2)."""

    _FIELD_TYPES = {
        "capabilities": QuantizerCapabilities,
        "sharding": Sharding,
        "recompute": RecomputePass,
        "recompute_scope": RecomputeScope,
        "grad_enabled": bool,
        "input_requires_grad": bool,
        "weight": WeightSource,
        "microbatch": Microbatch,
        "backward_override": BackwardOverride,
        "shard_gather": ShardGather,
    }

    def __post_init__(self) -> None:
        _check_fields(self)
        if self.shard_gather is not ShardGather.NONE:
            _check_shard_gather(self)
        if self.recompute is RecomputePass.RECOMPUTE and not self.grad_enabled:
            raise InvalidContextError(
                "WorkspaceContext: recompute=RecomputePass.RECOMPUTE requires grad_enabled=True "
                "(the recompute pass exists only to feed backward); received grad_enabled=False. "
                "Use RecomputePass.FIRST for a region's first forward, or RecomputePass.NONE."
            )
        if self.recompute_scope is RecomputeScope.MODULE and self.recompute is RecomputePass.NONE:
            raise InvalidContextError(
                "WorkspaceContext: recompute_scope=RecomputeScope.MODULE describes a recompute pass, "
                "but recompute=RecomputePass.NONE. Set the pass (FIRST or RECOMPUTE), or leave "
                "recompute_scope at RecomputeScope.REGION."
            )

    # Derived facts every policy asks; kept here so that no policy spells
    # them differently (TE's modules disagree on exactly these).
    @property
    def training(self) -> bool:
        """A backward pass will follow this call (directly or after recompute)."""
        return self.grad_enabled and self.recompute is not RecomputePass.FIRST

    @property
    def needs_dgrad(self) -> bool:
        """Backward will compute the input gradient through this weight."""
        return self.training and self.input_requires_grad

    @property
    def quantized_dgrad(self) -> bool:
        """dgrad will read the weight's columnwise quantized data."""
        return self.needs_dgrad and self.backward_override is BackwardOverride.NONE

    @property
    def is_quantized_param(self) -> bool:
        return self.weight is WeightSource.QUANTIZED_PARAM

    def as_plain_forward(self) -> WorkspaceContext:
        """The same call with the recompute pass removed (for policies that
        delegate the non-recompute part of a decision). A call outside
        recompute is its own plain forward: no new context is built."""
        if self.recompute is RecomputePass.NONE:
            return self
        return replace(self, recompute=RecomputePass.NONE, recompute_scope=RecomputeScope.REGION)

    def as_recompute_pass(self) -> WorkspaceContext:
        """The same call as its checkpoint's recompute pass replays it: the
        pass that a first pass's backward runs (a recompute pass always has
        grad). Bindings and policies plan a non-reentrant first pass against
        it, since backward matches what the two passes save by position."""
        return replace(self, recompute=RecomputePass.RECOMPUTE, grad_enabled=True)


def _check_shard_gather(ctx: WorkspaceContext) -> None:
    """A quantized all-gather is FSDP2's, of a high-precision weight (a
    quantized parameter has TE's own FSDP2 gather)."""
    if not ctx.sharding.is_fsdp2 or ctx.weight is not WeightSource.HIGH_PRECISION:
        raise InvalidContextError(
            f"WorkspaceContext: shard_gather=ShardGather.{ctx.shard_gather.name} describes FSDP2's all-gather of a "
            f"high-precision weight, but this call has sharding=Sharding.{ctx.sharding.name} and "
            f"weight=WeightSource.{ctx.weight.name}. Leave shard_gather at ShardGather.NONE."
        )


def valid_contexts(
    capabilities: QuantizerCapabilities,
    *,
    shardings: Iterable[Sharding] = tuple(Sharding),
    passes: Iterable[RecomputePass] = tuple(RecomputePass),
    weights: Iterable[WeightSource] = tuple(WeightSource),
    grads: Iterable[bool] = (True, False),
    dgrads: Iterable[bool] = (True, False),
    microbatches: Iterable[Microbatch] = tuple(Microbatch),
    overrides: Iterable[BackwardOverride] = tuple(BackwardOverride),
    scopes: Iterable[RecomputeScope] = tuple(RecomputeScope),
    gathers: Iterable[ShardGather] = tuple(ShardGather),
) -> Iterator[WorkspaceContext]:
    """Every valid context over the given values (the recompute pass always
    has grad; a scope other than ``REGION`` needs a recompute pass; a
    quantized all-gather is FSDP2's, of a high-precision weight), in the
    order of the arguments."""
    for sharding, rpass, scope, weight, grad, dgrad, mb, override, gather in itertools.product(
        shardings, passes, tuple(scopes), weights, grads, dgrads, microbatches, overrides, tuple(gathers)
    ):
        if rpass is RecomputePass.RECOMPUTE and not grad:
            continue
        if scope is RecomputeScope.MODULE and rpass is RecomputePass.NONE:
            continue
        if gather is not ShardGather.NONE and not (sharding.is_fsdp2 and weight is WeightSource.HIGH_PRECISION):
            continue
        yield WorkspaceContext(
            capabilities=capabilities,
            sharding=sharding,
            recompute=rpass,
            recompute_scope=scope,
            grad_enabled=grad,
            input_requires_grad=dgrad,
            weight=weight,
            microbatch=mb,
            backward_override=override,
            shard_gather=gather,
        )
