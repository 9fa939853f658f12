"""FSDP2 all-gathers a quantized shard of a high-precision parameter.

Today a weight sharded by FSDP2 is gathered in bf16 and quantized again in
every forward and backward of every microbatch. This module moves that work
before the all-gather: each rank quantizes its own shard once per optimizer
step and FSDP2 gathers the quantized bytes (1 byte per element instead of 2).
The parameter itself stays a high-precision tensor, so any ``torch.optim``
optimizer, ``state_dict`` and ``torch.distributed.checkpoint`` see a plain
bf16/fp32 tensor.

The mechanism is FSDP2's all-gather extension. A sharded parameter whose
local tensor defines ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` has
FSDP2 gather what the first returns and hand the result to the second:

* :class:`ShardGatherWeight` is that local tensor: a subclass over the
  plain shard's storage that passes every operation through to it
  (optimizer updates included) and keeps the subclass only through the
  steps FSDP2 itself takes to shard and pad it. Kernels that write the
  local tensor's memory directly (TE's FusedAdam) write the shard.
* ``fsdp_pre_all_gather`` returns the shard's quantized bytes, made by a
  :class:`ShardQuantizer` and cached until the shard changes. The scale is
  the same on every rank (see below), so it travels as metadata and only the
  bytes are gathered: one all-gather input, which FSDP2 also accepts at world
  size 1 and for unevenly sharded weights.
* ``fsdp_post_all_gather`` builds the unsharded quantized weight with a
  :class:`GatheredWeightFactory` (for TransformerEngine, its ``Float8Tensor``)
  and refills the same object at every later gather (FSDP2's ``out=``).

Why every rank's scale equals the whole weight's
    A quantizer reports a statistic of its shard (per-tensor scaling: the
    amax; block scaling: the grid of block amaxes, zero for blocks the shard
    does not touch). The statistics of all the model's written weights are
    reduced with one MAX all-reduce over the shard group, after which each
    rank holds the statistic of the whole weight and quantizes its rows with
    the scale a quantizer of the whole weight would use. MAX is exact, so the
    gathered bytes equal those of quantizing the gathered weight.

When a shard is made
    :meth:`ShardGatherState.refresh` (installed as an optimizer step hook by
    :meth:`ShardGatherState.attach`) remakes the shards of the parameters an
    optimizer step wrote, with one reduction for all of them. Every gather of
    the step (forward, backward, each microbatch, recompute) reuses them. A
    write outside a step (``load_state_dict``, an in-place edit, DCP loading
    into the state dict's plain tensors) is seen by every
    ``fsdp_pre_all_gather``, which compares the shard's write count and the
    plain tensor's version counter with those the cached shard was made
    from; a mismatch remakes that shard inside the hook, reducing its
    statistic there. That reduction is a collective: such writes must happen
    on every rank of the shard group (``load_state_dict`` and DCP do), or a
    rank that alone remakes its shard waits in it forever. For the same
    reason FSDP2's own re-padding of a short shard (on those ranks only)
    carries the cached shard over instead of dropping it (``_carried_shard``).

In whose memory a shard is made
    A :class:`BatchShardQuantizer` may keep a weight's memory and framework
    objects from one refresh to the next and write the new shard over the
    old one (``kept``): building them is most of a refresh's cost. The
    refresh offers them only where FSDP2 holds the weight sharded, when no
    gathered weight is alive that could still read the old scale (the
    gathered weight reads the shard's scale tensor, not a copy); a shard
    made in the gather hook, or carried over to new storage, keeps nothing.
"""

from __future__ import annotations

import enum
import inspect
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, Protocol

import torch
import torch.utils._pytree as pytree

from ._context import Sharding
from ._errors import ContextTypeError, InvalidContextError
from ._fsdp2 import _distinct, _fsdp2_api, _fsdp2_modules, _sharded_groups, fsdp2_parameters

__all__ = [
    "GatherPass",
    "GatherContext",
    "ShardLayout",
    "QuantizedShard",
    "ShardQuantizer",
    "BatchShardQuantizer",
    "GatheredWeightFactory",
    "ShardGatherWeight",
    "GatherCounts",
    "ShardGatherState",
    "enable_quantized_gather",
    "enable_quantized_gather_sharded",
    "plain_tensor",
]

aten = torch.ops.aten


class GatherPass(enum.Enum):
    """Which pass an all-gather serves (FSDP2's training state)."""

    FORWARD = "forward"
    #: FSDP2's ``PRE_BACKWARD``: the weight is gathered again for backward.
    BACKWARD = "backward"


@dataclass(frozen=True)
class GatherContext:
    """What a factory needs to choose the gathered weight's usages.

    ``sharding`` is :attr:`Sharding.FSDP2_RESHARD` when FSDP2 frees the
    gathered weight after forward (backward gathers it again) and
    :attr:`Sharding.FSDP2_KEEP` when the forward gather is kept for backward.
    """

    phase: GatherPass
    sharding: Sharding


