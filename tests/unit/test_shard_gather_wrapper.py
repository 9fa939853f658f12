"""ShardGatherWeight outside FSDP2: it computes, steps, pickles and saves as
the plain tensor it holds, and counts every write (the quantized-gather
mechanism's FSDP2 behaviour is tested under torchrun in
tests/distributed/test_shard_gather.py)."""

from __future__ import annotations

import copy
import io
import weakref

import pytest
import torch
import torch.nn as nn

from workspace_manager._errors import ContextTypeError, InvalidContextError
from workspace_manager._shard_gather import (
    QuantizedShard, ShardGatherWeight, ShardLayout, _Link, enable_quantized_gather, plain_tensor,
)


class _Never:
    """Quantizer and factory stand-ins: outside FSDP2 nothing may call them."""

    def __getattr__(self, name):
        raise AssertionError(f"{name} called outside FSDP2")


def _pair(seed: int = 0, dtype=torch.float32):
    torch.manual_seed(seed)
    plain = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).to(dtype)
    ours = copy.deepcopy(plain)
    state = enable_quantized_gather(ours, _Never(), _Never(), ["0.weight", "2.weight"])
    return plain, ours, state


def test_the_wrapper_computes_as_its_plain_tensor():
    plain, ours, _ = _pair()
    assert type(ours[0].weight) is nn.Parameter or isinstance(ours[0].weight, ShardGatherWeight)
    assert isinstance(ours[0].weight.data, ShardGatherWeight)
    x = torch.randn(4, 6)
    y_plain, y_ours = plain(x), ours(x)
    assert type(y_ours) is torch.Tensor and torch.equal(y_plain, y_ours)
    y_plain.square().sum().backward()
    y_ours.square().sum().backward()
    for (name, p), q in zip(plain.named_parameters(), ours.parameters()):
        assert type(q.grad) is torch.Tensor and torch.equal(p.grad, q.grad), name
    w = ours[2].weight
    assert type(w + 1) is torch.Tensor and torch.equal(w * 2, plain[2].weight * 2)


