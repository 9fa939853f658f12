"""GroupedLinear's experts quantized by one grouped TE call (``_expert_quantize``),
on CPU with the stand-in of TE 2.20's GroupedLinear.

Under FSDP2's plan (nothing cached, nothing saved) a call quantizes every
expert once in forward and once in backward's rebuild, each by one grouped
call; outputs and gradients stay the stock twin's. Any quantizer the grouped
kernels may not reproduce (a custom subclass, experts of different settings,
amax reduction) and any experts that do not fit together fall back to one
quantization per expert.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

import _fake_te
import _fake_te_grouped as grouped
from _fake_te import load_full_binding
from workspace_manager import Sharding
from workspace_manager.testing.plans import FixedSharding

EXPERTS, IN, OUT = 3, 8, 6
SPLITS = [2, 3, 1]


@pytest.fixture
def ti(monkeypatch):
    grouped.GroupedFunction.backwards.clear()
    return load_full_binding(monkeypatch)


def _memo() -> SimpleNamespace:
    """What quantize_experts remembers its verdict on a list of quantizers in
    (a module's ``ModuleWorkspaceState``: its ``alike`` slot)."""
    return SimpleNamespace(alike=None)


def _module(name: str):
    return sys.modules[f"te_integration.{name}"]


@pytest.fixture
def grouped_calls(ti, monkeypatch):
    """``[(experts, rowwise, columnwise)]`` of each grouped kernel call."""
    tex, seen = _module("te._compat").tex, []
    kernel = tex.group_quantize

    def counting(source, quantizer, count, splits, *args, **kwargs):
        seen.append((count, quantizer.rowwise_usage, quantizer.columnwise_usage))
        return kernel(source, quantizer, count, splits, *args, **kwargs)

    monkeypatch.setattr(tex, "group_quantize", counting)
    return seen


def _pair(ti, sharding: Sharding, quantizers=None):
    stock, managed = (grouped.TEGroupedLinear(EXPERTS, IN, OUT, seed=5) for _ in range(2))
    ti.modules.convert_model(managed)
    managed.__dict__["_wm_state"] = ti.state.ModuleWorkspaceState(ti.state.ModuleKind.GROUPED_LINEAR,
                                                                  probe=FixedSharding(sharding))
    if quantizers is not None:
        stock.quantizers, managed.quantizers = quantizers(), quantizers()
    return stock, managed


def _step(module, seed: int = 3) -> list[torch.Tensor]:
    x = torch.randn(sum(SPLITS), IN, generator=torch.Generator().manual_seed(seed)).requires_grad_()
    out = module(x, SPLITS)
    out.square().sum().backward()
    return [out.detach(), x.grad] + [p.grad.clone() for p in module.parameters()]


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_under_fsdp2_each_pass_quantizes_every_expert_in_one_grouped_call(ti, grouped_calls):
    stock, managed = _pair(ti, Sharding.FSDP2_RESHARD)
    expected = _step(stock)
    assert grouped_calls == []  # stock quantizes expert by expert
    assert _same(_step(managed), expected)
    # Forward: rowwise only (the plan's forward usage); backward's rebuild: columnwise only.
    assert grouped_calls == [(EXPERTS, True, False), (EXPERTS, False, True)]


def test_a_plan_that_caches_quantizes_expert_by_expert(ti, grouped_calls):
    stock, managed = _pair(ti, Sharding.NONE)
    assert _same(_step(managed), _step(stock))
    assert grouped_calls == []


#: A library's own quantizer built on TE's, under TE's class name: it may quantize differently.
_CustomQuantizer = type("Float8CurrentScalingQuantizer", (_fake_te.Float8CurrentScalingQuantizer,),
                        {"__module__": "my_library.quantizers"})


def _mixed() -> list:
    quantizers = [_fake_te.Float8CurrentScalingQuantizer() for _ in range(EXPERTS)]
    quantizers[1].amax_epsilon = 1e-6
    return quantizers


def _reducing() -> list:
    quantizers = [_fake_te.Float8CurrentScalingQuantizer() for _ in range(EXPERTS)]
    for quantizer in quantizers:
        quantizer.with_amax_reduction = True
    return quantizers


@pytest.mark.parametrize("quantizers", [lambda: [_CustomQuantizer() for _ in range(EXPERTS)], _mixed, _reducing],
                         ids=["custom-subclass", "different-settings", "amax-reduction"])
def test_quantizers_the_grouped_kernels_may_not_reproduce_fall_back_to_one_per_expert(ti, grouped_calls,
                                                                                      quantizers):
    stock, managed = _pair(ti, Sharding.FSDP2_RESHARD, quantizers)
    assert _same(_step(managed), _step(stock))
    assert grouped_calls == []


@pytest.mark.parametrize("weights", [
    lambda: [torch.randn(4, 8), None, torch.randn(4, 8)],
    lambda: [torch.randn(4, 8), torch.randn(4, 6)],
    lambda: [torch.randn(4, 8), torch.randn(2, 8)],
    lambda: [torch.randn(4, 8), torch.randn(4, 8, dtype=torch.float64)],
], ids=["a-missing-expert", "other-columns", "other-rows", "other-dtype"])
def test_experts_that_do_not_fit_together_are_not_grouped(ti, grouped_calls, weights):
    quantize_experts = _module("runtime._expert_quantize").quantize_experts
    made = weights()
    quantizers = [_fake_te.Float8CurrentScalingQuantizer() for _ in made]
    assert quantize_experts(_memo(), quantizers, made, True, False) is None
    assert grouped_calls == []


def test_grouped_experts_hold_what_per_expert_quantization_holds(ti, grouped_calls):
    quantize_experts = _module("runtime._expert_quantize").quantize_experts
    weights = [torch.randn(4, 8) for _ in range(EXPERTS)]
    quantizers = [_fake_te.Float8CurrentScalingQuantizer() for _ in weights]
    outs = quantize_experts(_memo(), quantizers, weights, False, True)
    assert grouped_calls == [(EXPERTS, False, True)]
    for out, weight, quantizer in zip(outs, weights, quantizers):
        quantizer.set_usage(rowwise=False, columnwise=True)
        alone = quantizer.quantize(weight)
        assert out.get_usages() == alone.get_usages() == {"rowwise": False, "columnwise": True}
        assert torch.equal(out._transpose, alone._transpose)


# -- delayed scaling: each expert's own quantizer, one multi-tensor call ------------------------

@pytest.fixture
def multi_calls(ti, monkeypatch):
    """``[(experts, {(rowwise, columnwise) of its quantizers})]`` of each multi-tensor call."""
    tex, seen = _module("te._compat").tex, []
    kernel = tex.multi_tensor_quantize

    def counting(tensors, quantizers):
        seen.append((len(tensors), {(q.rowwise_usage, q.columnwise_usage) for q in quantizers}))
        return kernel(tensors, quantizers)

    monkeypatch.setattr(tex, "multi_tensor_quantize", counting)
    return seen


def _delayed() -> list:
    import _fake_te_mlp  # its stand-in is named as TE's delayed-scaling quantizer

    return [_fake_te_mlp.Float8Quantizer() for _ in range(EXPERTS)]


def test_delayed_scaling_quantizes_every_expert_in_one_multi_tensor_call(ti, grouped_calls, multi_calls):
    stock, managed = _pair(ti, Sharding.FSDP2_RESHARD, _delayed)
    assert _same(_step(managed), _step(stock))
    assert grouped_calls == []  # no concatenation for group_quantize: each expert is read where it is
    # Forward and backward's rebuild: both usages built (TE fuses only then), the other dropped after.
    assert multi_calls == [(EXPERTS, {(True, True)}), (EXPERTS, {(True, True)})]


def test_delayed_experts_keep_only_the_usage_asked_for(ti, multi_calls):
    quantize_experts = _module("runtime._expert_quantize").quantize_experts
    weights = [torch.randn(4, 8) for _ in range(EXPERTS)]
    quantizers = _delayed()
    outs = quantize_experts(_memo(), quantizers, weights, True, False)
    assert len(multi_calls) == 1
    for out, weight, quantizer in zip(outs, weights, quantizers):
        assert out.get_usages() == {"rowwise": True, "columnwise": False}
        quantizer.set_usage(rowwise=True, columnwise=False)
        assert torch.equal(out._data, quantizer.quantize(weight)._data)


@pytest.mark.parametrize("weights", [
    lambda: [torch.randn(4, 8), None, torch.randn(4, 8)],
    lambda: [torch.randn(4, 8), torch.randn(8, 4).t(), torch.randn(4, 8)],
    lambda: [torch.randn(4, 8), torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 8)],
], ids=["a-missing-expert", "not-contiguous", "other-dtype"])
def test_delayed_experts_the_multi_tensor_call_cannot_read_are_not_grouped(ti, multi_calls, weights):
    quantize_experts = _module("runtime._expert_quantize").quantize_experts
    assert quantize_experts(_memo(), _delayed(), weights(), True, False) is None
    assert multi_calls == []


def test_a_te_build_without_the_multi_tensor_call_quantizes_delayed_experts_one_by_one(ti, monkeypatch):
    expert_quantize = _module("runtime._expert_quantize")
    monkeypatch.delattr(_module("te._compat").tex, "multi_tensor_quantize")
    monkeypatch.setattr(expert_quantize, "_METHODS", {})
    assert expert_quantize.quantize_experts(_memo(), _delayed(), [torch.randn(4, 8) for _ in range(EXPERTS)],
                                            True, False) is None
