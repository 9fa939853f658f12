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
    from workspace_manager import UnknownQuantizerError
    from workspace_manager.extending import default_registry

    _, managed = _pair()
    monkeypatch.setattr(default_registry, "_entries", {})
    # As unregister() does: forget the per-class lookups and start a new
    # generation, so that what an earlier test looked up is not served again.
    monkeypatch.setattr(default_registry, "_by_class", {})
    monkeypatch.setattr(default_registry, "generation", default_registry.generation + 1)
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

    import te_integration.runtime._state as state_module

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


# -- an exception inside TE's own backward, for each module kind -------------------
KINDS = ["Linear", "LayerNormLinear", "LayerNormMLP"]


def _expected_release(quantized: bool, sharding: str):
    """What every weight's plan releases after backward in each setup, so
    that each case tests a release that is really planned (or none)."""
    from workspace_manager import Release

    if sharding == "whole":
        return Release.NOTHING  # whole weights keep their cache from step to step
    # FSDP2_KEEP, with the microbatch cache option pinned (_backward_faults.CACHE_OPTION).
    return Release.DERIVED_COLUMNWISE if quantized else Release.CACHED_WORKSPACE


def _assert_released_as_planned(report) -> None:
    from workspace_manager import Release

    released = {key for key, release in report.releases.items() if Release.CACHED_WORKSPACE in release}
    assert report.entries_unchanged, "the failed backward replaced a cache entry"
    assert released <= report.cached_before, "the microbatches did not fill the cache the plan releases"
    # The failed backward was the step's first: only it can have marked entries.
    assert report.dropped == len(released), (report.dropped, released)
    assert report.cached_after == report.cached_before - released
    for key, release in report.releases.items():
        if Release.DERIVED_COLUMNWISE in release:
            assert report.columnwise_before[key], f"{key} held no columnwise data before backward"
            assert not report.columnwise_after[key], f"{key}'s derived columnwise data outlived the failed backward"
        else:
            assert report.columnwise_after[key] == report.columnwise_before[key], key


@pytest.mark.parametrize("at", [1, 2], ids=["first_gemm", "second_gemm"])
@pytest.mark.parametrize("sharding", ["whole", "fsdp2_keep"])
@pytest.mark.parametrize("quantized", [False, True], ids=["bf16_params", "quantized_init"])
@pytest.mark.parametrize("kind", KINDS)
def test_an_exception_in_tes_backward_releases_as_planned_and_leaves_nothing(recipe, kind, quantized, sharding, at):
    """GEMM ``at`` of TE's backward raises, after two microbatches filled and
    read the cache. The plan's release still runs; the next step is bit-exact
    with a twin that ran the same steps without the fault, and allocates as
    much.

    Fair memory figures: each run is measured alone (the one before it
    deleted and collected) and counts only what it allocated above its own
    start, with its clean step's results alive in both. A first, discarded
    run lets TE allocate what it keeps for the process on first use (cuBLAS
    workspaces, say), which would otherwise count against whichever run came
    first. A difference can then come only from what the fault left alive
    that the clean step neither replaced nor released, such as a tensor of
    the failed step kept by the binding (``after_step``), or from anything
    held beyond the module's deletion (``leftover``). The release itself is
    checked right after the fault, before the clean step (``report``)."""
    import torch
    from _backward_faults import WEIGHT_KEYS, Setup, run

    from workspace_manager import Sharding

    setup = Setup(kind, quantized, Sharding.FSDP2_KEEP if sharding == "fsdp2_keep" else Sharding.NONE)
    run(setup, recipe, None)
    faulted, twin = run(setup, recipe, at), run(setup, recipe, None)
    report = faulted.report
    assert report.raised and not twin.report.raised
    assert report.releases == dict.fromkeys(WEIGHT_KEYS[kind], _expected_release(quantized, sharding))
    _assert_released_as_planned(report)
    assert (report.cached_after, report.columnwise_after) == (twin.report.cached_after, twin.report.columnwise_after)
    assert report.active_after is None and not report.fp8_enabled_after
    assert len(faulted.results) == len(twin.results)
    for i, (a, b) in enumerate(zip(faulted.results, twin.results)):
        assert (a is None and b is None) or torch.equal(a, b), f"result {i} of the next step differs from the twin's"
    assert faulted.after_step == twin.after_step, (faulted.after_step, twin.after_step)
    assert faulted.leftover == twin.leftover, (faulted.leftover, twin.leftover)
