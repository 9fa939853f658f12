"""The drop-ins' quantized FSDP2 all-gather (docs/decisions.md, D13).

:func:`enable_quantized_gather` sets it up for a model after ``fully_shard``
and before its first forward, for the weights whose plan makes the workspace
from the shard: each rank then quantizes its shard once per optimizer step
(the step task below) and FSDP2 gathers the quantized bytes, which reach
TE's modules as the FP8 weight ``quantized_model_init`` would hand them.

Why a call of its own, not something the first module call does: FSDP2
fixes what its all-gather sends at its lazy init, which runs before any
module's forward; and what a workspace is made with is the recipe's weight
quantizer, which only ``te.autocast`` names. So the user names the recipe,
once, before the first forward (the default policy's rule then decides per
weight, with the world size FSDP2 shards it over).

The calls of a weight gathered this way receive a quantized weight and are
planned as TE plans an FP8 parameter's (``WeightSource.QUANTIZED_PARAM``),
which is the plan the policy makes from the shard
(``tests/unit/test_quantized_gather_plan.py``): saved as the gathered
parameter, columnwise data derived after the gather and cleared after
backward. The model's :class:`~workspace_manager.gather.ShardGatherState`
is its :attr:`ModelWorkspaceState.gather`.

What this binding gathers quantized: the weights of Linear, LayerNormLinear,
LayerNormMLP and GroupedLinear with one parameter per expert, under
Float8CurrentScaling and under Float8BlockScaling with 2D weight blocks
where FSDP2's shard boundaries fall on the 128-row block boundaries (each
block then lies in one shard). Left out, each named in the setup's
choices: GroupedLinear's single grouped weight (it needs a grouped
factory), te.ops linear ops, 2D-block weights whose shards cut a block, and
every other recipe (the policy makes their workspaces in the call).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from workspace_manager import (
    BackwardOverride,
    RECIPE_PROFILES,
    ShardGather,
    WeightSource,
    WorkspaceContext,
    WorkspaceOrigin,
    plan_call,
)
from workspace_manager.extending import quantizer_capabilities
from workspace_manager.gather import GatherContext, ShardGatherState, ShardLayout, enable_quantized_gather_sharded

from ..te import _compat as te
from ._argument_checks import expect_module
from ._model import live_models, model_for_root
from ._state import state_of
from ._step_hook import Step, step_task

__all__ = ["enable_quantized_gather", "QuantizedGatherSetup", "GatherChoice", "CurrentScalingShards",
           "BlockScalingShards", "GatheredWeights"]

#: The weights each kind this binding gathers quantized computes with, by kind name
#: (GroupedLinear's: one per expert, :func:`_weights_of`).
_WEIGHTS = MappingProxyType({"linear": ("weight",), "layernorm_linear": ("weight",),
                             "layernorm_mlp": ("fc1_weight", "fc2_weight"), "grouped_linear": ()})
#: The kinds it leaves out, and why.
_LEFT_OUT = MappingProxyType({
    "ops_basic_linear": "te.ops linear ops are not gathered quantized by this binding yet (their fuser quantizes "
                        "the weight inside the fused operation, which no gathered quantized weight reaches)",
    "ops_grouped_linear": "te.ops linear ops are not gathered quantized by this binding yet (their fuser quantizes "
                          "the weight inside the fused operation, which no gathered quantized weight reaches)",
})
#: Rows of one 2D block of TE's Float8BlockScaling weights.
_BLOCK_ROWS = 128


@dataclass(frozen=True)
class GatherChoice:
    """One weight of a drop-in: whether its quantized all-gather is set up,
    and why (the plan's reason, or why this binding leaves it out)."""

    module: str
    weight: str
    set_up: bool
    reason: str

    def __str__(self) -> str:
        return f"{self.module or '<model>'}.{self.weight}: {'set up' if self.set_up else 'left out'} ({self.reason})"


@dataclass(frozen=True, eq=False)
class QuantizedGatherSetup:
    """What :func:`enable_quantized_gather` did: a choice per drop-in weight,
    and the model's shard state (None where nothing was set up)."""

    choices: tuple[GatherChoice, ...]
    state: ShardGatherState | None

    @property
    def set_up(self) -> tuple[GatherChoice, ...]:
        return tuple(c for c in self.choices if c.set_up)

    @property
    def left_out(self) -> tuple[GatherChoice, ...]:
        return tuple(c for c in self.choices if not c.set_up)

    def __str__(self) -> str:
        return "\n".join(map(str, self.choices)) or "no drop-in weights in the model"


class CurrentScalingShards:
    """Float8CurrentScaling's shard quantization (a ``BatchShardQuantizer``),
    with TE's kernels: the shard's amax (``tex.compute_amax``), reduced
    with MAX over the shard group by the mechanism, is the whole weight's;
    the scale comes from it as TE's current-scaling scale does (fp8 max,
    the recipe's power-of-2 and epsilon settings), and the cast is TE's
    scaled FP8 cast (``te_integration.te._compat``). A refresh hands it all
    its shards at once: one buffer of amaxes, one scale kernel for all, and
    each weight's cast objects and memory kept from the last refresh
    (``te.CurrentCast``)."""

    def __init__(self, quantizer: Any) -> None:
        self.quantizer = quantizer

    def statistic(self, shard: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
        return te.shard_amaxes([shard])[0]

    def quantize(self, shard: torch.Tensor, statistic: torch.Tensor,
                 layout: ShardLayout) -> tuple[torch.Tensor, torch.Tensor]:
        data, scale_inv, _ = te.cast_with_amaxes([shard], [statistic], self.quantizer)[0]
        return data, scale_inv

    def statistics(self, shards: list[torch.Tensor], layouts: list[ShardLayout], kept: list[Any]) -> list[torch.Tensor]:
        return te.shard_amaxes(shards)

    def quantize_all(self, shards: list[torch.Tensor], statistics: list[torch.Tensor], layouts: list[ShardLayout],
                     kept: list[Any]) -> list[tuple[torch.Tensor, torch.Tensor, Any]]:
        return te.cast_with_amaxes(shards, statistics, self.quantizer, kept)


class GatheredWeights:
    """The gathered weight TE's modules compute with (a ``GatheredWeightFactory``):
    TE's quantized tensor of the recipe over FSDP2's gathered bytes and the
    whole weight's scales, rowwise data only (TE's backward derives the
    columnwise form where dgrad reads it, and clears it after). ``build``
    and ``refill`` are the TE layer's pair for the format
    (:func:`te.float8_weight` and :func:`te.refill_float8_weight` for
    per-tensor scaling, TE's ``Float8Tensor``; :func:`te.block_weight` and
    :func:`te.refill_block_weight` for 2D blocks, ``Float8BlockwiseQTensor``).
    Every later gather refills the same tensor and drops the columnwise form
    derived from the previous gather. The weight reads its scales from the
    cached shard's tensor, which no one writes (a refresh makes a new one),
    as TE's own FP8 parameters hand their shard's scale to the gathered
    weight: no copy at each gather."""

    def __init__(self, quantizer: Any, build: Any, refill: Any) -> None:
        self.quantizer, self._build, self._refill = quantizer, build, refill

    def make(self, data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype,
             context: GatherContext) -> torch.Tensor:
        return self._build(data, scale_inv, dtype, self.quantizer)

    def refill(self, out: torch.Tensor, data: torch.Tensor, scale_inv: torch.Tensor, context: GatherContext) -> None:
        self._refill(out, data, scale_inv)


@dataclass(eq=False)
class _BlockShard:
    """What :class:`BlockScalingShards` keeps of one weight's shard: TE's
    cast (``te.BlockCast``; None for a shard without rows), its bytes, and
    the grid of the whole weight's block scales, the gathered weight's."""

    cast: Any
    data: torch.Tensor
    grid: torch.Tensor


class BlockScalingShards:
    """Float8BlockScaling's shard quantization with 2D weight blocks (a
    ``BatchShardQuantizer``), for shards that start on a block boundary
    (:meth:`refusal`): TE's own block kernel quantizes the shard's rows,
    which is the whole weight's quantization of those rows since every
    block lies in one shard. The statistic is the whole weight's grid of
    block scales with this shard's rows filled in and zeros elsewhere, so
    the mechanism's MAX all-reduce hands every rank the whole grid: the
    gathered weight's scales, the same on every rank. A refresh writes each
    weight's bytes and grid over the last refresh's (:class:`_BlockShard`)."""

    def __init__(self, quantizer: Any) -> None:
        self.quantizer = quantizer
        # statistics() quantizes the shards; quantize_all() of the same
        # sources (the refresh calls the two in turn) takes the bytes from here.
        self._made: dict[int, tuple[torch.Tensor, _BlockShard]] = {}

    @staticmethod
    def refusal(full_shape: tuple[int, ...], world: int) -> str | None:
        """Why a weight of ``full_shape`` sharded over ``world`` ranks cannot
        be quantized shard by shard, or None."""
        rows = -(-full_shape[0] // world)
        if world == 1 or rows % _BLOCK_ROWS == 0:
            return None
        return (f"Float8BlockScaling: FSDP2 cuts this weight's {full_shape[0]} rows into shards of {rows} over "
                f"{world} ranks, inside its {_BLOCK_ROWS}-row blocks; a shard's blocks would not be the whole "
                "weight's (made in the call instead)")

    @staticmethod
    def _grid_shape(full_shape: tuple[int, ...]) -> tuple[int, int]:
        columns = -(-full_shape[-1] // _BLOCK_ROWS)
        return -(-full_shape[0] // _BLOCK_ROWS), -(-columns // 4) * 4

    def _quantized(self, shard: torch.Tensor, layout: ShardLayout, kept: Any) -> tuple[_BlockShard, Any]:
        """The shard quantized, in ``kept``'s memory where it fits, and
        ``(grid rows of this shard, their scales)`` to copy (None for a shard
        without rows); the grid is filled by :meth:`_fill`."""
        shape = self._grid_shape(layout.full_shape)
        fits = isinstance(kept, _BlockShard) and kept.grid.shape == shape and kept.data.shape == shard.shape
        grid = kept.grid if fits else torch.empty(shape, dtype=torch.float32, device=shard.device)
        if not layout.rows:
            return _BlockShard(None, torch.empty(shard.shape, dtype=torch.uint8, device=shard.device), grid), None
        data, scale_inv, cast = te.block_quantize_rows(shard, self.quantizer, kept.cast if fits else None)
        first = layout.row_start // _BLOCK_ROWS
        # The weight's block columns only: TE leaves the padding columns
        # (up to a multiple of 4) as allocated, and they would enter the reduction.
        columns = -(-layout.full_shape[-1] // _BLOCK_ROWS)
        return _BlockShard(cast, data, grid), (grid[first:first + scale_inv.shape[0], :columns], scale_inv[:, :columns])

    def _fill(self, shards: list[torch.Tensor], layouts: list[ShardLayout], kept: list[Any]) -> list[_BlockShard]:
        """Each shard quantized and its grid holding its rows' scales, zeros
        elsewhere: one zeroing and one copy for all the grids."""
        made, copies = [], []
        for shard, layout, old in zip(shards, layouts, kept):
            block, copy = self._quantized(shard, layout, old)
            made.append(block)
            copies += [copy] if copy is not None else []
        torch._foreach_zero_([m.grid for m in made])
        if copies:
            torch._foreach_copy_([dst for dst, _ in copies], [src for _, src in copies])
        return made

    def statistic(self, shard: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
        return self.statistics([shard], [layout], [None])[0]

    def quantize(self, shard: torch.Tensor, statistic: torch.Tensor,
                 layout: ShardLayout) -> tuple[torch.Tensor, torch.Tensor]:
        data, grid, _ = self.quantize_all([shard], [statistic], [layout], [None])[0]
        return data, grid

    def statistics(self, shards: list[torch.Tensor], layouts: list[ShardLayout], kept: list[Any]) -> list[torch.Tensor]:
        made = self._fill(shards, layouts, kept)
        for shard, block in zip(shards, made):
            self._made[id(shard)] = (shard, block)
        return [block.grid.reshape(-1) for block in made]

    def quantize_all(self, shards: list[torch.Tensor], statistics: list[torch.Tensor], layouts: list[ShardLayout],
                     kept: list[Any]) -> list[tuple[torch.Tensor, torch.Tensor, Any]]:
        made = []
        for shard, layout in zip(shards, layouts):
            found = self._made.pop(id(shard), None)
            made.append(found[1] if found is not None and found[0] is shard else self._fill([shard], [layout], [None])[0])
        # The reduced grids (views of the mechanism's one reduced buffer) into each shard's own grid.
        torch._foreach_copy_([m.grid for m in made],
                             [s.reshape(m.grid.shape) for s, m in zip(statistics, made)])
        return [(m.data, m.grid, m) for m in made]


def _shard_format(quantizer: Any) -> tuple[Any, Any, Any]:
    """``(shard quantizer, factory, layout refusal)`` for a weight quantizer
    :func:`te.weight_quantizer_of` returned."""
    if getattr(quantizer, "block_scaling_dim", None) == 2:
        return (BlockScalingShards(quantizer), GatheredWeights(quantizer, te.block_weight, te.refill_block_weight),
                BlockScalingShards.refusal)
    return (CurrentScalingShards(quantizer), GatheredWeights(quantizer, te.float8_weight, te.refill_float8_weight),
            lambda full_shape, world: None)


def enable_quantized_gather(model: torch.nn.Module, recipe: Any) -> QuantizedGatherSetup:
    """Set up the quantized FSDP2 all-gather for the drop-in weights of
    ``model`` whose plan makes the workspace from the shard under ``recipe``
    (TE's recipe object, the one ``te.autocast`` will be given). Call it
    after ``fully_shard`` and before the model's first forward, on every
    rank alike. Returns what was set up and why each weight was or was not.
    Calling it again for the same model is refused: its state is set up."""
    expect_module("enable_quantized_gather", "model", model)
    owner = model_for_root(model)
    if owner.gather is not None:
        raise RuntimeError("enable_quantized_gather: the quantized all-gather of this model is set up already; "
                           f"its weights: {[name for name, _ in owner.gather.wrapped()]}")
    quantizer = te.weight_quantizer_of(recipe)
    shards, factory, layout_refusal = _shard_format(quantizer) if quantizer is not None else (None, None, None)
    choices = tuple(_choice(path, module, weight, recipe, quantizer, layout_refusal)
                    for path, module in _drop_ins(model) for weight in _weights_of(module))
    names = [f"{c.module}.{c.weight}" if c.module else c.weight for c in choices if c.set_up]
    state = None
    if names:
        state = enable_quantized_gather_sharded(model, shards, factory, names)
        owner.gather = state
    return QuantizedGatherSetup(choices, state)


def _drop_ins(model: torch.nn.Module) -> list[tuple[str, Any]]:
    return [(path, m) for path, m in model.named_modules() if getattr(m, "_wm_kind", None) is not None]


def _weights_of(module: Any) -> tuple[str, ...]:
    kind = module._wm_kind.name
    if kind == "grouped_linear":
        if getattr(module, "single_grouped_weight", False):
            return ("weight",)
        return tuple(f"weight{i}" for i in range(module.num_gemms))
    return _WEIGHTS.get(kind, ("weight",))


def _choice(path: str, module: Any, weight: str, recipe: Any, quantizer: Any, layout_refusal: Any) -> GatherChoice:
    """Whether ``module``'s ``weight`` is gathered quantized: the binding's
    own limits first, then the plan of a training call of it, then whether
    the shard format can cut the weight where FSDP2 cuts it."""
    kind = module._wm_kind.name
    left_out = _LEFT_OUT.get(kind)
    if left_out is None and kind not in _WEIGHTS:
        left_out = f"{type(module).__name__} is not a kind this binding gathers quantized"
    if left_out is None and kind == "grouped_linear" and getattr(module, "single_grouped_weight", False):
        left_out = ("GroupedLinear(single_grouped_weight=True): one grouped weight is not gathered quantized by this "
                    "binding yet (it needs a grouped factory); one parameter per expert is")
    if left_out is not None:
        return GatherChoice(path, weight, False, left_out)
    param = getattr(module, weight, None)
    world = _shard_world_size(param)
    if world is None:
        return GatherChoice(path, weight, False, "not sharded by FSDP2 (call fully_shard first)")
    plan = plan_call(_context(module, recipe, quantizer, world), state_of(module).policy)
    if plan.workspace_origin is not WorkspaceOrigin.SHARD:
        return GatherChoice(path, weight, False, next(n for n in plan.notes if n.startswith("made in the call")))
    if quantizer is None:
        return GatherChoice(path, weight, False, f"this binding has no shard quantizer for {type(recipe).__name__} "
                                                 "(only for Float8CurrentScaling and 2D-block Float8BlockScaling)")
    cut = layout_refusal(tuple(param.shape), world)
    if cut is not None:
        return GatherChoice(path, weight, False, cut)
    return GatherChoice(path, weight, True, plan.notes[0])


def _shard_world_size(param: Any) -> int | None:
    """The ranks FSDP2 shards ``param`` over (its ``Shard(0)`` mesh dim); None
    for a parameter FSDP2 does not shard."""
    placements = getattr(param, "placements", None)
    if placements is None:
        return None
    dims = [i for i, p in enumerate(placements) if getattr(p, "dim", None) == 0 and p.is_shard()]
    return param.device_mesh.size(dims[0]) if len(dims) == 1 else None


def _context(module: Any, recipe: Any, quantizer: Any, world: int) -> WorkspaceContext:
    """A training call of the weight, as it would be planned with a
    quantized all-gather set up over ``world`` ranks."""
    capabilities = quantizer_capabilities(quantizer) if quantizer is not None else RECIPE_PROFILES[type(recipe).__name__]
    return WorkspaceContext(
        capabilities=capabilities, sharding=state_of(module).sharding(module), weight=WeightSource.HIGH_PRECISION,
        backward_override=BackwardOverride.from_te(getattr(recipe, "backward_override", None)),
        shard_gather=ShardGather.for_world_size(world),
    )


@step_task("quantized_shards")
def _refresh_quantized_shards(step: Step) -> None:
    """Remake the quantized shards of the parameters the step wrote, one
    reduction per shard group for all of them (every rank steps the same
    parameters, so every rank joins)."""
    for model in live_models():
        gather = model.gather
        if gather is None:
            continue
        written = [p for _, p in gather.wrapped() if step.everything or id(p) in step.ids]
        if written:
            gather.refresh(written)
