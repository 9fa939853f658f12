"""te.ops.GroupedLinear under the policy (CPU, ``_fake_te_ops_grouped``): each
group's weight planned, what is saved and rebuilt, numerics equal to stock,
through both of TE's forward paths."""

from __future__ import annotations

import pytest
import torch

import _fake_te
import _fake_te_ops as ops
from _fake_te_ops_grouped import GroupedLinear
from test_ops_binding import IN, OUT, _sharded, ti  # noqa: F401  (the fixture)
from workspace_manager import Sharding

GROUPS = 3


def _grouped(seed: int = 5, tensor_path: bool = False):
    model = ops.Sequential(GroupedLinear(GROUPS, IN, OUT, seed=seed), ops.BasicLinear(OUT, IN, seed=seed + 1))
    model.ops[0].grouped_tensor_path = tensor_path
    return model


@pytest.mark.parametrize("tensor_path", [False, True])
@pytest.mark.parametrize("sharding", [Sharding.NONE, Sharding.FSDP2_RESHARD])
def test_grouped_default_plans_are_carried_out_and_match_stock(ti, sharding, tensor_path):
    stock, managed = _grouped(tensor_path=tensor_path), _grouped(tensor_path=tensor_path)
    ti.modules.convert_model(managed)
    grouped = managed.ops[0]
    assert type(grouped).__name__ == "OpsGroupedLinear"
    for op in managed.ops:
        _sharded(ti, op, sharding)
    ops.FORWARD.clear()
    x = torch.randn(GROUPS * 2, IN, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
    got_out = managed(x)
    saved = list(got_out.grad_fn.tensor_objects)
    grouped_saved = [o for o in saved if isinstance(o, _fake_te.Workspace)]
    saved_tensors = list(got_out.grad_fn.saved_tensors)
    forward = list(ops.FORWARD)
    got_out.square().sum().backward()
    xs = x.detach().clone().requires_grad_(True)
    want_out = stock(xs)
    want_out.square().sum().backward()
    assert torch.equal(want_out, got_out) and torch.equal(xs.grad, x.grad)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(stock.parameters(), managed.parameters()))
    plans = ti.modules.last_plans(grouped)
    assert sorted(plans) == [f"weight{i}" for i in range(GROUPS)]
    if sharding is Sharding.NONE:  # each group's columnwise copy only (also where TE's path saves both)
        assert len(grouped_saved) == GROUPS + 1
        assert all(w._data is None and w._transpose is not None for w in grouped_saved)
    else:  # the high-precision weights saved, the columnwise data rebuilt in backward
        assert len(grouped_saved) == 0
        assert forward[:GROUPS] == [{"rowwise": True, "columnwise": False}] * GROUPS
        assert all(any(t is getattr(grouped, f"weight{i}") for t in saved_tensors) for i in range(GROUPS))
