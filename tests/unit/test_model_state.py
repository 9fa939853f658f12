"""One model, one workspace state: an optimizer step touches only the weights it wrote.

Two drop-in models in one process, each with its own optimizer, on the CPU
stand-in TE (``_fake_te``). Model B's steps must cost model A nothing: no
transpose made again, no cached workspace quantized again, no pending cache
release dropped, no stale report, no recording point; A's outputs stay
bit-exact with a run in which B never stepped; and A's own step still
makes A's next read fresh (docs/decisions.md, D12).
"""

from __future__ import annotations

import importlib
import sys
from types import SimpleNamespace

import pytest
import torch
from _fake_te import Float8CurrentScalingQuantizer, TELinear, Workspace, _round, load_full_binding

from workspace_manager import FSDP2WorkspacePolicy, MicrobatchCache, Release, Sharding

from test_binding_freshness import SilentFP8Writer, _quantized_weight, _with_weight


@pytest.fixture
def ti(monkeypatch):
    binding = load_full_binding(monkeypatch)
    binding.stale = importlib.import_module("te_integration.runtime._stale")
    binding.freshness = sys.modules["te_integration.runtime._freshness"]
    return binding


@pytest.fixture
def counted(monkeypatch):
    """Counts of the stand-in's quantizations (new workspaces and in-place
    refreshes) and of the transposes it makes from rowwise data."""
    counts = SimpleNamespace(quantize=0, refresh=0, transpose=0)
    quantize, refresh = Float8CurrentScalingQuantizer.quantize, Float8CurrentScalingQuantizer.update_quantized
    update_usage = Workspace.update_usage

    def counting_quantize(self, tensor, *, dtype=None):
        counts.quantize += not hasattr(tensor, "_transpose_invalid")
        return quantize(self, tensor, dtype=dtype)

    def counting_refresh(self, tensor, workspace):
        counts.refresh += 1
        return refresh(self, tensor, workspace)

    def counting_update_usage(self, rowwise_usage=None, columnwise_usage=None):
        counts.transpose += bool(columnwise_usage) and not self.get_usages()["columnwise"]
        return update_usage(self, rowwise_usage, columnwise_usage)

    monkeypatch.setattr(Float8CurrentScalingQuantizer, "quantize", counting_quantize)
    monkeypatch.setattr(Float8CurrentScalingQuantizer, "update_quantized", counting_refresh)
    monkeypatch.setattr(Workspace, "update_usage", counting_update_usage)
    return counts


def _fp8_model(ti, seed: int):
    """A drop-in model of two Linears with quantized (FP8) parameters and its
    FusedAdam stand-in."""
    gen = torch.Generator().manual_seed(seed)
    layers = [_with_weight(TELinear(8, 8), _quantized_weight(torch.randn(8, 8, generator=gen))) for _ in range(2)]
    model = ti.modules.convert_model(torch.nn.Sequential(*layers))
    return model, SilentFP8Writer([layer.weight for layer in model])


def _input_grad(model) -> torch.Tensor:
    x = torch.ones(4, 8, requires_grad=True)
    model(x).sum().backward()
    return x.grad


def test_a_foreign_fp8_step_remakes_no_transpose_of_another_model(ti, counted):
    a, a_opt = _fp8_model(ti, seed=1)
    b, b_opt = _fp8_model(ti, seed=2)
    _input_grad(a)
    _input_grad(b)
    made = counted.transpose
    for _ in range(3):  # B trains; A only watches
        for layer in b:
            b_opt.writes[id(layer.weight)] = torch.randn(8, 8)
        b_opt.step()
        _input_grad(b)
    b_transposes = counted.transpose - made
    made = counted.transpose
    before = [layer.weight._transpose for layer in a]
    grad = _input_grad(a)
    assert counted.transpose == made  # A's next step reads the transposes it had
    assert [layer.weight._transpose for layer in a] == before and not any(w._transpose_invalid
                                                                         for w in (l.weight for l in a))
    assert b_transposes == 3 * 2  # B's own steps remade each of its two transposes (D12)
    # Bit-exact with a run in which B never stepped.
    alone, _ = _fp8_model(ti, seed=1)
    _input_grad(alone)
    assert torch.equal(grad, _input_grad(alone))
    assert ti.stale.stale_workspaces(a) == []


