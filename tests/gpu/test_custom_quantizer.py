"""The custom-quantizer example (examples/custom_quantizer) on the GPU, end to end.

A weight quantizer built on TE's CustomRecipe/qfactory extension points and
registered with its capabilities:

- the testing kit passes on TE's own quantizer code, on CUDA tensors;
- the drop-in ``te_integration.Linear`` plans it with the registered
  capabilities and matches a stock ``te.Linear`` under the same
  ``CustomRecipe`` bit for bit over 3 optimizer steps;
- with its registration removed, the drop-in's first forward refuses it,
  naming the class;
- under FSDP2 on two GPUs (``_custom_fsdp2.py`` through torchrun), the
  drop-in's per-layer forward increment stays within 50 KiB of bf16 and its
  losses equal stock TE's.

Layers are bias-free: TE's bias gradient under FP8 goes through a fused C++
kernel (``tex.bgrad_quantize``, module/base.py:1786) that takes only TE's
built-in quantizers, and the custom GEMM needs every operand custom
(custom_recipes/gemm.py:51-52), so a bias would fail in stock TE too.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from _launch import two_rank_report

# TE and torch.distributed warn freely (deprecations, experimental features); the
# GPU tier checks numbers, not their warnings.
pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning",
                                                        "ignore::FutureWarning")]

ROOT = Path(__file__).resolve().parents[2]
HIDDEN, TOKENS, STEPS = 128, 64, 3
FWD_KIB_PER_LAYER = 50


def _fp8_skip_reason() -> str | None:
    """TE's own support check for per-tensor FP8 (the example's format)."""
    from transformer_engine.pytorch.quantization import check_fp8_support

    ok, reason = check_fp8_support()
    return None if ok else f"CustomRecipe with per-tensor FP8: {reason}"


def _example_package():
    """examples.custom_quantizer, importable from the repository root."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import examples.custom_quantizer as example

    return example


@pytest.fixture
def example():
    reason = _fp8_skip_reason()
    if reason:
        pytest.skip(reason)
    return _example_package()


# -- (a) the kit on TE's quantizer ---------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_kit_passes_on_the_te_quantizer(example, dtype):
    import torch

    from workspace_manager.extending import quantizer_capabilities
    from workspace_manager.testing import check_quantizer

    caps = quantizer_capabilities(example.ExamplePerTensorFP8Quantizer())
    assert caps == example.EXAMPLE_CAPABILITIES
    report = check_quantizer(example.ExamplePerTensorFP8KitAdapter, caps, dtype=getattr(torch, dtype))
    report.raise_for_failures()


# -- (b) the drop-in against stock TE ----------------------------------------------
def _build(managed: bool):
    import torch
    import transformer_engine.pytorch as te

    import te_integration as ti

    torch.manual_seed(1234)
    cls = ti.Linear if managed else te.Linear
    return cls(HIDDEN, HIDDEN, bias=False, params_dtype=torch.bfloat16, device="cuda")


def _inputs(step: int):
    import torch

    g = torch.Generator(device="cuda").manual_seed(100 + step)
    return torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True)


def _run(module, recipe, steps: int = STEPS) -> list:
    """Output, input grad and weight grad of every step, and the weight after
    each optimizer step."""
    import torch
    import transformer_engine.pytorch as te

    opt = te.optimizers.FusedAdam(list(module.parameters()), lr=1e-2, master_weights=True,
                                  master_weight_dtype=torch.float32)
    record = []
    for step in range(steps):
        x = _inputs(step)
        with te.autocast(enabled=True, recipe=recipe):
            out = module(x)
        (out.float() * 0.01).square().sum().backward()
        record += [("out", step, out.detach().clone()), ("dx", step, x.grad.detach().clone()),
                   ("dw", step, module.weight.grad.detach().clone())]
        opt.step()
        opt.zero_grad(set_to_none=True)
        record.append(("weight", step, module.weight.detach().clone()))
    return record


def _weight_quantizer(module):
    from transformer_engine.pytorch.constants import FP8FwdTensorIdx

    return module.quantizers["scaling_fwd"][FP8FwdTensorIdx.GEMM1_WEIGHT]


