"""Bad input and faults on one GPU: clear errors early, nothing left half-changed."""

from __future__ import annotations

import pytest

from conftest import make_recipe, recipe_skip_reason

# TE and torch.distributed warn freely (deprecations, experimental features); the
# GPU tier checks numbers, not their warnings.
pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning",
                                                        "ignore::FutureWarning")]

RECIPE = "Float8CurrentScaling"


@pytest.fixture
def recipe():
    reason = recipe_skip_reason(RECIPE)
    if reason:
        pytest.skip(reason)
    return make_recipe(RECIPE)


def _pair(cls_name="Linear"):
    import torch
    import transformer_engine.pytorch as te

    import te_integration as ti

    torch.manual_seed(7)
    stock = getattr(te, cls_name)(64, 64, params_dtype=torch.bfloat16, device="cuda")
    torch.manual_seed(7)
    managed = getattr(ti, cls_name)(64, 64, params_dtype=torch.bfloat16, device="cuda")
    return stock, managed


def _step(module, recipe, seed=3, **kw):
    import torch
    import transformer_engine.pytorch as te

    torch.manual_seed(seed)
    x = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with te.autocast(enabled=True, recipe=recipe):
        out = module(x, **kw)
    out.float().square().sum().backward()
    return out.detach(), x.grad.detach(), module.weight.grad.detach().clone()


def test_unregistered_quantizer_fails_at_first_forward_with_the_registry_message(recipe, monkeypatch):
    from workspace_manager import UnknownQuantizerError, default_registry

    _, managed = _pair()
    monkeypatch.setattr(default_registry, "_entries", {})
    with pytest.raises(UnknownQuantizerError, match="Float8CurrentScalingQuantizer.*register_quantizer"):
        _step(managed, recipe)


def test_fsdp2_policy_pinned_on_an_unsharded_module_fails_clearly(recipe):
    import te_integration as ti
    from workspace_manager import FSDP2WorkspacePolicy, PolicyMismatchError

    _, managed = _pair()
    ti.set_workspace_policy(managed, FSDP2WorkspacePolicy())
    with pytest.raises(PolicyMismatchError, match="fully_shard"):
        _step(managed, recipe)


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_an_exception_inside_a_drop_in_leaves_everything_as_it_was(recipe, monkeypatch, where):
    import transformer_engine.pytorch.module.linear as linear_module
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    import te_integration._state as state_module

    stock, managed = _pair()
    _step(stock, recipe, is_first_microbatch=True)
    _step(managed, recipe, is_first_microbatch=True)  # installs the seams, fills the cache
    seams = (linear_module.quantize_weight, linear_module._Linear)
    cache = dict(managed._fp8_workspaces)

    class Injected(RuntimeError):
        pass

    def boom(*args, **kwargs):
        raise Injected(where)

    if where == "forward":
        monkeypatch.setattr(state_module.ModuleWorkspaceState, "levers", boom)
    else:  # inside TE's own backward, under the seam's try/finally
        monkeypatch.setattr(linear_module._Linear.__mro__[1], "backward", staticmethod(boom))
    with pytest.raises(Injected):
        _step(managed, recipe, is_first_microbatch=False)
    monkeypatch.undo()
    assert (linear_module.quantize_weight, linear_module._Linear) == seams
    assert managed._fp8_workspaces.keys() == cache.keys()
    assert all(managed._fp8_workspaces[k] is v for k, v in cache.items())
    assert not FP8GlobalStateManager.is_fp8_enabled()
    for m in (stock, managed):
        m.weight.grad = None
    import torch

    for a, b in zip(_step(stock, recipe, seed=11), _step(managed, recipe, seed=11)):
        assert torch.equal(a, b)
