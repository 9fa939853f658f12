"""apply_workspace_budget on CPU: the stand-in TE, FSDP2 at gloo world size 1.

The keep policy goes on the modules whose backward runs first (the last
registered), as long as their copies fit; the chosen modules plan
backward_source=saved_workspace under FSDP2, and their backward quantizes
nothing; bad arguments are refused before anything changes.
"""

from __future__ import annotations

import pytest
import torch
from _binding_standin import load_binding
from _fake_te import TELinear, compat

from workspace_manager import (
    BackwardSource,
    FSDP2WorkspacePolicy,
    KeepForBackwardWorkspacePolicy,
    LeanWorkspacePolicy,
    PolicyMismatchError,
    Sharding,
)

#: (in, out) of the stack's three layers: 64, 128 and 64 weight elements.
SHAPES = ((8, 8), (8, 16), (16, 4))
KEEP = KeepForBackwardWorkspacePolicy()


@pytest.fixture
def binding(monkeypatch):
    mods = load_binding(monkeypatch, compat(), "runtime._step_hook", "runtime._attribution", "runtime._state",
                        "runtime._shards", "runtime._install", "runtime._modules", "runtime._budget", "kinds")
    return mods["runtime._modules"], mods["runtime._budget"]


def _stack(modules, *, shard: bool = True) -> torch.nn.Sequential:
    model = torch.nn.Sequential(*[TELinear(i, o, seed=n) for n, (i, o) in enumerate(SHAPES)])
    modules.convert_model(model)
    if shard:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (1,))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def _kept(model) -> list[bool]:
    return [layer.workspace_policy == KEEP for layer in model]


@pytest.mark.parametrize("budget, kept", [
    (0, [False, False, False]),
    (63, [False, False, False]),
    (64, [False, False, True]),       # the last layer runs backward first
    (191, [False, False, True]),      # layer 1 (128) does not fit: the walk stops there
    (192, [False, True, True]),
    (255, [False, True, True]),
    (256, [True, True, True]),        # every copy
    (10**12, [True, True, True]),
], ids=lambda v: str(v))
def test_the_budget_is_spent_from_the_last_layer_back(binding, gloo, budget, kept):
    modules, budget_module = binding
    model = _stack(modules)
    report = budget_module.apply_workspace_budget(model, budget)
    assert _kept(model) == kept
    assert [e.fqn for e in report.entries] == ["2", "1", "0"] and [e.nbytes for e in report.entries] == [64, 128, 64]
    assert [e.kept for e in report.entries] == kept[::-1]
    assert report.kept_bytes == sum(n for n, k in zip((64, 128, 64), kept) if k) <= budget
    assert report.candidate_bytes == 256 and report.budget_bytes == budget
    assert all(layer.workspace_policy is None for layer, k in zip(model, kept) if not k)


def test_a_smaller_budget_unpins_what_a_larger_one_pinned_and_others_pins_stay(binding, gloo):
    modules, budget_module = binding
    model = _stack(modules)
    pinned_by_user = FSDP2WorkspacePolicy()
    modules.set_workspace_policy(model[2], pinned_by_user)
    first = budget_module.apply_workspace_budget(model, 256)
    assert model[2].workspace_policy is pinned_by_user and _kept(model) == [True, True, False]
    assert first.entries[0].choice is budget_module.BudgetChoice.PINNED and first.kept_bytes == 192
    second = budget_module.apply_workspace_budget(model, 128)
    assert _kept(model) == [False, True, False] and model[0].workspace_policy is None
    assert model[2].workspace_policy is pinned_by_user
    assert [e.choice.name for e in second.entries] == ["PINNED", "KEPT", "OVER_BUDGET"]


