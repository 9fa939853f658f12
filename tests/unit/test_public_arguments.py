"""te_integration's public functions on CPU, with a stand-in for TE: bad
arguments get an error naming the function and the argument, a refused
call changes nothing, converting is idempotent, and managed_construction
is held by one thread at a time."""

from __future__ import annotations

import threading
import types

import pytest
import torch
from _binding_standin import load_binding
from _fake_te_grouped import compat_entries as grouped_compat_entries

from workspace_manager import FSDP2WorkspacePolicy, PolicyMismatchError, WorkspacePolicy


class TELinear(torch.nn.Module):
    """Stands for te.Linear."""


class TELayerNormLinear(torch.nn.Module):
    """Stands for te.LayerNormLinear."""


class TELayerNormMLP(torch.nn.Module):
    """Stands for te.LayerNormMLP."""


def _fn(ctx, *args):
    return None


@pytest.fixture
def ti(monkeypatch):
    """The binding's public functions, loaded against the stand-in."""
    mha = types.ModuleType("transformer_engine.pytorch.attention.multi_head_attention")
    mha.Linear, mha.LayerNormLinear = TELinear, TELayerNormLinear
    transformer = types.ModuleType("transformer_engine.pytorch.transformer")
    transformer.LayerNormMLP = TELayerNormMLP
    function = {"forward": staticmethod(_fn), "backward": staticmethod(_fn), "_forward": staticmethod(_fn)}
    compat = {
        **grouped_compat_entries(),
        "TELinear": TELinear, "TELayerNormLinear": TELayerNormLinear, "TELayerNormMLP": TELayerNormMLP,
        "TEBaseModule": torch.nn.Module, "QuantizedTensorStorage": type("_Storage", (), {}),
        "LinearFunction": type("_Linear", (), dict(function)), "LNLFunction": type("_LNL", (), dict(function)),
        "LNMLPFunction": type("_LNMLP", (), dict(function)),
        "no_torch_dynamo": lambda *a, **k: (lambda fn: fn), "mha_module": mha, "transformer_module": transformer,
        "LNL_ARGS": {}, "LNMLP_ARGS": {}, "linear_module": types.ModuleType("te.linear"),
        "lnl_module": types.ModuleType("te.layernorm_linear"), "lnmlp_module": types.ModuleType("te.layernorm_mlp"),
    }
    names = ("runtime._argument_checks", "runtime._step_hook", "runtime._attribution", "runtime._state",
             "runtime._foreign_patches", "runtime._install", "runtime._shards", "runtime._modules",
             "runtime._construction", "kinds")
    loaded = load_binding(monkeypatch, compat, *names)
    ns = types.SimpleNamespace(**{n: getattr(loaded[m], n) for m in ("runtime._modules", "kinds")
                                  for n in loaded[m].__all__})
    ns.managed_construction = loaded["runtime._construction"].managed_construction
    ns.workspace_report = loaded["runtime._attribution"].workspace_report
    ns.record_workspaces = loaded["runtime._attribution"].record_workspaces
    ns.mha, ns.transformer = mha, transformer
    return ns


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(TELinear(), torch.nn.Sequential(TELayerNormLinear(), TELayerNormMLP()),
                               torch.nn.ReLU())


def _classes(model: torch.nn.Module) -> list[type]:
    return [type(m) for m in model.modules()]


# -- convert_model -------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(model=3), r"convert_model: model must be a torch.nn.Module; received int"),
        (dict(module_filter="all"), r"convert_model: module_filter must be callable or None; received str"),
        (dict(policy="fsdp2"), r"convert_model: policy must be a Policy .* received str"),
        (dict(policy=FSDP2WorkspacePolicy), r"received the class FSDP2WorkspacePolicy\. Pass an instance: "
                                            r"FSDP2WorkspacePolicy\(\)"),
    ],
    ids=["model", "module_filter", "policy", "policy_class"],
)
def test_convert_model_names_the_bad_argument_and_changes_nothing(ti, kwargs, message):
    model = _model()
    before = _classes(model)
    args = {"model": model, **kwargs}
    with pytest.raises(TypeError, match=message):
        ti.convert_model(args.pop("model"), **args)
    assert _classes(model) == before


def test_convert_model_refuses_an_fsdp2_wrapped_module_before_converting_any(ti):
    from torch.distributed.fsdp import FSDPModule

    # fully_shard swaps the class to FSDP<name>(FSDPModule, <name>); done here
    # without a process group.
    wrapped = TELayerNormLinear()
    wrapped.__class__ = type("FSDPTELayerNormLinear", (FSDPModule, TELayerNormLinear), {})
    model = torch.nn.Sequential(TELinear(), wrapped, TELayerNormMLP())
    before = _classes(model)
    with pytest.raises(PolicyMismatchError, match=r"convert_model: 1 \(FSDPTELayerNormLinear\).*Nothing was"):
        ti.convert_model(model, policy=WorkspacePolicy())
    assert _classes(model) == before
    assert all(m.__dict__.get("workspace_policy") is None for m in model.modules())


def test_a_module_filter_that_raises_leaves_the_model_as_it_was(ti):
    model = _model()
    before = _classes(model)

    def choose(module, fqn):
        if isinstance(module, TELayerNormMLP):
            raise KeyError("the user's filter failed")
        return True

    with pytest.raises(KeyError):
        ti.convert_model(model, module_filter=choose)
    assert _classes(model) == before  # the Linear before it was not converted either