@dataclass(frozen=True)
class ShardLayout:
    """Where one rank's dim-0 shard sits in the whole weight, as FSDP2 cuts
    it: every rank sends ``padded_rows`` rows (``ceil(rows of the weight /
    world)``); the last ranks' real ``rows`` may be fewer, or none."""

    full_shape: tuple[int, ...]
    row_start: int
    rows: int
    padded_rows: int

    @classmethod
    def of(cls, full_shape: tuple[int, ...], rank: int, world: int) -> ShardLayout:
        total = full_shape[0]
        chunk = -(-total // world)
        start = min(rank * chunk, total)
        return cls(tuple(full_shape), start, max(0, min(chunk, total - start)), chunk)


@dataclass(frozen=True, eq=False)
class QuantizedShard:
    """One rank's quantized shard: the bytes FSDP2 gathers (``padded_rows``
    rows, uint8) and the scale every rank shares.

    ``writes`` is the shard's write count when it was made (every write
    through a wrapper counts, whichever view it went through) and
    ``hp_version`` the version counter of the plain tensor it was read from
    (``source``, weakly held), which also moves on writes through plain
    aliases of that tensor (the state dict's, DCP's)."""

    data: torch.Tensor
    scale_inv: torch.Tensor
    layout: ShardLayout
    writes: int
    hp_version: int
    source: Any

    def is_current(self, local: ShardGatherWeight) -> bool:
        if self.writes != local._link.writes:
            return False
        # Another plain tensor than the one read: FSDP2 re-made the local
        # view of the same buffer (no write went through it since).
        return self.source() is not local._hp or self.hp_version == local._hp._version

    def restamped(self, local: ShardGatherWeight) -> QuantizedShard:
        """The same shard, stamped against ``local``'s plain tensor now."""
        return replace(self, writes=local._link.writes, hp_version=local._hp._version, source=weakref.ref(local._hp))

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scale_inv.numel() * self.scale_inv.element_size()


class ShardQuantizer(Protocol):
    """How a recipe quantizes a shard so that the result equals the whole
    weight's quantization (see the module docstring)."""

    def statistic(self, shard: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
        """A float32 1-D tensor, of a length fixed by ``layout.full_shape``,
        whose MAX over all ranks' shards is the whole weight's statistic."""
        ...

    def quantize(self, shard: torch.Tensor, statistic: torch.Tensor,
                 layout: ShardLayout) -> tuple[torch.Tensor, torch.Tensor]:
        """``(data, scale_inv)`` of the shard's ``layout.rows`` rows, scaled
        by the reduced ``statistic``; ``scale_inv`` must be the same on
        every rank."""
        ...


class BatchShardQuantizer(ShardQuantizer, Protocol):
    """A :class:`ShardQuantizer` that also takes all the shards of a refresh
    at once, and may remake a shard in the memory of the one it replaces.

    A refresh remakes every weight a step wrote (a 32-expert layer: 64 of
    them); where each call allocates and builds a framework's objects (TE:
    a cast quantizer, its scale, the bytes, a tensor over them) and
    launches its own small kernels, doing that once per refresh instead of
    once per shard, and keeping the objects from one step to the next, is
    most of the refresh's cost.

    ``kept`` holds, per shard, the third item :meth:`quantize_all` returned
    for that weight's last shard, or None: for a weight's first shard,
    after :meth:`ShardGatherState.release`, for a shard the gather hook
    made or FSDP2 carried to new storage, and wherever FSDP2 holds a
    gathered copy of the weight (which may still read the old scale). What
    ``kept`` holds may be written over; a quantizer must check that it fits
    the shard (shape, dtype, device) before it does. :meth:`statistics` and
    :meth:`quantize_all` return, for each shard in order, what
    ``statistic`` and ``quantize`` would, the latter with what to keep."""

    def statistics(self, shards: Sequence[torch.Tensor], layouts: Sequence[ShardLayout],
                   kept: Sequence[Any]) -> list[torch.Tensor]:
        ...

    def quantize_all(self, shards: Sequence[torch.Tensor], statistics: Sequence[torch.Tensor],
                     layouts: Sequence[ShardLayout], kept: Sequence[Any]) -> list[tuple[torch.Tensor, torch.Tensor, Any]]:
        ...


class GatheredWeightFactory(Protocol):
    """Builds the unsharded quantized weight the module's GEMMs receive."""

    def make(self, data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype,
             context: GatherContext) -> torch.Tensor:
        """A tensor of the whole weight's shape and nominal ``dtype`` over the
        gathered ``data`` (uint8, the whole weight's rows)."""
        ...

    def refill(self, out: torch.Tensor, data: torch.Tensor, scale_inv: torch.Tensor,
               context: GatherContext) -> None:
        """Point ``out`` (a tensor :meth:`make` built) at a new gather."""
        ...


@dataclass(frozen=True)
class GatherCounts:
    """What the mechanism did since the state was made."""

    refreshes: int
    refreshed_shards: int
    hook_remakes: int
    reductions: int
    gathers: int


class _Link:
    """What the wrappers over one buffer share: the recipe, the cached shard
    and the FSDP2 records found for it. A view keeps the link of its source;
    an operation that makes new storage (FSDP2's padding) gets a new link,
    so a copy never reads another tensor's shard, except as
    :func:`_carried_shard` allows."""

    __slots__ = ("quantizer", "factory", "_state", "shard", "kept", "fsdp", "writes", "placed", "__weakref__")

    def __init__(self, quantizer: ShardQuantizer, factory: GatheredWeightFactory, state: Any) -> None:
        self.quantizer = quantizer
        self.factory = factory
        self._state = weakref.ref(state) if state is not None else None
        self.shard: QuantizedShard | None = None
        #: What a BatchShardQuantizer keeps of ``shard`` to make the next one
        #: in its memory (None where ``shard`` was not made by a refresh).
        self.kept: Any = None
        # (FSDPParamGroup, FSDPParam), found once, held weakly: they lead back
        # to the local tensor, whose Python state holds this link, and the
        # collector does not break that cycle (PyTorch lets it follow a
        # tensor's Python state only while nothing else shares the tensor,
        # and FSDP2 keeps views of it). Held strongly, every model that ran a
        # quantized gather stayed alive after del (tests/distributed,
        # case "freed").
        self.fsdp: tuple[Any, Any] | None = None
        self.writes = 0  # writes through any wrapper of this link
        #: How the refresh last found the parameter placed: ``(mesh,
        #: placements, shape)`` and what follows from them, ``(layout, group,
        #: world, dtype)``, so that the refresh after every step does not ask
        #: the device mesh again for every weight (:func:`_entry`).
        self.placed: tuple | None = None

    @property
    def state(self) -> ShardGatherState | None:
        return self._state() if self._state is not None else None

    def fresh(self) -> _Link:
        return _Link(self.quantizer, self.factory, self.state)


#: Operations through which FSDP2 shards and pads the parameter: the result
#: stays a ShardGatherWeight. Views share their source's link; new storage
#: gets a new one. Every other operation returns plain tensors.
_VIEWS = frozenset({
    aten.detach.default, aten.alias.default, aten.view.default, aten._unsafe_view.default,
    aten.slice.Tensor, aten.as_strided.default, aten.split.Tensor, aten.split_with_sizes.default,
})
_NEW_STORAGE = frozenset({aten.new_zeros.default, aten.new_empty.default, aten._to_copy.default,
                          aten._pin_memory.default})


class ShardGatherWeight(torch.Tensor):
    """A high-precision tensor whose FSDP2 all-gather sends a quantized shard.

    It holds the plain tensor (``_hp``), shares its storage, and behaves as
    it: every operation runs on the plain tensor and returns plain tensors,
    except FSDP2's sharding steps (views, ``new_zeros``, ``copy_``) and
    in-place operations, which return the wrapper. An operation that writes
    the wrapper (an optimizer step, ``copy_``) counts a write on its link and
    moves the plain tensor's version counter; staleness is read from both
    (see :class:`QuantizedShard`). Pickling (``torch.save``) stores the plain
    tensor, and ``copy.deepcopy`` returns a plain copy.
    """

    _hp: torch.Tensor
    _link: _Link
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, hp: torch.Tensor, link: _Link) -> ShardGatherWeight:
        # An alias of the plain tensor's storage, not a storage-less wrapper:
        # code that reaches the local tensor's memory below the dispatcher
        # (TE's FusedAdam hands each DTensor parameter's ``_local_tensor`` to
        # its C++ kernels) then reads and writes the real weight. Such writes
        # bypass the write count; the optimizer step hook remakes what a step
        # wrote all the same.
        return torch.Tensor._make_subclass(cls, hp, hp.requires_grad)

    def __init__(self, hp: torch.Tensor, link: _Link) -> None:
        self._hp = hp
        self._link = link

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return f"ShardGatherWeight({self._hp!r})"

    def __reduce_ex__(self, protocol: int) -> Any:
        # A checkpoint holds the plain tensor (a parameter stays a
        # parameter): loadable without this package, weights-only too.
        plain = self._hp.detach()
        if isinstance(self, torch.nn.Parameter):
            return torch._utils._rebuild_parameter, (plain, self.requires_grad, OrderedDict())
        return plain.__reduce_ex__(protocol)

    def __deepcopy__(self, memo: dict[int, Any]) -> torch.Tensor:
        # A copy is a plain tensor: the shard and its model's state stay with the original.
        plain = self._hp.detach().clone()
        if isinstance(self, torch.nn.Parameter):
            plain = torch.nn.Parameter(plain, requires_grad=self.requires_grad)
        memo[id(self)] = plain
        return plain

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return ["_hp"], self._link

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], link: _Link, size: Any, stride: Any) -> ShardGatherWeight:
        return ShardGatherWeight(inner["_hp"], link)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        wrappers: dict[int, ShardGatherWeight] = {}

        def unwrap(t: ShardGatherWeight) -> torch.Tensor:
            wrappers.setdefault(id(t._hp), t)
            return t._hp

        plain_args, plain_kwargs = pytree.tree_map_only(ShardGatherWeight, unwrap, (args, kwargs or {}))
        out = func(*plain_args, **plain_kwargs)
        if func._schema.is_mutable:
            carried = _carried_shard(func, args)
            _bump_written(func, args, kwargs or {})
            if carried is not None:
                args[0]._link.shard = carried.restamped(args[0])
            return pytree.tree_map_only(torch.Tensor, lambda t: wrappers.get(id(t), t), out)
        if func in _VIEWS or func in _NEW_STORAGE:
            source = next(iter(wrappers.values()))._link
            link = source if func in _VIEWS else source.fresh()
            return pytree.tree_map_only(torch.Tensor, lambda t: cls(t, link), out)
        return out

    @property
    def fsdp_pre_all_gather(self) -> _PreAllGather:
        """FSDP2: the cached quantized shard (remade if the shard was written
        since), its scale and the pass as metadata (:class:`_PreAllGather`)."""
        return _PreAllGather(self)

    def fsdp_post_all_gather(self, all_gather_outputs: tuple[torch.Tensor, ...], metadata: Any,
                             param_dtype: torch.dtype, *, out: torch.Tensor | None = None) -> Any:
        """FSDP2: the unsharded quantized weight over the gathered bytes
        (the padding rows of an uneven shard left out)."""
        (data,) = all_gather_outputs
        scale_inv, full_shape, context = metadata
        if data.dtype is not torch.uint8:
            data = data.view(torch.uint8)
        whole = data if data.shape[0] == full_shape[0] else data[: full_shape[0]]
        if out is not None:
            self._link.factory.refill(out, whole, scale_inv, context)
            return None
        # FSDP2 frees and re-allocates the storage of what is returned here;
        # the gathered buffers only, never the cached shard or its scale.
        return self._link.factory.make(whole, scale_inv, param_dtype, context), all_gather_outputs


