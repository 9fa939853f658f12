"""A TE module called inside a drop-in's forward is planned as itself (GPU).

The LoRA pattern: a subclass of ``te.Linear`` whose forward adds a second
``te.Linear`` (the adapter). Converted with the adapter left stock, it must
give exactly the numbers of an all-stock twin over steps of microbatches,
and each module's cache must hold its own weight's workspace only. Before
the fix the adapter's workspace went into the outer module's cache and the
outputs differed, silently.
"""

from __future__ import annotations

import pytest

from conftest import RECIPES, make_recipe, recipe_skip_reason

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning",
                                                        "ignore::FutureWarning")]
HIDDEN, TOKENS, STEPS, MICRO = 128, 64, 3, 3


def _lora_class():
    import transformer_engine.pytorch as te

    class LoRALinear(te.Linear):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.adapter = te.Linear(HIDDEN, HIDDEN, bias=False, params_dtype=kwargs["params_dtype"],
                                     device="cuda")

        def forward(self, inp, is_first_microbatch=None):
            return super().forward(inp, is_first_microbatch) + self.adapter(inp, is_first_microbatch)

    return LoRALinear


def _build(filter_fn):
    import torch

    import te_integration as ti

    torch.manual_seed(7)
    model = _lora_class()(HIDDEN, HIDDEN, params_dtype=torch.bfloat16, device="cuda")
    return ti.convert_model(model, module_filter=filter_fn) if filter_fn is not None else model


def _train(model, recipe) -> list:
    import torch
    import transformer_engine.pytorch as te

    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    seen = []
    for step in range(STEPS):
        for micro in range(MICRO):
            g = torch.Generator(device="cuda").manual_seed(100 * step + micro)
            x = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
            with te.autocast(enabled=True, recipe=recipe):
                out = model(x, is_first_microbatch=micro == 0)
            out.float().pow(2).mean().backward()
            seen += [out.detach(), x.grad]
        seen += [p.grad.clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad(set_to_none=True)
    return seen + [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("convert", ["outer_only", "adapter_only", "both"])
@pytest.mark.parametrize("recipe_name", RECIPES)
def test_lora_with_a_stock_or_drop_in_adapter_matches_stock(recipe_name, convert):
    import torch

    reason = recipe_skip_reason(recipe_name)
    if reason:
        pytest.skip(reason)
    recipe = make_recipe(recipe_name)
    filters = {"outer_only": lambda m, fqn: fqn != "adapter", "adapter_only": lambda m, fqn: fqn == "adapter",
               "both": lambda m, fqn: True}
    stock, managed = _build(None), _build(filters[convert])
    expected, got = _train(stock, recipe), _train(managed, recipe)
    assert len(expected) == len(got)
    for i, (a, b) in enumerate(zip(expected, got)):
        assert torch.equal(a, b), f"tensor {i} of {len(got)} differs from stock"
    # Each cache holds its own weight's workspace, equal to stock's.
    for name in ("", "adapter"):
        mine, theirs = managed.get_submodule(name), stock.get_submodule(name)
        assert set(mine._fp8_workspaces) <= {"weight"}
        if "weight" in mine._fp8_workspaces and "weight" in theirs._fp8_workspaces:
            assert torch.equal(mine._fp8_workspaces["weight"].dequantize(),
                               theirs._fp8_workspaces["weight"].dequantize()), name or "outer"