def test_drop_in_plans_with_the_registered_capabilities_and_matches_stock_bit_for_bit(example):
    import torch

    import te_integration as ti
    from workspace_manager import BackwardSource

    recipe = example.make_recipe()
    stock, managed = _build(False), _build(True)
    assert torch.equal(stock.weight, managed.weight)
    expected, got = _run(stock, recipe), _run(managed, recipe)
    for module in (stock, managed):
        assert type(_weight_quantizer(module)) is example.ExamplePerTensorFP8Quantizer
    ctx, plan = ti.last_plans(managed)["weight"]
    assert ctx.capabilities.name == example.EXAMPLE_CAPABILITIES.name
    assert plan.backward_source is BackwardSource.SAVED_WORKSPACE, plan.summary()
    assert ti.last_plans(stock) == {}
    assert len(expected) == len(got)
    for a, b in zip(expected, got):
        assert a[:2] == b[:2]
        assert torch.equal(a[2], b[2]), f"{a[:2]} differs: max abs diff {(a[2].float() - b[2].float()).abs().max()}"


# -- (c) unregistered -------------------------------------------------------------------
def test_unregistered_quantizer_fails_at_first_forward_naming_the_class(example, monkeypatch):
    """Lookup walks the class hierarchy, so a subclass would inherit the
    registration; instead the class's own entry is removed."""
    import transformer_engine.pytorch as te

    from workspace_manager import UnknownQuantizerError
    from workspace_manager.extending import default_registry
    from workspace_manager._quantizer_registry import qualified_name

    key = qualified_name(example.ExamplePerTensorFP8Quantizer)
    assert example.ExamplePerTensorFP8Quantizer in default_registry
    monkeypatch.setattr(default_registry, "_entries", {k: v for k, v in default_registry._entries.items() if k != key})
    monkeypatch.setattr(default_registry, "_by_class", {})  # the lookup memo, emptied as unregister() does
    recipe = example.make_recipe()
    stock, managed = _build(False), _build(True)
    with te.autocast(enabled=True, recipe=recipe):
        stock(_inputs(0))  # stock TE never consults the registry
    with pytest.raises(UnknownQuantizerError, match=r"ExamplePerTensorFP8Quantizer.*register_quantizer"):
        with te.autocast(enabled=True, recipe=recipe):
            managed(_inputs(0))


# -- (d) FSDP2 on two GPUs ------------------------------------------------------------------
@pytest.fixture(scope="module")
def fsdp2_report(tmp_path_factory):
    reason = _fp8_skip_reason()
    if reason:
        pytest.skip(reason)
    return two_rank_report("_custom_fsdp2.py", tmp_path_factory.mktemp("custom_fsdp2"), keep_env="TE_WM_CUSTOM_FSDP2_REPORT")


def _fsdp2_run(report, kind: str) -> dict:
    if kind not in report["runs"]:
        pytest.fail(f"no {kind} run; errors:\n" + "\n".join(e["where"] + "\n" + e["traceback"] for e in report["errors"]))
    return report["runs"][kind]


def test_fsdp2_worker_ran_every_configuration(fsdp2_report):
    assert not fsdp2_report["errors"], "\n".join(e["where"] + "\n" + e["traceback"] for e in fsdp2_report["errors"])


def test_fsdp2_runs_used_the_example_quantizer_and_the_drop_in_planned_it(fsdp2_report):
    for kind in ("stock", "managed"):
        assert _fsdp2_run(fsdp2_report, kind)["weight_quantizer"] == "ExamplePerTensorFP8Quantizer"
    plans = _fsdp2_run(fsdp2_report, "managed")["plans"]
    assert {p["capabilities"] for p in plans} == {"example_per_tensor_fp8"}
    assert {p["sharding"] for p in plans} == {"fsdp2_reshard"}
    # Layers whose input needs a gradient run dgrad: backward quantizes the
    # gathered weight again instead of keeping the forward copy (TE#2681).
    dgrad = [p for p in plans if p["input_requires_grad"]]
    assert dgrad and all(p["backward"] == "requantize" for p in dgrad), plans


def test_fsdp2_losses_identical_to_stock(fsdp2_report):
    assert _fsdp2_run(fsdp2_report, "managed")["losses"] == _fsdp2_run(fsdp2_report, "stock")["losses"]


def test_fsdp2_forward_increment_within_50_kib_of_bf16(fsdp2_report):
    base = _fsdp2_run(fsdp2_report, "bf16")["fwd_kib_per_layer"]
    got = _fsdp2_run(fsdp2_report, "managed")["fwd_kib_per_layer"]
    assert got - base <= FWD_KIB_PER_LAYER, f"{got:.1f} KiB/layer vs bf16 {base:.1f}"