class _PreAllGather:
    """``ShardGatherWeight.fsdp_pre_all_gather`` of one local tensor.

    FSDP2 reads the hook's signature (``inspect.signature``) at every
    all-gather of every parameter, to choose how to call it. For a bound
    method that means rebuilding the signature from the function's code,
    about 20 us: more than the rest of a cached shard's gather, paid for
    every weight in every forward and backward of every microbatch. This
    object carries its signature ready (``__signature__``, which
    ``inspect.signature`` returns as it is)."""

    __slots__ = ("_local",)
    __signature__ = inspect.Signature([
        inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        for name in ("mesh", "orig_size", "contiguous_orig_stride", "module", "mp_policy")
    ])

    def __init__(self, local: ShardGatherWeight) -> None:
        self._local = local

    def __call__(self, mesh: Any, orig_size: torch.Size, contiguous_orig_stride: Any, module: Any,
                 mp_policy: Any) -> tuple[tuple[torch.Tensor, ...], Any]:
        local = self._local
        shard = _current_shard(local, mesh, tuple(orig_size), _cast_dtype(local, mp_policy))
        state = local._link.state
        if state is not None:
            state._gathers += 1
        return (shard.data,), (shard.scale_inv, shard.layout.full_shape, _gather_context(local))


def _bump_written(func: Any, args: Any, kwargs: dict[str, Any]) -> None:
    """Count a write on the link of every wrapper ``func`` writes, and move
    its plain tensor's version counter: the op ran below autograd, which
    moves none (fused optimizers move none even on plain tensors), and views
    made there share no counter with their base, hence the link's count."""
    moved = []
    for index, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[index] if index < len(args) else kwargs.get(argument.name)
        for leaf in pytree.tree_leaves(value):
            if isinstance(leaf, ShardGatherWeight):
                leaf._link.writes += 1
                if not leaf._hp.is_inference():
                    moved.append(leaf._hp)
    if moved:  # one call for a foreach or fused optimizer's whole list
        torch.autograd.graph.increment_version(moved)


