"""Two drop-in models in one process, on the GPU: another model's optimizer
step costs a model nothing (docs/decisions.md, D12).

Model A and model B, each 4 x ``Linear(1024, 1024)`` with its own optimizer.
A step (or microbatch) of A is profiled twice: straight after A's own
previous step, and with B stepping in between. It must launch the same
kernels (no transpose or workspace made again for weights that did not
change), compute the same numbers bit for bit, and ``stale_workspaces(A)``
must find nothing after B's steps.

* FP8 parameters (``quantized_model_init``, DelayedScaling) with TE's
  ``FusedAdam(master_weights=True)``: the optimizer writes A's FP8 data
  through raw pointers, so only the step hook can tell which transposes
  are old.
* bf16 parameters with ``torch.optim.AdamW`` and cached microbatches
  (``is_first_microbatch``): A's cache is filled by its first microbatch;
  its second must reuse it, whatever B did.
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning",
                                                        "ignore::FutureWarning")]

WIDTH, LAYERS, TOKENS = 1024, 4, 2048


def _model(recipe, quantized: bool):
    import contextlib

    import torch
    import transformer_engine.pytorch as te

    import te_integration as ti

    torch.manual_seed(0)
    init = te.quantized_model_init(enabled=True, recipe=recipe) if quantized else contextlib.nullcontext()
    with init:
        layers = [te.Linear(WIDTH, WIDTH, params_dtype=torch.bfloat16, device="cuda") for _ in range(LAYERS)]
    return ti.convert_model(torch.nn.Sequential(*layers))


def _optimizer(model, quantized: bool):
    import torch
    import transformer_engine.pytorch as te

    if quantized:
        return te.optimizers.FusedAdam(list(model.parameters()), lr=1e-3, master_weights=True,
                                       master_weight_dtype=torch.float32)
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def _x(seed: int):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(TOKENS, WIDTH, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)


def _pass(model, recipe, seed: int, first: bool | None = None) -> list:
    """Forward and backward of ``model``: the output and input gradient."""
    import transformer_engine.pytorch as te

    x = _x(seed)
    with te.autocast(enabled=True, recipe=recipe):
        out = x
        for layer in model:
            out = layer(out) if first is None else layer(out, is_first_microbatch=first)
    out.float().square().mean().backward()
    return [out.detach().clone(), x.grad.clone()]


def _kernels(run) -> tuple[int, object]:
    """How many GPU kernels ``run()`` launches, and what it returns."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = run()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not getattr(e, "is_user_annotation", False)]
    return len(kernels), out


def _fp8_step(model, opt, recipe, seed: int) -> list:
    got = _pass(model, recipe, seed)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return got


def _same(a: list, b: list) -> bool:
    import torch

    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_another_models_fusedadam_steps_cost_an_fp8_parameter_model_nothing():
    import te_integration as ti
    from testbed.recipes import make_recipe, recipe_skip_reason

    reason = recipe_skip_reason("DelayedScaling")
    if reason:
        pytest.skip(reason)
    recipe = make_recipe("DelayedScaling")
    runs = {}
    for between in (False, True):
        a, b = _model(recipe, True), _model(recipe, True)
        a_opt, b_opt = _optimizer(a, True), _optimizer(b, True)
        for seed in range(2):  # A's own step comes last: nothing has stepped since, unless B does now
            _fp8_step(b, b_opt, recipe, 100 + seed)
            _fp8_step(a, a_opt, recipe, seed)
        if between:
            for seed in range(3):
                _fp8_step(b, b_opt, recipe, 200 + seed)
            assert ti.stale_workspaces(a) == []
        runs[between] = _kernels(lambda: _fp8_step(a, a_opt, recipe, 7))
    (alone, got_alone), (interleaved, got_interleaved) = runs[False], runs[True]
    assert interleaved == alone, f"A's step launched {interleaved} kernels after B's steps, {alone} without"
    assert _same(got_alone, got_interleaved)


@pytest.mark.parametrize("recipe_name", ["DelayedScaling", "Float8CurrentScaling"])
def test_another_models_adamw_steps_leave_a_models_microbatch_cache_in_use(recipe_name):
    import te_integration as ti
    from testbed.recipes import make_recipe, recipe_skip_reason

    reason = recipe_skip_reason(recipe_name)
    if reason:
        pytest.skip(reason)
    recipe = make_recipe(recipe_name)
    runs = {}
    for between in (False, True):
        a, b = _model(recipe, False), _model(recipe, False)
        b_opt = _optimizer(b, False)
        _pass(b, recipe, 100)
        _pass(a, recipe, 0, first=True)  # fills A's caches
        if between:
            for _ in range(3):
                b_opt.step()
            assert ti.stale_workspaces(a) == []
        runs[between] = _kernels(lambda: _pass(a, recipe, 1, first=False))
    (alone, got_alone), (interleaved, got_interleaved) = runs[False], runs[True]
    assert interleaved == alone, f"A's later microbatch launched {interleaved} kernels after B's steps, {alone} without"
    assert _same(got_alone, got_interleaved)
