"""A TE module called inside a drop-in's forward is planned as itself (GPU).

The LoRA pattern: a subclass of ``te.Linear`` whose forward adds a second
``te.Linear`` (the adapter). Converted with the adapter left stock, it must
give exactly the numbers of an all-stock twin over steps of microbatches,
and each module's cache must hold its own weight's workspace only. Before
the fix the adapter's workspace went into the outer module's cache and the
outputs differed, silently.

Faults in nested modules: an exception inside TE's own forward, recompute
or backward of a nested module (the stock adapter, or a drop-in one level
down), with the LoRA model called plainly, under ``te.checkpoint``, or
nested two levels deep. No drop-in may stay marked active, on the calling
thread or on autograd's backward thread, and the next steps must match a
stock twin that went through the same fault.
"""

from __future__ import annotations

import pytest

from conftest import RECIPES, make_recipe, recipe_skip_reason

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning",
                                                        "ignore::FutureWarning")]
HIDDEN, TOKENS, STEPS, MICRO = 128, 64, 3, 3


def _lora_class(adapter_class=None):
    """A LoRA subclass of te.Linear whose adapter is ``adapter_class``
    (default te.Linear; a LoRA class nests one level more)."""
    import transformer_engine.pytorch as te

    class LoRALinear(te.Linear):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.adapter = (adapter_class or te.Linear)(HIDDEN, HIDDEN, bias=False,
                                                        params_dtype=kwargs["params_dtype"], device="cuda")

        def forward(self, inp, is_first_microbatch=None):
            return super().forward(inp, is_first_microbatch) + self.adapter(inp, is_first_microbatch)

    return LoRALinear


def _build(filter_fn):
    import torch

    import te_integration as ti

    torch.manual_seed(7)
    model = _lora_class()(HIDDEN, HIDDEN, params_dtype=torch.bfloat16, device="cuda")
    return ti.convert_model(model, module_filter=filter_fn) if filter_fn is not None else model


def _input(step: int, micro: int):
    import torch

    g = torch.Generator(device="cuda").manual_seed(100 * step + micro)
    return torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)


def _call(model, x, recipe, scenario: str, first: bool):
    """One forward: plainly with its microbatch position, or under
    te.checkpoint (without positions, as test_numerics' checkpoint scenarios)."""
    import transformer_engine.pytorch as te

    with te.autocast(enabled=True, recipe=recipe):
        if scenario.startswith("te_checkpoint"):
            return te.checkpoint(model, x, use_reentrant=scenario == "te_checkpoint")
        return model(x, is_first_microbatch=first)