def test_a_models_own_fp8_step_still_makes_its_next_read_fresh(ti, counted):
    a, a_opt = _fp8_model(ti, seed=1)
    _, b_opt = _fp8_model(ti, seed=2)
    _input_grad(a)
    new = [torch.randn(8, 8, generator=torch.Generator().manual_seed(10 + i)) for i in range(2)]
    for layer, weight in zip(a, new):
        a_opt.writes[id(layer.weight)] = weight
    a_opt.step()
    b_opt.step()  # a foreign step after A's own changes nothing of it
    reference = torch.ones(4, 8) @ _round(new[1]) @ _round(new[0])
    assert torch.equal(_input_grad(a), reference)


def _bf16_model(seed: int):
    return torch.nn.Sequential(TELinear(8, 8, seed=seed), TELinear(8, 8, seed=seed + 1))


def _microbatch(model, x, first: bool) -> torch.Tensor:
    out = model[1](model[0](x, is_first_microbatch=first), is_first_microbatch=first)
    out.sum().backward()
    return out


def _with_grads(model) -> torch.optim.Optimizer:
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    _microbatch(model, torch.randn(4, 8), None)
    return optimizer


def test_a_foreign_adamw_step_requantizes_no_cached_workspace_and_reports_none_stale(ti, counted):
    a = ti.modules.convert_model(_bf16_model(seed=3))
    b = ti.modules.convert_model(_bf16_model(seed=5))
    b_opt = _with_grads(b)
    x = torch.randn(4, 8)
    _microbatch(a, x, True)  # A's first microbatch fills its caches
    entries = [layer._fp8_workspaces["weight"] for layer in a]
    quantized, refreshed = counted.quantize, counted.refresh
    for _ in range(2):
        b_opt.step()
    assert ti.stale.stale_workspaces(a) == []
    out = _microbatch(a, x, False)
    assert (counted.quantize, counted.refresh) == (quantized, refreshed)  # A quantized nothing again
    assert [layer._fp8_workspaces["weight"] for layer in a] == entries
    alone = ti.modules.convert_model(_bf16_model(seed=3))
    _microbatch(alone, x, True)
    assert torch.equal(out, _microbatch(alone, x, False))


def test_a_models_own_step_refreshes_its_cache_where_no_version_moved(ti):
    a = ti.modules.convert_model(_bf16_model(seed=3))
    b = ti.modules.convert_model(_bf16_model(seed=5))
    x = torch.randn(4, 8)
    _microbatch(a, x, True)
    with torch.no_grad():  # writes the version counters do not see (as an FP8 optimizer's raw kernels)
        for layer in a:
            layer.weight.data.add_(0.5)
            layer.weight.grad = None
    torch.optim.SGD(b.parameters(), lr=0.1).step()
    assert ti.stale.stale_workspaces(a) == []  # nothing told the binding yet: B's step is not A's
    torch.optim.SGD(a.parameters(), lr=0.1).step()  # no gradients: writes nothing itself, but holds A's weights
    stale = ti.stale.stale_workspaces(a)
    assert {(s.module, s.kind) for s in stale} == {("0", ti.stale.StaleKind.CACHE_OLDER_THAN_WEIGHT),
                                                 ("1", ti.stale.StaleKind.CACHE_OLDER_THAN_WEIGHT)}
    assert torch.equal(a[0](x, is_first_microbatch=False), x @ _round(a[0].weight).t())


def test_release_workspaces_of_one_model_leaves_another_models_copies_current(ti, counted):
    a = ti.modules.convert_model(_bf16_model(seed=3))
    b = ti.modules.convert_model(_bf16_model(seed=5))
    x = torch.randn(4, 8)
    _microbatch(a, x, True)
    _microbatch(b, x, True)
    assert ti.stale.release_workspaces(b) > 0
    refreshed = counted.refresh
    _microbatch(a, x, False)
    assert counted.refresh == refreshed and ti.stale.stale_workspaces(a) == []
    assert [layer._wm_state.writes for layer in a] == [0, 0] and [layer._wm_state.writes for layer in b] == [1, 1]


def _microbatch_cached(ti, seed: int):
    """A drop-in planned with FSDP2's microbatch cache (described as FSDP2 with
    reshard_after_forward=False, no process group): each backward marks its
    cache entry for release at the model's next optimizer step."""
    keep = Sharding.FSDP2_KEEP
    probe = SimpleNamespace(is_fsdp2=False, read=lambda: keep, current=lambda: keep, stale=lambda: False)
    module = ti.modules.convert_model(TELinear(8, 8, seed=seed))
    option = FSDP2WorkspacePolicy(microbatch_cache=MicrobatchCache.EXACT_FORMATS)
    module.__dict__["_wm_state"] = ti.state.ModuleWorkspaceState(module._wm_kind, option, probe=probe)
    return module


