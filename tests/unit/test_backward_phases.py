"""A call's backward in two named phases (``runtime/_release.BackwardWork``) and the
one rebuild mechanism (``runtime/_rebuild.Rebuild``), on the CPU stand-ins of TE.

* The before phase runs where each kind's backward starts, before TE's
  backward reads the saved weights (GroupedLinear's ``restore_from_func_ctx``
  seam; te.ops GroupedLinear's ``fuser_backward``).
* The after phase (the release) runs when TE's backward raises, and a work
  with nothing to release makes no call to it.
* Every kind's rebuild quantizes through ``quantize_with_usage`` with the
  plan's usages: the dense kinds' in TE's backward (``RebuildQuantizer``),
  the grouped kinds' in the before phase (``ExpertRebuild``, ``OpRebuild``).
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

import _fake_te
import _fake_te_grouped as grouped
import _fake_te_ops as ops
from _fake_te import TELinear
from _fake_te_ops_grouped import GroupedLinear as TEOpsGroupedLinear
from test_ops_binding import ti  # noqa: F401  (the fixture: the full binding, te.ops's stand-in reset)
from workspace_manager import Sharding
from workspace_manager.testing.plans import FixedSharding

EXPERTS, IN, OUT = 3, 8, 6
SPLITS = [2, 3, 1]
COLUMNWISE_ONLY = {"rowwise": False, "columnwise": True}


def _binding(name: str):
    return sys.modules[f"te_integration.{name}"]


def _pinned(ti, module, sharding: Sharding, is_fsdp2: bool | None = None):
    probe = FixedSharding(sharding, is_fsdp2=is_fsdp2)
    module.__dict__["_wm_state"] = ti.state.ModuleWorkspaceState(module._wm_kind, None, probe=probe)
    return module


def _grouped_module(ti):
    """A drop-in GroupedLinear (split-quantize path) whose plan requantizes in backward."""
    managed = ti.modules.convert_model(grouped.TEGroupedLinear(EXPERTS, IN, OUT, seed=5))
    return _pinned(ti, managed, Sharding.FSDP2_RESHARD)


def _ops_grouped(ti):
    """A te.ops GroupedLinear, then a BasicLinear, both drop-ins, planned for FSDP2."""
    model = ops.Sequential(TEOpsGroupedLinear(EXPERTS, IN, OUT, seed=5), ops.BasicLinear(OUT, IN, seed=6))
    ti.modules.convert_model(model)
    for op in model.ops:
        _pinned(ti, op, Sharding.FSDP2_RESHARD, is_fsdp2=False)
    return model


def _usages(weight) -> dict | str:
    return weight.get_usages() if isinstance(weight, _fake_te.QuantizedTensorStorage) else "high precision"


# -- the before phase, before TE's backward reads -------------------------------------
def test_grouped_linear_before_phase_runs_before_te_backward_reads_the_weights(ti, monkeypatch):
    events = []
    rebuild_class = _binding("kinds.grouped_linear").ExpertRebuild
    rebuild = rebuild_class.before_te_backward
    dgrad = grouped._dgrad

    def before(self, ctx, saved):
        events.append("before")
        return rebuild(self, ctx, saved)

    def reading(weights, i, dy):
        events.append(_usages(weights[i]))
        return dgrad(weights, i, dy)

    monkeypatch.setattr(rebuild_class, "before_te_backward", before)
    monkeypatch.setattr(grouped, "_dgrad", reading)
    managed = _grouped_module(ti)
    x = torch.randn(sum(SPLITS), IN, requires_grad=True)
    out = managed(x, SPLITS)
    assert events == []  # forward runs no phase
    out.sum().backward()
    assert events == ["before"] + [COLUMNWISE_ONLY] * EXPERTS, events


def test_te_ops_grouped_before_phase_runs_before_te_fuser_backward_reads_the_weights(ti, monkeypatch):
    events = []
    grouped_ops = _binding("kinds.ops_grouped_linear")
    rebuild = grouped_ops.OpRebuild.before_te_backward
    te_fuser_backward = TEOpsGroupedLinear.fuser_backward

    def before(self, op_ctx, saved):
        events.append("before")
        return rebuild(self, op_ctx, saved)

    def reading(self, basic_op_ctxs, grad_output, **kwargs):
        events.append([_usages(w) for w in basic_op_ctxs[0].saved_tensors[-EXPERTS:]])
        return te_fuser_backward(self, basic_op_ctxs, grad_output, **kwargs)

    monkeypatch.setattr(grouped_ops.OpRebuild, "before_te_backward", before)
    monkeypatch.setattr(TEOpsGroupedLinear, "fuser_backward", reading)
    model = _ops_grouped(ti)
    out = model(torch.randn(EXPERTS * 2, IN, requires_grad=True))
    op_ctx = out.grad_fn.basic_op_ctxs[0]
    assert isinstance(op_ctx._te_wm_backward, _binding("runtime._release").BackwardWork)
    out.sum().backward()
    assert events == ["before", [COLUMNWISE_ONLY] * EXPERTS], events
    assert op_ctx._te_wm_backward is None  # run once


# -- the after phase ------------------------------------------------------------------
def test_the_after_phase_runs_when_te_backward_raises(ti, monkeypatch):
    release = _binding("runtime._release")
    ran = []
    monkeypatch.setattr(release.BackwardWork, "after_te_backward", lambda work: ran.append(work))
    work = release.BackwardWork(module=None, cache_keys=("weight0", "weight1"))
    ctx = SimpleNamespace(_te_wm_backward=work)

    def te_backward(ctx, *grads):
        assert ran == []  # not before TE's backward
        raise RuntimeError("TE's backward failed")

    with pytest.raises(RuntimeError, match="TE's backward failed"):
        release.run_backward(ctx, te_backward, ("grad",))
    assert ran == [work] and ctx._te_wm_backward is None


def test_a_work_with_only_a_before_phase_makes_no_after_phase_call(ti, monkeypatch):
    release = _binding("runtime._release")
    ran = []
    monkeypatch.setattr(release.BackwardWork, "after_te_backward", lambda work: ran.append(work))
    ctx = SimpleNamespace(_te_wm_backward=release.BackwardWork(module=None, before_te_backward=lambda c, s: s))
    assert release.run_backward(ctx, lambda ctx, grad: grad, ("grad",)) == "grad"
    assert ran == [] and ctx._te_wm_backward is None


def test_a_grouped_linear_backward_that_raises_still_releases_after_its_rebuild(ti, monkeypatch):
    """The before phase ran inside TE's backward, which then raised in its
    dgrad: the after phase still runs, once, after it."""
    release = _binding("runtime._release")
    events = []
    after = release.BackwardWork.after_te_backward
    monkeypatch.setattr(release.BackwardWork, "after_te_backward", lambda work: (events.append("after"),
                                                                                after(work)))

    def failing(weights, i, dy):
        events.append(_usages(weights[i]))
        raise RuntimeError("injected dgrad failure")

    monkeypatch.setattr(grouped, "_dgrad", failing)
    managed = _grouped_module(ti)
    out = managed(torch.randn(sum(SPLITS), IN, requires_grad=True), SPLITS)
    planned = out.grad_fn._te_wm_backward
    assert planned.before_te_backward is not None and not planned.cache_keys
    # FSDP2's default plan releases no cache: the same work, with one to release.
    out.grad_fn._te_wm_backward = release.BackwardWork(planned.module, cache_keys=("weight0",),
                                                       before_te_backward=planned.before_te_backward)
    with pytest.raises(RuntimeError, match="injected dgrad failure"):
        out.sum().backward()
    assert events == [COLUMNWISE_ONLY, "after"], events  # TE read the rebuilt weight, then raised
    assert out.grad_fn._te_wm_backward is None


# -- one rebuild mechanism ------------------------------------------------------------
@pytest.fixture
def quantized_again(ti, monkeypatch):
    """``[(tensor, rowwise, columnwise)]`` of every weight the one rebuild
    quantizes: one by one (``quantize_with_usage``) or, for many of one
    format, in one grouped call (``quantize_experts``)."""
    rebuild = _binding("runtime._rebuild")
    seen, step, grouped = [], rebuild.quantize_with_usage, rebuild.quantize_experts

    def recording(quantizer, tensor, rowwise, columnwise, restore=True):
        seen.append((tensor, rowwise, columnwise))
        return step(quantizer, tensor, rowwise, columnwise, restore)

    def recording_grouped(state, quantizers, weights, rowwise, columnwise):
        out = grouped(state, quantizers, weights, rowwise, columnwise)
        if out is not None:
            seen.extend((tensor, rowwise, columnwise) for tensor in weights)
        return out

    monkeypatch.setattr(rebuild, "quantize_with_usage", recording)
    monkeypatch.setattr(rebuild, "quantize_experts", recording_grouped)
    return seen


def _only_columnwise(seen: list, weights) -> bool:
    ids = {id(w) for w in weights}
    return sorted(id(t) for t, _, _ in seen if id(t) in ids) == sorted(ids) and all(
        (row, col) == (False, True) for t, row, col in seen if id(t) in ids)


def test_a_dense_rebuild_is_a_rebuild_te_s_backward_runs(ti, quantized_again):
    rebuild = _binding("runtime._rebuild")
    managed = _pinned(ti, ti.modules.convert_model(TELinear(8, 8, seed=1)), Sharding.FSDP2_RESHARD)
    out = managed(torch.randn(4, 8, requires_grad=True))
    quantizer = out.grad_fn.backward_objects.weight_quantizer
    assert type(quantizer) is rebuild.RebuildQuantizer and isinstance(quantizer, rebuild.Rebuild)
    assert quantizer.before_te_backward("ctx", "saved") == "saved"  # TE's backward places it: no phase of ours
    assert quantized_again == []
    out.sum().backward()
    assert _only_columnwise(quantized_again, [managed.weight]), quantized_again


def test_a_grouped_linear_rebuild_is_a_rebuild_of_the_before_phase(ti, quantized_again):
    managed = _grouped_module(ti)
    out = managed(torch.randn(sum(SPLITS), IN, requires_grad=True), SPLITS)
    work = out.grad_fn._te_wm_backward
    part = work.before_te_backward.__self__
    assert isinstance(part, _binding("runtime._rebuild").Rebuild) and type(part).__name__ == "ExpertRebuild"
    assert quantized_again == []
    out.sum().backward()
    assert _only_columnwise(quantized_again, [getattr(managed, f"weight{i}") for i in range(EXPERTS)])


def test_a_te_ops_grouped_rebuild_is_a_rebuild_of_the_before_phase(ti, quantized_again):
    model = _ops_grouped(ti)
    out = model(torch.randn(EXPERTS * 2, IN, requires_grad=True))
    part = out.grad_fn.basic_op_ctxs[0]._te_wm_backward.before_te_backward.__self__
    assert isinstance(part, _binding("runtime._rebuild").Rebuild) and type(part).__name__ == "OpRebuild"
    out.sum().backward()
    grouped_op, basic = model.ops
    assert _only_columnwise(quantized_again, [getattr(grouped_op, f"weight{i}") for i in range(EXPERTS)])
    assert _only_columnwise(quantized_again, [basic.weight])  # BasicLinear's: TE's backward runs it