def _carried_shard(func: Any, args: Any) -> QuantizedShard | None:
    """The shard a ``copy_`` into untouched new storage carries over.

    FSDP2 re-pads an unevenly sharded parameter at its lazy init and after
    ``load_state_dict`` (``FSDPParam.reset_sharded_param``: ``new_zeros``,
    then ``copy_`` of the old shard), on the ranks whose shard is short only.
    The new buffer then holds the same rows, so the cached shard is still
    right; dropping it would make those ranks alone remake it in the gather
    hook, whose reduction the other ranks never join.
    """
    if func is not aten.copy_.default or len(args) < 2:
        return None
    dst, src = args[0], args[1]
    if not (isinstance(dst, ShardGatherWeight) and isinstance(src, ShardGatherWeight)):
        return None
    shard = src._link.shard
    if dst._link.writes or dst._link.shard is not None or shard is None or not shard.is_current(src):
        return None
    if dst.storage_offset() != 0 or dst.shape != src.shape or dst._link is src._link:
        return None
    return shard


def _cast_dtype(local: ShardGatherWeight, mp_policy: Any) -> torch.dtype:
    """The dtype FSDP2 would gather in (its mixed-precision ``param_dtype``),
    which the shard is cast to before it is quantized: stock quantizes the
    gathered weight in that dtype."""
    wanted = getattr(mp_policy, "param_dtype", None)
    return local.dtype if wanted is None else wanted


def _current_shard(local: ShardGatherWeight, mesh: Any, full_shape: tuple[int, ...],
                   dtype: torch.dtype) -> QuantizedShard:
    """The cached shard when nothing wrote the shard since it was made;
    otherwise a new one, its statistic reduced here over ``mesh``."""
    link = local._link
    shard = link.shard
    if shard is not None and shard.is_current(local) and shard.layout.full_shape == full_shape:
        if shard.source() is not local._hp:
            link.shard = shard = shard.restamped(local)
        return shard
    group = mesh.get_group()
    layout = ShardLayout.of(full_shape, mesh.get_local_rank(), mesh.size())
    source = _source(local, dtype)
    statistic = link.quantizer.statistic(source, layout)
    _reduce_max(statistic, group, mesh.size())
    link.shard, link.kept = _make_shard(link, local, source, statistic, layout), None
    state = link.state
    if state is not None:
        state._hook_remakes += 1
        state._reductions += int(mesh.size() > 1)
    return link.shard


