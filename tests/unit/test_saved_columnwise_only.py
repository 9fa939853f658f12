"""D11 on CPU: which calls save their workspace columnwise only, and that
leaving a rowwise tensor out of the autograd ctx really drops it from what
backward gets (and frees it), with a real torch.autograd.Function."""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import pytest
import torch
from _binding_standin import load_binding

from workspace_manager import Microbatch, RecomputePass, Sharding, WeightSource, WorkspaceContext, select_policy
from workspace_manager import RECIPE_PROFILES


@pytest.fixture
def binding(monkeypatch):
    from _fake_te import compat

    return load_binding(monkeypatch, compat(), "runtime._attribution", "runtime._state", "runtime._levers",
                        "runtime._saved_tensors")


def _levers(binding, **fields):
    ctx = WorkspaceContext(capabilities=RECIPE_PROFILES["Float8CurrentScaling"], **fields)
    return binding["runtime._levers"].levers_from_plan("weight", ctx, select_policy(ctx).plan(ctx))


def test_plain_training_saves_columnwise_only(binding):
    assert _levers(binding, sharding=Sharding.NONE).saves_columnwise_only


@pytest.mark.parametrize("fields", [
    dict(sharding=Sharding.NONE, microbatch=Microbatch.FIRST),  # a cache entry: later microbatches read rowwise
    dict(sharding=Sharding.NONE, weight=WeightSource.QUANTIZED_PARAM),  # the weight itself
    dict(sharding=Sharding.NONE, grad_enabled=False),  # nothing saved
    dict(sharding=Sharding.FSDP2_RESHARD),  # rebuilt in backward
    dict(sharding=Sharding.NONE, recompute=RecomputePass.RECOMPUTE),
], ids=["cache_entry", "quantized_param", "no_grad", "fsdp2_rebuild", "recompute_pass"])
def test_other_calls_keep_what_they_save(binding, fields):
    assert not _levers(binding, **fields).saves_columnwise_only


class _Saves(torch.autograd.Function):
    """Saves (rowwise, columnwise, scale) as TE's storages do, then lets the
    seam's D11 step leave the rowwise tensor out."""

    seen: list = []

    @staticmethod
    def forward(ctx, x, rowwise, columnwise, scale, saved_tensors):
        ctx.save_for_backward(rowwise, columnwise, scale)
        saved_tensors.save_columnwise_only(ctx, [rowwise])
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        _Saves.seen.append(ctx.saved_tensors)
        return grad * 2, None, None, None, None


def test_a_dropped_rowwise_tensor_reaches_backward_as_none_and_is_freed(binding):
    saved_tensors = binding["runtime._saved_tensors"]
    x = torch.ones(3, requires_grad=True)
    rowwise, columnwise, scale = torch.ones(4), torch.full((4,), 2.0), torch.tensor(3.0)
    alive = weakref.ref(rowwise)
    out = _Saves.apply(x, rowwise, columnwise, scale, saved_tensors)
    del rowwise
    gc.collect()
    assert alive() is None  # nothing holds the rowwise data any more
    out.sum().backward()
    saved = _Saves.seen[-1]
    assert saved[0] is None and torch.equal(saved[1], columnwise) and torch.equal(saved[2], scale)


def test_rowwise_parts_follow_each_storage_layout(binding):
    parts = binding["runtime._saved_tensors"].rowwise_parts
    data, transpose, scale = torch.ones(2), torch.ones(2), torch.ones(1)
    fp8 = SimpleNamespace(_data=data, _transpose=transpose, _transpose_invalid=False, _scale_inv=scale)
    assert parts(fp8) == [data]  # the scale serves both directions
    assert parts(SimpleNamespace(_data=data, _transpose=None)) == []  # no columnwise copy: keep it
    rd, rs, cd = torch.ones(2), torch.ones(1), torch.ones(2)
    block = SimpleNamespace(_rowwise_data=rd, _rowwise_scale_inv=rs, _columnwise_data=cd)
    assert parts(block) == [rd, rs]
    assert parts(SimpleNamespace(_rowwise_data=rd, _columnwise_data=None)) == []
