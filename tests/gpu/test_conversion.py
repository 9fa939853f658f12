"""Converting existing models, and checkpoints between stock and drop-in modules."""

from __future__ import annotations

import copy
import io

import pytest

from conftest import make_recipe, recipe_skip_reason

# TE warns freely (deprecations, experimental features); the GPU tier checks numbers.
pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning",
                                                        "ignore::FutureWarning")]


@pytest.fixture
def recipe():
    reason = recipe_skip_reason("Float8CurrentScaling")
    if reason:
        pytest.skip(reason)
    return make_recipe("Float8CurrentScaling")


def _layer():
    import torch
    import transformer_engine.pytorch as te

    torch.manual_seed(5)
    return te.TransformerLayer(128, 256, 4, params_dtype=torch.bfloat16, hidden_dropout=0.0,
                               attention_dropout=0.0, fuse_qkv_params=True, device="cuda")


def _out_and_grads(model, recipe):
    import torch
    import transformer_engine.pytorch as te

    torch.manual_seed(9)
    x = torch.randn(16, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with te.autocast(enabled=True, recipe=recipe):
        out = model(x)
    out.float().square().sum().backward()
    return [out.detach(), x.grad] + [p.grad for p in model.parameters()]


def _assert_equal(a, b):
    import torch

    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), i


def test_convert_model_swaps_every_te_module_and_keeps_numerics(recipe):
    import transformer_engine.pytorch as te

    import te_integration as ti

    stock = _layer()
    converted = ti.convert_model(copy.deepcopy(stock))
    kinds = {type(m).__name__ for m in converted.modules()}
    assert {"Linear", "LayerNormLinear", "LayerNormMLP"} & kinds
    assert all(isinstance(m, ti.LayerNormMLP) for m in converted.modules() if isinstance(m, te.LayerNormMLP))
    assert all(isinstance(m, ti.Linear) for m in converted.modules() if isinstance(m, te.Linear))
    _assert_equal(_out_and_grads(stock, recipe), _out_and_grads(converted, recipe))


def test_module_filter_chooses_what_is_converted(recipe):
    import te_integration as ti

    model = ti.convert_model(_layer(), module_filter=lambda m, fqn: fqn.endswith("layernorm_mlp"))
    managed = [fqn for fqn, m in model.named_modules() if type(m).__module__.startswith("te_integration")]
    assert managed == ["layernorm_mlp"]


def test_managed_construction_builds_drop_ins_and_restores_names():
    import transformer_engine.pytorch.attention.multi_head_attention as mha
    import transformer_engine.pytorch.transformer as tl

    import te_integration as ti

    before = (mha.Linear, mha.LayerNormLinear, tl.LayerNormMLP)
    with pytest.raises(RuntimeError, match="inside"):
        with ti.managed_construction():
            layer = _layer()
            raise RuntimeError("inside")
    assert (mha.Linear, mha.LayerNormLinear, tl.LayerNormMLP) == before
    with ti.managed_construction():
        layer = _layer()
    assert isinstance(layer.layernorm_mlp, ti.LayerNormMLP)
    assert isinstance(layer.self_attention.proj, ti.Linear)


@pytest.mark.parametrize("direction", ["stock_to_managed", "managed_to_stock"])
def test_checkpoints_load_both_ways(recipe, direction):
    import torch

    import te_integration as ti

    stock, managed = _layer(), ti.convert_model(_layer())
    for p in stock.parameters():  # make the two differ before loading
        p.data.add_(0.5)
    _out_and_grads(stock, recipe)  # an FP8 step fills the recipe state saved in extra_state
    src, dst = (stock, managed) if direction == "stock_to_managed" else (managed, stock)
    buf = io.BytesIO()
    torch.save(src.state_dict(), buf)
    buf.seek(0)
    dst.load_state_dict(torch.load(buf, weights_only=False))
    assert src.state_dict().keys() == dst.state_dict().keys()
    for m in (stock, managed):
        m.zero_grad(set_to_none=True)
    _assert_equal(_out_and_grads(src, recipe), _out_and_grads(dst, recipe))