def test_a_chosen_module_keeps_forwards_copy_and_its_backward_quantizes_nothing(binding, gloo):
    modules, budget_module = binding
    model = _stack(modules)
    budget_module.apply_workspace_budget(model, 64)
    calls = [0, 0, 0]
    for n, layer in enumerate(model):
        original = layer.quantizer.quantize

        def counting(tensor, *, dtype=None, n=n, original=original):
            calls[n] += 1
            return original(tensor, dtype=dtype)

        layer.quantizer.quantize = counting
    model(torch.randn(4, 8, requires_grad=True)).sum().backward()
    ctx, plan = modules.last_plans(model[2])["weight"]
    assert ctx.sharding is Sharding.FSDP2_RESHARD
    assert plan.backward_source is BackwardSource.SAVED_WORKSPACE and plan.columnwise_source.value == "forward"
    assert modules.last_plans(model[1])["weight"][1].backward_source is BackwardSource.REQUANTIZE
    assert calls == [2, 2, 1]  # forward and backward each quantize, except on the kept layer


def test_the_report_prints_a_table_with_totals(binding, gloo):
    modules, budget_module = binding
    text = str(budget_module.apply_workspace_budget(_stack(modules), 192))
    lines = text.splitlines()
    assert lines[0].startswith("workspace budget: 0.0 MiB; kept 0.0 MiB on 2 of 3 modules")
    assert lines[1].split() == ["module", "bytes", "MiB", "kept"]
    assert lines[2].split() == ["2", "64", "0.0", "yes"] and lines[4].split() == ["0", "64", "0.0", "no", "(over",
                                                                                  "budget)"]


def test_the_cost_is_the_full_size_of_a_sharded_weight(binding, gloo):
    """A DTensor parameter's shape is the unsharded one: the gathered copy is what a kept copy holds."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    modules, budget_module = binding
    model = _stack(modules)
    local = torch.zeros(8, 16)
    mesh = init_device_mesh("cpu", (1,))
    # As one rank of four would hold it: its shard, with the global shape stated.
    model[1].weight = torch.nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                                            shape=torch.Size((32, 16)), stride=(16, 1)))
    report = budget_module.apply_workspace_budget(model, 0)
    assert report.entries[1].nbytes == 32 * 16


@pytest.mark.parametrize("budget, error, message", [
    (-1, ValueError, "budget_bytes must be >= 0; received -1"),
    (1.5e9, TypeError, r"budget_bytes must be an int .* received float 1500000000.0.*int\(0.25 \* total\)"),
    (True, TypeError, "budget_bytes must be an int"),
    ("1GiB", TypeError, "received str '1GiB'"),
])
def test_bad_budgets_are_refused_and_change_nothing(binding, gloo, budget, error, message):
    modules, budget_module = binding
    model = _stack(modules)
    with pytest.raises(error, match=message):
        budget_module.apply_workspace_budget(model, budget)
    assert _kept(model) == [False, False, False]


def test_a_model_that_is_no_module_or_holds_no_drop_in_is_refused(binding):
    _, budget_module = binding
    with pytest.raises(TypeError, match="apply_workspace_budget: model must be a torch.nn.Module; received list"):
        budget_module.apply_workspace_budget([TELinear(8, 8)], 0)
    with pytest.raises(ValueError, match="holds no te_integration drop-in module.*convert_model"):
        budget_module.apply_workspace_budget(torch.nn.Sequential(TELinear(8, 8)), 0)


def test_before_fully_shard_it_says_to_call_it_after(binding):
    modules, budget_module = binding
    model = _stack(modules, shard=False)
    with pytest.raises(PolicyMismatchError, match="FSDP2 shards none of the 3 drop-in modules.*fully_shard"):
        budget_module.apply_workspace_budget(model, 256)
    assert _kept(model) == [False, False, False]


def test_unsharded_drop_ins_beside_sharded_ones_are_left_alone(binding, gloo):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    modules, budget_module = binding
    model = _stack(modules, shard=False)
    fully_shard(model[0], mesh=init_device_mesh("cpu", (1,)))
    modules.set_workspace_policy(model[1], LeanWorkspacePolicy())
    report = budget_module.apply_workspace_budget(model, 256)
    assert [e.choice.name for e in report.entries] == ["NOT_SHARDED", "NOT_SHARDED", "KEPT"]
    assert model[0].workspace_policy == KEEP and model[2].workspace_policy is None
