"""Drop-ins against their stock TE twins, bit for bit, on one GPU.

For each recipe that runs here, bf16 and quantized_model_init weights, and
each module: several optimizer steps, with microbatch positions, te.checkpoint
around the module, LayerNormMLP(checkpoint=True), and inference under no_grad.
Outputs, input grads, weight/bias/layernorm grads and updated parameters must
be identical (torch.equal), not close. Stock runs as the reference: its
quantized parameters' transposes are reset after each optimizer step
(``testbed.freshness.reference_reset``), which changes stock only where
TE's FusedAdam left one stale (DelayedScaling with quantized_model_init:
docs/decisions.md, D12); ``tests/gpu/test_freshness.py`` lists where.
"""

from __future__ import annotations

import contextlib

import pytest

from conftest import RECIPES, make_recipe, recipe_skip_reason

# TE and torch.distributed warn freely (deprecations, experimental features); the
# GPU tier checks numbers, not their warnings.
pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning",
                                                        "ignore::FutureWarning")]

HIDDEN, FFN, TOKENS = 128, 256, 64
MODULES = ["Linear", "LayerNormLinear", "LayerNormMLP"]
SCENARIOS = ["steps", "microbatches", "te_checkpoint", "te_checkpoint_nonreentrant", "own_checkpoint",
             "own_checkpoint_microbatches", "no_grad"]
#: Scenarios with microbatch positions (is_first_microbatch), and with LayerNormMLP(checkpoint=True).
MICROBATCHED = ("microbatches", "own_checkpoint_microbatches")
OWN_CHECKPOINT = ("own_checkpoint", "own_checkpoint_microbatches")


def _build(kind: str, managed: bool, recipe, quantized_init: bool, own_checkpoint: bool):
    import torch
    import transformer_engine.pytorch as te

    import te_integration as ti

    cls = getattr(ti if managed else te, kind)
    kwargs = dict(params_dtype=torch.bfloat16, device="cuda")
    if kind == "LayerNormMLP":
        args = (HIDDEN, FFN)
        kwargs["checkpoint"] = own_checkpoint
    else:
        args = (HIDDEN, HIDDEN)
    torch.manual_seed(1234)
    init = te.quantized_model_init(enabled=True, recipe=recipe) if quantized_init else contextlib.nullcontext()
    with init:
        return cls(*args, **kwargs)


def _step_inputs(step: int, micro: int):
    import torch

    g = torch.Generator(device="cuda").manual_seed(100 * step + micro)
    x = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g)
    return x.requires_grad_(True)


def _forward(module, x, recipe, scenario: str, micro: int):
    import torch
    import transformer_engine.pytorch as te

    kwargs = {}
    if scenario in MICROBATCHED:
        kwargs["is_first_microbatch"] = micro == 0
    with te.autocast(enabled=True, recipe=recipe):
        if scenario.startswith("te_checkpoint"):
            reentrant = scenario == "te_checkpoint"
            return te.checkpoint(module, x, use_reentrant=reentrant, **kwargs)
        if scenario == "no_grad":
            with torch.no_grad():
                return module(x, **kwargs)
        return module(x, **kwargs)


def _run(module, recipe, scenario: str, steps: int = 3, reference: bool = False):
    """Outputs and gradients of every microbatch of every step, and the
    parameters after each optimizer step; ``reference``: reset the
    quantized parameters' transposes after each step."""
    import torch
    import transformer_engine.pytorch as te

    record = []
    params = [p for p in module.parameters()]
    opt = te.optimizers.FusedAdam(params, lr=1e-2, master_weights=True, master_weight_dtype=torch.float32)
    micros = 3 if scenario in MICROBATCHED else 1
    for step in range(steps):
        for micro in range(micros):
            x = _step_inputs(step, micro)
            out = _forward(module, x, recipe, scenario, micro)
            out = out[0] if isinstance(out, tuple) else out
            record.append(("out", step, micro, out.detach().clone()))
            if scenario == "no_grad":
                continue
            (out.float() * 0.01).square().sum().backward()
            record.append(("dx", step, micro, x.grad.detach().clone()))
        if scenario == "no_grad":
            continue
        for name, p in module.named_parameters():
            grad = p.grad if p.grad is not None else getattr(p, "main_grad", None)
            record.append((f"grad:{name}", step, 0, None if grad is None else grad.detach().clone()))
        opt.step()
        opt.zero_grad(set_to_none=True)
        if reference:
            from testbed.freshness import reference_reset

            reference_reset(module)
        from transformer_engine.pytorch.quantized_tensor import QuantizedTensor

        for name, p in module.named_parameters():
            value = p.dequantize() if isinstance(p, QuantizedTensor) else p
            record.append((f"param:{name}", step, 0, value.detach().clone()))
    return record


def _assert_identical(stock, managed):
    import torch

    assert len(stock) == len(managed)
    for a, b in zip(stock, managed):
        assert a[:3] == b[:3]
        if a[3] is None or b[3] is None:
            assert a[3] is None and b[3] is None, a[:3]
            continue
        assert torch.equal(a[3], b[3]), f"{a[:3]} differs: max abs diff {(a[3].float() - b[3].float()).abs().max()}"


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("kind", MODULES)
@pytest.mark.parametrize("quantized_init", [False, True], ids=["bf16_params", "quantized_init"])
@pytest.mark.parametrize("recipe_name", RECIPES)
def test_drop_in_matches_stock_bit_for_bit(recipe_name, quantized_init, kind, scenario):
    reason = recipe_skip_reason(recipe_name)
    if reason:
        pytest.skip(reason)
    if scenario in OWN_CHECKPOINT and kind != "LayerNormMLP":
        pytest.skip("checkpoint=True is a LayerNormMLP option")
    recipe = make_recipe(recipe_name)
    own = scenario in OWN_CHECKPOINT
    stock = _run(_build(kind, False, recipe, quantized_init, own), recipe, scenario, reference=True)
    managed = _run(_build(kind, True, recipe, quantized_init, own), recipe, scenario)
    _assert_identical(stock, managed)