OPTIMIZERS = {
    "adamw_for_loop": lambda ps: torch.optim.AdamW(ps, lr=0.1, foreach=False),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=0.1, foreach=True),
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=0.1, fused=True),
    "adam_foreach": lambda ps: torch.optim.Adam(ps, lr=0.1, foreach=True),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=False),
    "sgd_foreach": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=True),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizers_step_a_wrapped_parameter_as_a_plain_one(name, dtype):
    plain, ours, _ = _pair(dtype=dtype)
    opt_plain, opt_ours = OPTIMIZERS[name](plain.parameters()), OPTIMIZERS[name](ours.parameters())
    link = ours[0].weight._link
    for step in range(3):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step)).to(dtype)
        for model, opt in ((plain, opt_plain), (ours, opt_ours)):
            opt.zero_grad()
            model(x).float().square().sum().backward()
            writes = link.writes
            opt.step()
        assert link.writes > writes, f"{name}: a step wrote the weight without counting a write"
        for (n, p), q in zip(plain.named_parameters(), ours.parameters()):
            assert torch.equal(p, plain_tensor(q.data)), f"{name} step {step}: {n} differs"
    state_tensors = [t for s in opt_ours.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    assert state_tensors and not any(isinstance(t, ShardGatherWeight) for t in state_tensors)


def test_pickling_and_state_dict_give_plain_tensors():
    plain, ours, _ = _pair()
    sd = ours.state_dict()
    assert {type(v) for v in sd.values()} == {torch.Tensor}
    buffer = io.BytesIO()
    torch.save({"sd": sd, "param": ours[0].weight}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)  # no class of this project is needed
    assert type(loaded["param"]) is nn.Parameter and type(loaded["param"].data) is torch.Tensor
    assert torch.equal(loaded["param"], plain[0].weight)
    plain.load_state_dict(loaded["sd"])
    link = ours[2].weight._link
    writes = link.writes
    ours.load_state_dict(plain.state_dict())
    assert link.writes == writes + 1  # load_state_dict's copy_ counted


def test_plain_tensor_aliases_the_storage_and_its_version_counter():
    _, ours, _ = _pair()
    wrapper = ours[0].weight.data
    alias = plain_tensor(wrapper)
    assert type(alias) is torch.Tensor and alias.data_ptr() == wrapper._hp.data_ptr()
    version = wrapper._hp._version
    with torch.no_grad():
        alias.mul_(2)  # a write the wrapper never sees: DCP loading into a state dict
    assert wrapper._hp._version == version + 1


def test_a_kernel_below_the_dispatcher_writes_the_plain_tensor():
    """TE's FusedAdam hands ``_local_tensor`` to its C++ kernels, which
    write through the data pointer: the wrapper must be that memory."""
    _, ours, _ = _pair()
    wrapper = ours[0].weight.data
    assert wrapper.data_ptr() == wrapper._hp.data_ptr()
    before = wrapper._hp.clone()
    with torch.no_grad(), torch._C._DisableTorchDispatch():
        wrapper.add_(1.0)  # no __torch_dispatch__: the kernel runs on the wrapper's own storage
    assert torch.equal(wrapper._hp, before + 1.0)


def test_views_share_the_link_and_copies_do_not():
    _, ours, _ = _pair()
    wrapper = ours[0].weight.data
    assert wrapper.view(-1)._link is wrapper._link and wrapper[1:]._link is wrapper._link
    assert wrapper.detach()._link is wrapper._link
    assert wrapper.new_zeros(wrapper.shape)._link is not wrapper._link
    assert type(wrapper.clone()) is torch.Tensor
    assert type(copy.deepcopy(ours)[0].weight.data) is torch.Tensor  # a copied model is a plain one


def _shard_for(wrapper: ShardGatherWeight) -> QuantizedShard:
    layout = ShardLayout.of(tuple(wrapper.shape), 0, 1)
    return QuantizedShard(torch.zeros(wrapper.shape, dtype=torch.uint8), torch.ones(1), layout,
                          wrapper._link.writes, wrapper._hp._version, weakref.ref(wrapper._hp))


def test_a_copy_into_untouched_new_storage_carries_the_shard():
    """FSDP2's re-padding (new_zeros, then copy_ of the same rows) keeps the
    cached shard; any other write does not."""
    _, ours, _ = _pair()
    source = ours[0].weight.data
    source._link.shard = shard = _shard_for(source)
    assert shard.is_current(source)
    padded = source.new_zeros((source.shape[0] + 2, source.shape[1]))
    padded[: source.shape[0]].copy_(source)
    assert padded._link.shard is not None and padded._link.shard.data is shard.data
    assert padded._link.shard.is_current(padded[: source.shape[0]])
    padded.mul_(1)  # a later write makes it stale
    assert not padded._link.shard.is_current(padded[: source.shape[0]])
    again = source.new_zeros(source.shape)
    again.add_(1)
    again.copy_(source)  # new storage, but written before the copy: no carry
    assert again._link.shard is None


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("rows", [0, 1, 2, 5, 6, 10, 13])
def test_shard_layout_matches_fsdp2s_chunks(rows, world):
    """FSDP2 cuts dim 0 with torch.chunk, pads every shard to the first's
    size and gives missing chunks no rows."""
    chunks = list(torch.arange(rows).chunk(world)) if rows else []
    padded = chunks[0].numel() if chunks else 0
    for rank in range(world):
        layout = ShardLayout.of((rows, 3), rank, world)
        mine = chunks[rank] if rank < len(chunks) else torch.arange(0)
        assert layout.rows == mine.numel() and layout.padded_rows == padded
        if mine.numel():
            assert layout.row_start == int(mine[0])


def test_enable_quantized_gather_refuses_what_it_cannot_wrap():
    model = nn.Sequential(nn.Linear(3, 3), nn.Embedding(4, 3))
    model.register_parameter("count", nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False))
    with pytest.raises(InvalidContextError, match="has no parameter '0.wieght'"):
        enable_quantized_gather(model, _Never(), _Never(), ["0.wieght"])
    with pytest.raises(InvalidContextError, match="count must be a plain floating-point tensor"):
        enable_quantized_gather(model, _Never(), _Never(), ["count"])
    enable_quantized_gather(model, _Never(), _Never(), ["0.weight"])
    with pytest.raises(InvalidContextError, match="0.weight must be a plain floating-point tensor .* ShardGatherWeight"):
        enable_quantized_gather(model, _Never(), _Never(), ["0.weight"])
    with pytest.raises(ContextTypeError, match="model must be a torch.nn.Module"):
        enable_quantized_gather(model[0].weight, _Never(), _Never(), ["weight"])