def _source(local: ShardGatherWeight, dtype: torch.dtype) -> torch.Tensor:
    hp = local._hp.detach()
    return hp if hp.dtype == dtype else hp.to(dtype)


def _reduce_max(statistic: torch.Tensor, group: Any, world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        dist.all_reduce(statistic, op=dist.ReduceOp.MAX, group=group)


def _make_shard(link: _Link, local: ShardGatherWeight, source: torch.Tensor, statistic: torch.Tensor,
                layout: ShardLayout) -> QuantizedShard:
    """Quantize ``source`` with the reduced ``statistic`` (:func:`_shard_of`)."""
    with torch.no_grad():
        data, scale_inv = link.quantizer.quantize(source, statistic, layout)
    return _shard_of(link, local, data, scale_inv, layout)


def _shard_of(link: _Link, local: ShardGatherWeight, data: torch.Tensor, scale_inv: torch.Tensor,
              layout: ShardLayout, padded: torch.Tensor | None = None) -> QuantizedShard:
    """The shard of quantized ``data``, its bytes padded to the rows every
    rank sends (FSDP2 requires the padded size of an uneven shard; the
    padding rows are dropped after the gather); ``padded``: the last
    shard's padded bytes, written over where they fit (see ``kept``)."""
    if data.dtype is not torch.uint8:
        data = data.view(torch.uint8)
    if data.shape[0] != layout.padded_rows:
        shape = (layout.padded_rows, *data.shape[1:])
        if padded is None or padded.shape != shape or padded.device != data.device:
            padded = data.new_zeros(shape)
        padded[: data.shape[0]].copy_(data)
        data = padded
    return QuantizedShard(data, scale_inv, layout, link.writes, local._hp._version, weakref.ref(local._hp))


def _by_quantizer(entries: list[_Entry]) -> list[tuple[Any, list[int]]]:
    """``(quantizer, indices into entries)`` per distinct quantizer object, in first-seen order."""
    found: dict[int, tuple[Any, list[int]]] = {}
    for index, entry in enumerate(entries):
        quantizer = entry.local._link.quantizer
        found.setdefault(id(quantizer), (quantizer, []))[1].append(index)
    return list(found.values())


def _statistics(quantizer: Any, shards: list[torch.Tensor], layouts: list[ShardLayout],
                kept: list[Any]) -> list[torch.Tensor]:
    if hasattr(quantizer, "statistics"):
        return quantizer.statistics(shards, layouts, kept)
    return [quantizer.statistic(shard, layout) for shard, layout in zip(shards, layouts)]


def _quantize_all(quantizer: Any, shards: list[torch.Tensor], statistics: list[torch.Tensor],
                  layouts: list[ShardLayout], kept: list[Any]) -> list[tuple[torch.Tensor, torch.Tensor, Any]]:
    """``(data, scale_inv, what to keep)`` per shard (None kept where the
    quantizer is not a batch quantizer)."""
    if not hasattr(quantizer, "quantize_all"):
        return [(*quantizer.quantize(s, t, layout), None) for s, t, layout in zip(shards, statistics, layouts)]
    made = quantizer.quantize_all(shards, statistics, layouts, kept)
    if len(made) != len(shards) or any(not isinstance(m, tuple) or len(m) != 3 for m in made):
        raise ContextTypeError(
            f"quantized gather: {type(quantizer).__name__}.quantize_all must return one (data, scale_inv, kept) "
            f"tuple per shard ({len(shards)}); received {[type(m).__name__ for m in made][:4]}... of {len(made)}. "
            "Return None as the third item to keep nothing.")
    return made


def _reusable(local: ShardGatherWeight) -> Any:
    """What the link keeps of its shard, where the refresh may write the new
    shard over it: FSDP2 holds the weight sharded, so no gathered weight is
    alive that reads the old scale (a gathered weight kept across the step,
    ``set_reshard_after_backward(False)``, gets new memory); else None."""
    kept = local._link.kept
    if kept is None:
        return None
    found = _fsdp_records(local)
    return kept if found is not None and found[1].sharded_state.name == "SHARDED" else None


#: The four contexts, by (pass, whether FSDP2 keeps the forward gather for backward).
_CONTEXTS = MappingProxyType({
    (phase, keep): GatherContext(phase, Sharding.FSDP2_KEEP if keep else Sharding.FSDP2_RESHARD)
    for phase in GatherPass for keep in (False, True)
})


def _gather_context(local: ShardGatherWeight) -> GatherContext:
    """The pass and resharding of the FSDP2 group that holds ``local``,
    read from FSDP2's group (``_training_state``, ``post_forward_mesh_info``)."""
    found = _fsdp_records(local)
    if found is None:
        raise InvalidContextError(
            "quantized gather: FSDP2 asked a tensor it does not hold as a sharded parameter's local "
            "tensor to gather; FSDP2's CPU offloading (OffloadPolicy) gathers a device copy, which "
            "the quantized gather does not support: leave such parameters out of enable_quantized_gather."
        )
    group, _ = found
    phase = GatherPass.BACKWARD if group._training_state.name == "PRE_BACKWARD" else GatherPass.FORWARD
    return _CONTEXTS[phase, group.post_forward_mesh_info is None]


def _fsdp_records(local: ShardGatherWeight) -> tuple[Any, Any] | None:
    """``(FSDPParamGroup, FSDPParam)`` whose sharded parameter's local
    tensor is ``local``; looked up once per link."""
    link = local._link
    if link.fsdp is not None:
        group, fsdp_param = link.fsdp[0](), link.fsdp[1]()
        if group is not None and fsdp_param is not None and fsdp_param._sharded_local_tensor is local:
            return group, fsdp_param
    api = _fsdp2_api()
    if api is None:
        return None
    for state in _distinct(_fsdp2_modules(api).values()):
        for group in _sharded_groups(state, api):
            for fsdp_param in group.fsdp_params:
                if fsdp_param._sharded_local_tensor is local:
                    link.fsdp = (weakref.ref(group), weakref.ref(fsdp_param))
                    return group, fsdp_param
    return None


def plain_tensor(value: Any) -> Any:
    """``value`` with a :class:`ShardGatherWeight` (itself, or as a DTensor's
    local tensor) replaced by the plain tensor it holds, sharing storage;
    anything else unchanged."""
    if isinstance(value, ShardGatherWeight):
        return value._hp.detach()
    local = getattr(value, "_local_tensor", None)
    if isinstance(local, ShardGatherWeight):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local._hp.detach(), value.device_mesh, value.placements, run_check=False,
                                  shape=value.shape, stride=value.stride())
    return value


