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


def _qparam_levers(columnwise):
    from types import SimpleNamespace

    from workspace_manager import BackwardSource

    plan = SimpleNamespace(columnwise_source=columnwise, backward_source=BackwardSource.SAVED_PARAMETER)
    return SimpleNamespace(is_quantized_param=True, plan=plan, releases=False)


def test_grouped_backward_derives_the_columnwise_data_a_release_dropped_from_quantized_params(ti):
    """TE's te.ops GroupedLinear saves quantized parameters as they are and
    derives no columnwise data in backward; the plan's release dropped it
    after the last backward, and DelayedScaling's fused FusedAdam step does
    not make it again. So the drop-in derives it before TE's backward reads it."""
    import sys
    from types import SimpleNamespace

    from workspace_manager import ColumnwiseSource

    grouped = sys.modules["te_integration.kinds.ops_grouped_linear"]
    quantizer = _fake_te.Float8CurrentScalingQuantizer()
    params = [quantizer.quantize(torch.randn(OUT, IN)) for _ in range(GROUPS)]
    for p in params:
        p.update_usage(columnwise_usage=False)  # what the release after the last backward left
    levers = _qparam_levers(ColumnwiseSource.DERIVED)
    record = SimpleNamespace(module=None, weights=tuple(x for p in params for x in (p, levers)))
    ctx = SimpleNamespace(input_requires_grad=True, saved_tensors=(torch.ones(1), *params))
    grouped._edit_op_ctx(ctx, record)
    grouped.grouped_before_backward(ctx)
    assert all(p.get_usages() == {"rowwise": True, "columnwise": True} for p in params)
    assert all(torch.equal(p._transpose, p._data.t()) for p in params)
    # A parameter that carries its columnwise data since it was made is left as it is.
    kept = [quantizer.quantize(torch.randn(OUT, IN)) for _ in range(GROUPS)]
    for p in kept:
        p.update_usage(columnwise_usage=False)
    record = SimpleNamespace(module=None,
                             weights=tuple(x for p in kept for x in (p, _qparam_levers(ColumnwiseSource.PARAMETER))))
    ctx = SimpleNamespace(input_requires_grad=True, saved_tensors=tuple(kept))
    grouped._edit_op_ctx(ctx, record)
    grouped.grouped_before_backward(ctx)
    assert all(not p.get_usages()["columnwise"] for p in kept)


@pytest.mark.parametrize("sharding, grouped_passes", [
    (Sharding.FSDP2_RESHARD, [(GROUPS, True, False), (GROUPS, False, True)]),  # forward rowwise, backward columnwise
    (Sharding.NONE, []),  # the plain plan saves forward's copies: TE's per-group quantization
])
def test_groups_are_quantized_at_once_where_the_plan_keeps_no_copy(ti, monkeypatch, sharding, grouped_passes):
    import sys

    tex, seen = sys.modules["te_integration.te._compat"].tex, []
    kernel = tex.group_quantize

    def counting(source, quantizer, count, splits, *args, **kwargs):
        seen.append((count, quantizer.rowwise_usage, quantizer.columnwise_usage))
        return kernel(source, quantizer, count, splits, *args, **kwargs)

    monkeypatch.setattr(tex, "group_quantize", counting)
    stock, managed = _grouped(), _grouped()
    ti.modules.convert_model(managed)
    for op in managed.ops:
        _sharded(ti, op, sharding)
    x = torch.randn(GROUPS * 2, IN, generator=torch.Generator().manual_seed(4)).requires_grad_(True)
    got = managed(x)
    got.square().sum().backward()
    assert seen == grouped_passes
    xs = x.detach().clone().requires_grad_(True)
    want = stock(xs)
    want.square().sum().backward()
    assert torch.equal(want, got) and torch.equal(xs.grad, x.grad)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(stock.parameters(), managed.parameters()))