def test_convert_model_is_idempotent_and_pins_a_later_policy(ti):
    model = _model()
    assert ti.convert_model(model) is model
    once = _classes(model)
    assert [c.__name__ for c in once[1:5] if c is not torch.nn.Sequential] == ["Linear", "LayerNormLinear",
                                                                                 "LayerNormMLP"]
    ti.convert_model(model)
    assert _classes(model) == once
    policy = WorkspacePolicy()
    ti.convert_model(model, policy=policy, module_filter=lambda m, fqn: fqn != "0")
    assert _classes(model) == once
    assert model[0].workspace_policy is None
    assert model[1][0].workspace_policy is policy and model[1][1].workspace_policy is policy


def test_convert_model_without_te_modules_is_a_no_op(ti):
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    before = _classes(model)
    assert ti.convert_model(model) is model
    assert _classes(model) == before


# -- set_workspace_policy, last_plans, workspace_report, record_workspaces ----------------
def test_set_workspace_policy_names_the_bad_argument(ti):
    with pytest.raises(TypeError, match=r"set_workspace_policy: module must be a torch.nn.Module; received str"):
        ti.set_workspace_policy("layer", WorkspacePolicy())
    with pytest.raises(TypeError, match=r"set_workspace_policy: module must be a te_integration drop-in .*"
                                        r"TELinear is not one\. Convert it first"):
        ti.set_workspace_policy(TELinear(), WorkspacePolicy())
    managed = ti.Linear()
    pinned = WorkspacePolicy()
    ti.set_workspace_policy(managed, pinned)
    with pytest.raises(TypeError, match=r"set_workspace_policy: policy must be a Policy"):
        ti.set_workspace_policy(managed, {"cache": True})
    assert managed.workspace_policy is pinned  # the refused call left the pinned policy
    with pytest.raises(TypeError, match=r"set_workspace_policy: policy must be a Policy instance"):
        ti.set_workspace_policy(managed, WorkspacePolicy)  # the class, not an instance
    assert managed.workspace_policy is pinned
    ti.set_workspace_policy(managed, None)
    assert managed.workspace_policy is None


def test_last_plans_takes_te_modules_only(ti):
    with pytest.raises(TypeError, match=r"last_plans: module must be a torch.nn.Module; received int"):
        ti.last_plans(3)
    with pytest.raises(TypeError, match=r"last_plans: module must be a TE module .*received Sequential"):
        ti.last_plans(_model())
    assert ti.last_plans(TELinear()) == {}  # stock: documented, no plans
    assert ti.last_plans(ti.LayerNormMLP()) == {}  # a drop-in before its first call


def test_attribution_functions_name_the_bad_argument_at_the_call(ti):
    with pytest.raises(TypeError, match=r"workspace_report: model must be a torch.nn.Module; received list"):
        ti.workspace_report([TELinear()])
    with pytest.raises(TypeError, match=r"record_workspaces: model must be a torch.nn.Module"):
        ti.record_workspaces(None)  # at the call, not only when the block is entered
    with pytest.raises(TypeError, match=r"record_workspaces: timeline must be True or False; received str"):
        ti.record_workspaces(_model(), timeline="yes")
    report = ti.workspace_report(torch.nn.Sequential(torch.nn.ReLU()))
    assert report.entries == () and report.total_bytes == 0
    # A model without TE modules records nothing (documented), and the block still closes.
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with ti.record_workspaces(plain) as recording:
        plain(torch.randn(2, 4)).sum().backward()
    assert len(recording.modules) == 0
    assert recording.report().total_bytes == 0 and recording.report().entries == ()
    assert ti.workspace_report(plain).total_bytes == 0


# -- managed_construction --------------------------------------------------------------
def _bound(ti) -> tuple:
    return ti.mha.Linear, ti.mha.LayerNormLinear, ti.transformer.LayerNormMLP


def test_managed_construction_nests_in_one_thread(ti):
    stock, drop_ins = _bound(ti), (ti.Linear, ti.LayerNormLinear, ti.LayerNormMLP)
    with ti.managed_construction():
        with pytest.raises(ValueError):
            with ti.managed_construction():
                assert _bound(ti) == drop_ins
                raise ValueError("inside the inner block")
        assert _bound(ti) == drop_ins  # the outer block still holds
    assert _bound(ti) == stock


def test_a_second_thread_is_refused_and_nothing_stays_bound(ti):
    stock = _bound(ti)
    entered, release = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def hold():
        with ti.managed_construction():
            entered.set()
            release.wait(timeout=30)

    def intrude():
        try:
            with ti.managed_construction():
                pass
        except RuntimeError as err:
            errors.append(err)

    holder = threading.Thread(target=hold, name="holder")
    holder.start()
    assert entered.wait(timeout=30)
    intruder = threading.Thread(target=intrude, name="intruder")
    intruder.start()
    intruder.join(timeout=30)
    assert _bound(ti) == (ti.Linear, ti.LayerNormLinear, ti.LayerNormMLP)  # the holder's block is intact
    release.set()
    holder.join(timeout=30)
    assert len(errors) == 1
    assert "already active in thread 'holder'" in str(errors[0]) and "'intruder'" in str(errors[0])
    assert _bound(ti) == stock
    with ti.managed_construction():  # free again, for any thread
        assert _bound(ti) != stock
    assert _bound(ti) == stock


def test_many_threads_racing_leave_tes_names_stock(ti):
    stock = _bound(ti)
    outcomes: list[str] = []
    lock = threading.Lock()

    def worker():
        for _ in range(50):
            try:
                with ti.managed_construction():
                    outcome = "held"
            except RuntimeError:
                outcome = "refused"
            with lock:
                outcomes.append(outcome)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(outcomes) == 400 and "held" in outcomes
    assert _bound(ti) == stock