@dataclass(frozen=True, eq=False)
class _Entry:
    """One wrapped parameter as refresh sees it."""

    param: torch.Tensor
    local: ShardGatherWeight
    layout: ShardLayout
    group: Any
    world: int
    dtype: torch.dtype


class ShardGatherState:
    """The quantized shards of one model's wrapped weights, and the refresh
    that remakes them after an optimizer step.

    Made by :func:`enable_quantized_gather` before ``fully_shard``. The
    shards live on the wrappers (one link per parameter buffer); this object
    finds them through the model's parameters, so it holds no list that
    FSDP2's sharding could leave stale.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self._model = weakref.ref(model)
        self._refreshes = self._refreshed = self._hook_remakes = self._reductions = self._gathers = 0

    def wrapped(self) -> list[tuple[str, torch.Tensor]]:
        """``(name, parameter)`` for each wrapped parameter of the model, in
        ``named_parameters`` order: the sharded parameter (the one an
        optimizer holds), also while FSDP2 has the module hold the gathered
        one instead (between forward and backward, and after a forward with
        ``reshard_after_forward=False``)."""
        model = self._model()
        if model is None:
            return []
        out: list[tuple[str, torch.Tensor]] = []
        gathered: dict[int, Any] | None = None
        for name, p in model.named_parameters():
            if isinstance(_local(p), ShardGatherWeight):
                out.append((name, p))
                continue
            if _local(p) is p:  # not a DTensor: maybe FSDP2's gathered parameter
                if gathered is None:
                    gathered = _sharded_by_gathered(model)
                sharded = gathered.get(id(p))
                if sharded is not None:
                    out.append((name, sharded))
        return out

    def refresh(self, written: Iterable[torch.Tensor] | None = None) -> int:
        """Remake the quantized shards of the wrapped parameters in
        ``written`` (all of them when None) with one MAX all-reduce per shard
        group for all of them; return how many were made.

        Every rank of a shard group must pass the same parameters (an
        optimizer's ``param_groups`` are the same on every rank): the
        statistics are reduced as one buffer in parameter order.
        """
        chosen = None if written is None else {id(p) for p in written}
        entries = [_entry(p) for _, p in self.wrapped() if chosen is None or id(p) in chosen]
        entries = [e for e in entries if e is not None]
        for group_entries in _by_group(entries):
            self._refresh_group(group_entries)
        self._refreshes += 1
        self._refreshed += len(entries)
        return len(entries)

    def _refresh_group(self, entries: list[_Entry]) -> None:
        """One group's refresh: every statistic (per quantizer, all its
        shards at once where it is a :class:`BatchShardQuantizer`), one MAX
        all-reduce of all of them, then every quantization."""
        with torch.no_grad():
            sources = [_source(e.local, e.dtype) for e in entries]
            layouts = [e.layout for e in entries]
            kept = [_reusable(e.local) for e in entries]
            batches = _by_quantizer(entries)
            stats: list[Any] = [None] * len(entries)
            for quantizer, index in batches:
                made = _statistics(quantizer, [sources[i] for i in index], [layouts[i] for i in index],
                                   [kept[i] for i in index])
                for i, statistic in zip(index, made):
                    stats[i] = statistic.reshape(-1).float()  # no copy where it is float32 already
            flat = torch.cat(stats)
            _reduce_max(flat, entries[0].group, entries[0].world)
            self._reductions += int(entries[0].world > 1)
            parts = flat.split([s.numel() for s in stats])
            for quantizer, index in batches:
                made = _quantize_all(quantizer, [sources[i] for i in index], [parts[i] for i in index],
                                     [layouts[i] for i in index], [kept[i] for i in index])
                for i, (data, scale_inv, keep) in zip(index, made):
                    link = entries[i].local._link
                    padded = link.shard.data if kept[i] is not None and link.shard is not None else None
                    link.shard = _shard_of(link, entries[i].local, data, scale_inv, layouts[i], padded)
                    link.kept = keep

    def attach(self, optimizer: torch.optim.Optimizer) -> Any:
        """Refresh the parameters ``optimizer`` holds after each of its steps
        (a step post hook); returns the hook's handle."""
        if not hasattr(optimizer, "register_step_post_hook"):
            raise ContextTypeError(f"attach: expected a torch.optim.Optimizer; received {type(optimizer).__name__}")

        def after_step(opt: Any, args: Any, kwargs: Any) -> None:
            self.refresh([p for group in opt.param_groups for p in group["params"]])

        return optimizer.register_step_post_hook(after_step)

    def release(self) -> int:
        """Drop every cached shard (the next gather remakes it); return the bytes freed."""
        freed = 0
        for _, param in self.wrapped():
            link = _local(param)._link
            freed += link.shard.nbytes if link.shard is not None else 0
            link.shard = link.kept = None
        return freed

    def stale(self) -> list[str]:
        """Names of the wrapped parameters whose cached shard is missing or
        was made before the parameter's latest write."""
        out = []
        for name, param in self.wrapped():
            local = _local(param)
            if local._link.shard is None or not local._link.shard.is_current(local):
                out.append(name)
        return out

    def shards(self) -> list[tuple[str, QuantizedShard, bool]]:
        """``(name, shard, current)`` for each wrapped parameter holding a
        cached shard: ``current`` is False where the parameter was written
        since the shard was made (its next gather makes it again)."""
        out = []
        for name, param in self.wrapped():
            local = _local(param)
            if local._link.shard is not None:
                out.append((name, local._link.shard, local._link.shard.is_current(local)))
        return out

    def held_bytes(self) -> int:
        """Bytes of the cached quantized shards (data and scales)."""
        shards = [_local(p)._link.shard for _, p in self.wrapped()]
        return sum(s.nbytes for s in shards if s is not None)

    def counts(self) -> GatherCounts:
        return GatherCounts(self._refreshes, self._refreshed, self._hook_remakes, self._reductions, self._gathers)