def test_refresh_before_fully_shard_makes_nothing():
    _, _, state = _pair()
    assert [name for name, _ in state.wrapped()] == ["0.weight", "2.weight"]
    assert state.refresh() == 0 and state.held_bytes() == 0
    assert state.stale() == ["0.weight", "2.weight"]
    with pytest.raises(ContextTypeError, match="expected a torch.optim.Optimizer"):
        state.attach(object())
    assert isinstance(_Link(_Never(), _Never(), state).fresh(), _Link)


def test_fsdp2_reads_the_pre_all_gather_hook_s_signature_ready_made():
    """FSDP2 calls ``inspect.signature`` on the hook at every all-gather and
    accepts 1 or 5 parameters: the hook hands over its five-parameter
    signature as it is, not rebuilt from the code at each call."""
    import inspect

    _, ours, _ = _pair()
    local = ours[0].weight.data
    first, second = inspect.signature(local.fsdp_pre_all_gather), inspect.signature(local.fsdp_pre_all_gather)
    assert first is second
    assert list(first.parameters) == ["mesh", "orig_size", "contiguous_orig_stride", "module", "mp_policy"]


class _CountingMesh:
    """A one-dimensional device mesh that counts its lookups."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world, self.lookups = rank, world, 0

    def get_local_rank(self, dim=None):
        self.lookups += 1
        return self.rank

    def size(self, dim=None):
        self.lookups += 1
        return self.world

    def get_group(self, dim=None):
        self.lookups += 1
        return ("group", id(self))


class _Placed:
    """What the refresh reads of a sharded parameter: a DTensor's local
    tensor, placements, mesh and whole shape."""

    def __init__(self, local, mesh, shape) -> None:
        from torch.distributed.tensor import Shard

        self._local_tensor, self.device_mesh, self.shape, self.placements = local, mesh, shape, (Shard(0),)


def test_the_refresh_finds_a_placement_once_and_again_when_it_changes():
    from workspace_manager._shard_gather import _entry

    _, ours, _ = _pair()
    local = ours[0].weight.data
    mesh = _CountingMesh(1, 2)
    first = _entry(_Placed(local, mesh, torch.Size([10, 6])))
    assert (first.layout, first.world, first.group) == (ShardLayout((10, 6), 5, 5, 5), 2, ("group", id(mesh)))
    looked_up = mesh.lookups
    again = _entry(_Placed(local, mesh, torch.Size([10, 6])))
    assert mesh.lookups == looked_up and again.layout == first.layout  # cached: no mesh lookup at each step
    other = _CountingMesh(0, 4)
    moved = _entry(_Placed(local, other, torch.Size([10, 6])))
    assert other.lookups > 0 and (moved.layout, moved.world) == (ShardLayout((10, 6), 0, 3, 3), 4)
    grown = _entry(_Placed(local, other, torch.Size([12, 6])))
    assert grown.layout == ShardLayout((12, 6), 0, 3, 3)