def test_a_foreign_step_keeps_another_models_pending_cache_releases(ti):
    a, b = _microbatch_cached(ti, seed=8), _microbatch_cached(ti, seed=9)
    x = torch.randn(4, 8, requires_grad=True)
    for module in (a, b):
        module(x, is_first_microbatch=True).sum().backward()
        module(x, is_first_microbatch=False).sum().backward()
    assert Release.CACHED_WORKSPACE in ti.modules.last_plans(a)["weight"][1].release
    torch.optim.SGD(b.parameters(), lr=0.1).step()
    assert "weight" in a._fp8_workspaces and b._fp8_workspaces == {}
    torch.optim.SGD(a.parameters(), lr=0.1).step()
    assert a._fp8_workspaces == {}


def test_release_step_caches_acts_on_the_model_given(ti):
    a, b = _microbatch_cached(ti, seed=8), _microbatch_cached(ti, seed=9)
    x = torch.randn(4, 8, requires_grad=True)
    for module in (a, b):
        module(x, is_first_microbatch=True).sum().backward()
    assert ti.model.release_step_caches(a) == 1
    assert a._fp8_workspaces == {} and "weight" in b._fp8_workspaces
    assert ti.model.release_step_caches() == 1 and b._fp8_workspaces == {}
    with pytest.raises(TypeError, match="release_step_caches: model must be a torch.nn.Module or None"):
        ti.model.release_step_caches("a")


def test_a_recording_takes_a_step_point_only_at_its_models_steps(ti):
    a = ti.modules.convert_model(_bf16_model(seed=3))
    b = ti.modules.convert_model(_bf16_model(seed=5))
    a_opt, b_opt = _with_grads(a), _with_grads(b)
    with ti.attribution.record_workspaces(a) as rec_a, ti.attribution.record_workspaces(b) as rec_b:
        b_opt.step()
        b_opt.step()
        a_opt.step()
    steps = [[p.label for p in rec.timeline if p.phase == "step"] for rec in (rec_a, rec_b)]
    assert steps == [["optimizer step"], ["optimizer step", "optimizer step"]]
    with ti.attribution.record_workspaces(a):
        with pytest.raises(RuntimeError, match="already active over 1 of this model's TE modules"):
            with ti.attribution.record_workspaces(torch.nn.Sequential(a[0])):
                pass


def test_an_optimizer_whose_parameters_cannot_be_listed_ages_every_model(ti):
    a = ti.modules.convert_model(_bf16_model(seed=3))
    b = ti.modules.convert_model(_bf16_model(seed=5))
    x = torch.randn(4, 8)
    _microbatch(a, x, True)
    _microbatch(b, x, True)
    # What torch's post-step hook is handed by an optimizer that keeps no param_groups list.
    ti.step_hook._after_optimizer_step(SimpleNamespace(param_groups=None), (), {})
    assert [layer._wm_state.writes for model in (a, b) for layer in model] == [1, 1, 1, 1]
    assert len(ti.stale.stale_workspaces(a)) == 2 and len(ti.stale.stale_workspaces(b)) == 2
    step = ti.step_hook.Step.of(SimpleNamespace())
    assert step.everything and "lists no param_groups" in step.why


def test_each_drop_in_belongs_to_the_model_it_was_converted_with(ti):
    inner = ti.modules.convert_model(TELinear(8, 8))
    a = ti.modules.convert_model(torch.nn.Sequential(TELinear(8, 8), inner))
    model = ti.model.model_for_root(a)
    assert {id(m) for m in model.members()} == {id(a[0]), id(inner)}
    assert inner._wm_state.model is model and model.root is a
    alone = ti.modules.convert_model(TELinear(8, 8))
    assert alone._wm_state.model is not model and alone._wm_state.model.root is alone


def test_a_copied_drop_in_joins_a_model_at_its_first_call(ti):
    import copy

    module = ti.modules.convert_model(TELinear(8, 8))
    module(torch.randn(4, 8))
    twin = copy.deepcopy(module)
    assert twin._wm_state.model is None  # a copy keeps its pinned policy only
    twin(torch.randn(4, 8))
    assert twin._wm_state.model is not None and twin._wm_state.model is not module._wm_state.model
    assert any(m is twin for m in twin._wm_state.model.members())