def _local(param: Any) -> Any:
    return getattr(param, "_local_tensor", param)


def _sharded_by_gathered(model: torch.nn.Module) -> dict[int, Any]:
    """``{id(gathered parameter): sharded parameter}`` for the wrapped
    parameters FSDP2 has gathered for the modules of ``model``."""
    return {id(r.unsharded): r.sharded for r in fsdp2_parameters(model)
            if r.unsharded is not None and isinstance(_local(r.sharded), ShardGatherWeight)}


def _entry(param: Any) -> _Entry | None:
    """The layout and shard group of a sharded wrapped parameter (a DTensor
    sharded on dim 0 by FSDP2); None before ``fully_shard``. Made once per
    placement of the parameter and kept on its link (the refresh after
    every step asks again for every weight)."""
    local = _local(param)
    if local is param:
        return None
    key, placed = (param.device_mesh, param.placements, tuple(param.shape)), local._link.placed
    if placed is None or placed[0][0] is not key[0] or placed[0][1:] != key[1:]:
        # The derived fields only: the link must not hold the tensors (see _Link.fsdp).
        placed = local._link.placed = (key, _placed(local, *key))
    return _Entry(param, local, *placed[1])


def _placed(local: ShardGatherWeight, mesh: Any, placements: Any, shape: tuple[int, ...]) -> tuple:
    """``(layout, group, world, dtype)`` of a parameter placed so."""
    from torch.distributed.tensor import Shard

    dims = [i for i, p in enumerate(placements) if isinstance(p, Shard)]
    if len(dims) != 1 or placements[dims[0]].dim != 0:
        raise InvalidContextError(
            f"quantized gather: a parameter placed {placements} is not sharded on dim 0 by FSDP2 "
            f"alone; leave it out of enable_quantized_gather (tensor parallel and Shard(dim>0) are not supported)."
        )
    dim = dims[0]
    records = _fsdp_records(local)
    mp_policy = getattr(records[1], "mp_policy", None) if records is not None else None
    return (ShardLayout.of(shape, mesh.get_local_rank(dim), mesh.size(dim)), mesh.get_group(dim), mesh.size(dim),
            _cast_dtype(local, mp_policy))


def _by_group(entries: list[_Entry]) -> list[list[_Entry]]:
    groups: dict[int, list[_Entry]] = {}
    for entry in entries:
        groups.setdefault(id(entry.group), []).append(entry)
    return list(groups.values())


def enable_quantized_gather(model: torch.nn.Module, quantizer: ShardQuantizer, factory: GatheredWeightFactory,
                            names: Iterable[str]) -> ShardGatherState:
    """Wrap the parameters ``names`` of ``model`` (as ``named_parameters``
    spells them) so that FSDP2 gathers them quantized; call before
    ``fully_shard``. Returns the model's :class:`ShardGatherState`, which
    also makes ``model.state_dict()`` return plain tensors.
    """
    if not isinstance(model, torch.nn.Module):
        raise ContextTypeError(f"enable_quantized_gather: model must be a torch.nn.Module; "
                               f"received {type(model).__name__}")
    state = ShardGatherState(model)
    params = dict(model.named_parameters())
    for name in names:
        if name not in params:
            raise InvalidContextError(f"enable_quantized_gather: model has no parameter {name!r}; "
                                      f"its parameters are {sorted(params)}")
        _wrap(model, name, params[name], _Link(quantizer, factory, state))
    return state