def _train(model, recipe, scenario: str = "plain", steps: int = STEPS, first_step: int = 0,
           active: list | None = None) -> list:
    """Outputs, gradients and parameters of ``steps`` optimizer steps of
    microbatches; ``active`` collects the active drop-in that autograd's
    backward thread sees at the start and at the end of each backward."""
    import torch

    from te_integration.runtime._call import ACTIVE

    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    seen = []
    for step in range(first_step, first_step + steps):
        for micro in range(MICRO):
            x = _input(step, micro)
            out = _call(model, x, recipe, scenario, micro == 0)
            if active is not None:
                for t in (out, x):
                    t.register_hook(lambda grad: active.append(ACTIVE.module()))
            out.float().pow(2).mean().backward()
            seen += [out.detach(), x.grad]
        seen += [p.grad.clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad(set_to_none=True)
    return seen + [p.detach().clone() for p in model.parameters()]


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
    _assert_own_caches(stock, managed)


def _assert_own_caches(stock, managed) -> None:
    """Each cache holds its own weight's workspace, equal to stock's."""
    import torch

    for name, mine in managed.named_modules():
        theirs = stock.get_submodule(name)
        assert set(mine._fp8_workspaces) <= {"weight"}
        if "weight" in mine._fp8_workspaces and "weight" in theirs._fp8_workspaces:
            assert torch.equal(mine._fp8_workspaces["weight"].dequantize(),
                               theirs._fp8_workspaces["weight"].dequantize()), name or "outer"


# -- faults in nested modules ------------------------------------------------------
class InjectedFault(RuntimeError):
    """Raised inside TE's own Function of the module under test."""


#: scenario -> the phases a fault is injected in: the forward (te.checkpoint's
#: first pass), the forward te.checkpoint replays in backward, the backward.
FAULT_PHASES = {
    "plain": ("forward", "backward"),
    "two_levels": ("forward", "backward"),
    "te_checkpoint": ("forward", "recompute", "backward"),
    "te_checkpoint_nonreentrant": ("forward", "recompute", "backward"),
}
#: Which module fails: the innermost, stock module, or the deepest drop-in
#: (the outer module; in two_levels, the drop-in adapter between the two).
TARGETS = ("stock", "drop_in")
FAULT_CASES = [(s, t, p) for s, phases in FAULT_PHASES.items() for t in TARGETS for p in phases]


def _nested_model(scenario: str, managed: bool, target: str):
    """(model, the module the fault hits): a LoRA Linear, or for two_levels
    a LoRA whose adapter is a LoRA; converted except its innermost adapter."""
    import torch

    import te_integration as ti

    levels = 2 if scenario == "two_levels" else 1
    cls = _lora_class(_lora_class() if levels == 2 else None)
    torch.manual_seed(7)
    model = cls(HIDDEN, HIDDEN, params_dtype=torch.bfloat16, device="cuda")
    innermost = ".".join(["adapter"] * levels)
    if managed:
        ti.convert_model(model, module_filter=lambda m, fqn: fqn != innermost)
    deepest_drop_in = ".".join(["adapter"] * (levels - 1))
    return model, model.get_submodule(innermost if target == "stock" else deepest_drop_in)


def _inject(monkeypatch, weights: tuple, phase: str) -> None:
    """Make TE's own ``_Linear`` raise in ``phase`` for calls on ``weights``
    (TE's class: the binding's seam and stock calls both run its code)."""
    from transformer_engine.pytorch.distributed import in_fp8_activation_recompute_phase

    from te_integration.te import _compat

    te_function = _compat.LinearFunction
    te_forward, te_backward = te_function.forward, te_function.backward

    def forward(ctx, weight, *args):
        if any(weight is w for w in weights):
            if phase == ("recompute" if in_fp8_activation_recompute_phase() else "forward"):
                raise InjectedFault(f"{phase} of a nested module")
            if ctx is not None:
                ctx.te_wm_test_target = True  # the backward of this call fails
        return te_forward(ctx, weight, *args)

    def backward(ctx, *grads):
        if phase == "backward" and getattr(ctx, "te_wm_test_target", False):
            raise InjectedFault("backward of a nested module")
        return te_backward(ctx, *grads)

    monkeypatch.setattr(te_function, "forward", staticmethod(forward))
    monkeypatch.setattr(te_function, "backward", staticmethod(backward))


def _failing_step(model, recipe, scenario: str) -> None:
    from te_integration.runtime._call import ACTIVE

    x = _input(99, 0)
    with pytest.raises(InjectedFault):
        _call(model, x, recipe, scenario, True).float().pow(2).mean().backward()
    assert ACTIVE.module() is None
    for p in model.parameters():
        p.grad = None  # the failed step's partial gradients are discarded, in both twins


@pytest.mark.parametrize("scenario,target,phase", FAULT_CASES)
def test_a_fault_in_a_nested_module_leaves_nothing_active_and_the_next_steps_match_stock(
        monkeypatch, scenario, target, phase):
    """A clean step, then a step whose ``target`` module raises in ``phase``
    (the stock twin fails the same way, so TE's own state after a failure,
    e.g. te.checkpoint's, is the same on both sides), then two clean steps:
    bit-exact with the stock twin, with no drop-in active on either thread."""
    import torch

    reason = recipe_skip_reason("Float8CurrentScaling")
    if reason:
        pytest.skip(reason)
    recipe = make_recipe("Float8CurrentScaling")
    (stock, stock_target), (managed, managed_target) = (_nested_model(scenario, m, target) for m in (False, True))
    expected, got = _train(stock, recipe, scenario, steps=1), _train(managed, recipe, scenario, steps=1)
    _inject(monkeypatch, (stock_target.weight, managed_target.weight), phase)
    _failing_step(stock, recipe, scenario)
    _failing_step(managed, recipe, scenario)
    monkeypatch.undo()
    active: list = []
    expected += _train(stock, recipe, scenario, steps=2, first_step=1)
    got += _train(managed, recipe, scenario, steps=2, first_step=1, active=active)
    # Two hooks per backward (at its start and its end), one backward per microbatch.
    assert len(active) == 2 * 2 * MICRO and all(a is None for a in active), active
    assert len(expected) == len(got)
    for i, (a, b) in enumerate(zip(expected, got)):
        assert torch.equal(a, b), f"tensor {i} of {len(got)} differs from stock (the fault came after step 1)"
    _assert_own_caches(stock, managed)