def enable_quantized_gather_sharded(model: torch.nn.Module, quantizer: ShardQuantizer,
                                    factory: GatheredWeightFactory, names: Iterable[str],
                                    state: ShardGatherState | None = None) -> ShardGatherState:
    """As :func:`enable_quantized_gather`, for a model FSDP2 has sharded
    already: call after ``fully_shard`` and before the model's first forward
    (FSDP2 reads a parameter's all-gather extension at its lazy init, which
    allows one installed after ``fully_shard``). Wraps the local tensor of
    each named sharded parameter (the DTensors FSDP2 made, which optimizers
    made since hold) and FSDP2's padded buffer of it, without replacing the
    parameter. ``state``: the model's state to add these weights to (another
    quantizer's weights, wrapped before); a new one where None."""
    if not isinstance(model, torch.nn.Module):
        raise ContextTypeError(f"enable_quantized_gather_sharded: model must be a torch.nn.Module; "
                               f"received {type(model).__name__}")
    state = ShardGatherState(model) if state is None else state
    params = dict(model.named_parameters())
    for name in names:
        if name not in params:
            raise InvalidContextError(f"enable_quantized_gather_sharded: model has no parameter {name!r}; "
                                      f"its parameters are {sorted(params)}")
        group, fsdp_param = _sharded_record(name, params[name])
        _wrap_sharded(fsdp_param, _Link(quantizer, factory, state))
        _plain_state_dict_of(fsdp_param._module_info.module)
    return state


def _sharded_record(name: str, param: Any) -> tuple[Any, Any]:
    """FSDP2's ``(FSDPParamGroup, FSDPParam)`` of sharded parameter
    ``param``, before the group's lazy init; refused otherwise, by name."""
    found = None
    api = _fsdp2_api()
    for fsdp_state in _distinct(_fsdp2_modules(api).values()) if api is not None else ():
        for group in _sharded_groups(fsdp_state, api):
            found = found or next(((group, fp) for fp in group.fsdp_params if fp.sharded_param is param), None)
    if found is None:
        raise InvalidContextError(
            f"enable_quantized_gather_sharded: {name} is not a parameter FSDP2 shards; call it after fully_shard "
            f"on the modules that hold it (a {type(param).__name__} of shape {tuple(param.shape)} arrived).")
    group, fsdp_param = found
    if getattr(group, "_reset_sharded_params", False) or hasattr(fsdp_param, "_unsharded_param"):
        raise InvalidContextError(
            f"enable_quantized_gather_sharded: the FSDP2 group of {name} has run its first forward, where FSDP2 "
            "fixes what its all-gather sends; set the quantized gather up after fully_shard and before the model's "
            "first forward.")
    if type(param._local_tensor) is not torch.Tensor or not param.dtype.is_floating_point:
        raise InvalidContextError(
            f"enable_quantized_gather_sharded: {name} must be sharded by FSDP2 over a plain floating-point local "
            f"tensor; it is {type(param._local_tensor).__name__} {param.dtype}.")
    return group, fsdp_param


def _wrap_sharded(fsdp_param: Any, link: _Link) -> None:
    """Wrap FSDP2's padded shard buffer and the sharded parameter's local
    tensor (a view of it) as FSDP2's ``fully_shard`` leaves them when it
    shards a wrapped parameter: one link for both, so that the re-padding of
    a short shard at lazy init carries the shard over (``_carried_shard``)."""
    local = fsdp_param.sharded_param._local_tensor
    padded = ShardGatherWeight(fsdp_param._sharded_param_data.view(fsdp_param.padded_sharded_param_size), link)
    fsdp_param._sharded_param_data = padded.view(-1)
    fsdp_param.sharded_param._local_tensor = padded.narrow(0, 0, local.size(0))


def _plain_state_dict_of(owner: torch.nn.Module) -> None:
    if not getattr(owner, "_plain_state_dict_hook", False):
        owner.register_state_dict_post_hook(_plain_state_dict)
        owner._plain_state_dict_hook = True


def _wrap(model: torch.nn.Module, name: str, param: torch.Tensor, link: _Link) -> None:
    if type(param.data) is not torch.Tensor or not param.dtype.is_floating_point or param.dim() < 1:
        raise InvalidContextError(
            f"enable_quantized_gather: {name} must be a plain floating-point tensor of at least one "
            f"dimension before fully_shard; it is {type(param.data).__name__} {param.dtype} of shape "
            f"{tuple(param.shape)}."
        )
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    wrapped = torch.nn.Parameter(ShardGatherWeight(param.data, link), requires_grad=param.requires_grad)
    setattr(owner, attr, wrapped)
    _plain_state_dict_of(owner)


def _plain_state_dict(module: torch.nn.Module, state_dict: dict[str, Any], prefix: str,
                      local_metadata: Any) -> None:
    """state_dict post hook: wrapped parameters are saved as plain tensors
    (or DTensors over plain local tensors), sharing storage."""
    for name in list(module._parameters):
        key = prefix + name
        if key in state_dict:
            state_dict[key] = plain_tensor(state_dict[key])

