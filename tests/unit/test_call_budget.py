"""The host cost of a managed call, counted rather than timed: Python-level
calls (Python functions and builtins) of a drop-in Linear call, forward and
backward, over a stock call with the seams taken out, on the CPU stand-in
TE. A count is exact on any machine, so this can hold a budget that a timed
unit test could not (the GPU benchmarks count the same calls per step:
``benchmarks.step_time --profile``, ``benchmarks.moe_step``)."""

from __future__ import annotations

import pytest
import torch
from _call_count import count_calls
from _fake_te import TELinear, load_full_binding

#: Python-level calls a drop-in Linear call (D11 on: a fresh workspace saved
#: for a columnwise-only backward) may add over TE's own code: the marks in
#: prepare_forward/end_forward, the sharding read, the Function seam, the
#: memo lookup, the quantize_weight seam, D11's edit and the backward seam.
BUDGET = 18


@pytest.fixture
def ti(monkeypatch):
    return load_full_binding(monkeypatch)


def test_a_managed_call_adds_at_most_the_budget_of_pythoncount_calls(ti):
    x = torch.randn(4, 8, requires_grad=True)
    stock = TELinear(8, 8, seed=1)
    managed = ti.modules.convert_model(TELinear(8, 8, seed=1))
    managed(x).sum().backward()  # installs the seams, plans the one call shape
    planned = ti.modules.workspace_state(managed).shapes_planned()
    ti.install.uninstall()
    stock_calls = count_calls(lambda: stock(x).sum().backward())
    managed_calls = count_calls(lambda: managed(x).sum().backward())
    extra = sum(managed_calls.values()) - sum(stock_calls.values())
    where = {key: n for key, n in (managed_calls - stock_calls).items()}
    assert 0 < extra <= BUDGET, f"{extra} calls over stock's {sum(stock_calls.values())}: {where}"
    assert ti.modules.workspace_state(managed).shapes_planned() == planned  # no planning on repeated calls
    assert not any(name in ("plan_call", "_plan", "levers_from_plan") for _, name in where)


def test_a_new_call_shape_is_planned_once_then_costs_the_same(ti):
    x = torch.randn(4, 8, requires_grad=True)
    managed = ti.modules.convert_model(TELinear(8, 8, seed=1))
    state = ti.modules.workspace_state(managed)
    managed(x).sum().backward()
    before = state.shapes_planned()
    managed(x, is_first_microbatch=True).sum().backward()  # a new shape: planned in full
    assert state.shapes_planned() == before + 1
    first = count_calls(lambda: managed(x).sum().backward())
    again = count_calls(lambda: managed(x, is_first_microbatch=False).sum().backward())
    assert state.shapes_planned() == before + 2
    assert not any(name == "plan_call" for _, name in again)
    assert not any(name == "plan_call" for _, name in first)


def _grouped_extra(ti, experts: int, sharding) -> tuple[float, dict]:
    """Calls a drop-in GroupedLinear call (forward and backward) adds over stock's."""
    import _fake_te_grouped as grouped
    from workspace_manager.testing.plans import FixedSharding

    splits = [2] * experts
    x = torch.randn(sum(splits), 8, requires_grad=True)
    stock = grouped.TEGroupedLinear(experts, 8, 8, seed=1)
    managed = ti.modules.convert_model(grouped.TEGroupedLinear(experts, 8, 8, seed=1))
    managed.__dict__["_wm_state"] = ti.state.ModuleWorkspaceState(ti.state.ModuleKind.GROUPED_LINEAR,
                                                                  probe=FixedSharding(sharding))
    managed(x, splits).sum().backward()
    ti.install.uninstall()
    stock_calls = count_calls(lambda: stock(x, splits).sum().backward())
    managed_calls = count_calls(lambda: managed(x, splits).sum().backward())
    ti.install.install()
    # The stand-in's own code is TE's work (the quantization FSDP2's rebuild
    # runs is its price, in TE's kernels); what is counted is the binding's.
    added = {key: n for key, n in (managed_calls - stock_calls).items() if "_fake_te" not in key[0]}
    return sum(added.values()), added


def _grouped_net(ti, experts: int) -> float:
    """Every call (the stand-in's too) a drop-in GroupedLinear call makes over stock's, unsharded."""
    import _fake_te_grouped as grouped
    from workspace_manager import Sharding
    from workspace_manager.testing.plans import FixedSharding

    splits = [2] * experts
    x = torch.randn(sum(splits), 8, requires_grad=True)
    stock = grouped.TEGroupedLinear(experts, 8, 8, seed=1)
    managed = ti.modules.convert_model(grouped.TEGroupedLinear(experts, 8, 8, seed=1))
    managed.__dict__["_wm_state"] = ti.state.ModuleWorkspaceState(ti.state.ModuleKind.GROUPED_LINEAR,
                                                                  probe=FixedSharding(Sharding.NONE))
    managed(x, splits).sum().backward()
    ti.install.uninstall()
    stock_calls = count_calls(lambda: stock(x, splits).sum().backward())
    managed_calls = count_calls(lambda: managed(x, splits).sum().backward())
    ti.install.install()
    return sum(managed_calls.values()) - sum(stock_calls.values())


def test_an_unsharded_grouped_linear_call_makes_no_call_per_expert_over_stock(ti):
    """The quantize_weight seam makes the quantizer call TE's own function
    would make, so it takes the place of TE's frame inside TE's loop over
    the experts instead of adding one: 8 experts cost what 2 cost."""
    assert _grouped_net(ti, 8) == _grouped_net(ti, 2)


@pytest.mark.parametrize("sharding", ["none", "fsdp2_reshard"])
def test_grouped_linear_adds_one_plan_and_at_most_two_of_our_calls_per_expert(ti, sharding):
    """One plan per call: a GroupedLinear call adds about the dense budget,
    plus, inside TE's own loop over the experts, the quantize_weight seam's
    frame and nothing else. Under FSDP2 the experts are quantized by one
    grouped call in forward and one in the backward rebuild
    (``_expert_quantize``), each a fixed number of calls whatever the
    number of experts, in place of a quantizer call chain per expert."""
    from workspace_manager import Sharding

    sharding = Sharding(sharding)
    few, few_where = _grouped_extra(ti, 2, sharding)
    many, many_where = _grouped_extra(ti, 8, sharding)
    ours = {key: many_where.get(key, 0) - few_where.get(key, 0) for key in many_where if "te_integration" in key[0]}
    per_expert = sum(ours.values()) / 6
    # Over the dense budget: the saving pair's frames; under FSDP2 the
    # rebuild's objects and frames and the two grouped quantizations: each
    # our three frames (the entry, the method, the concatenation's), its
    # checks (type, tuple of ids, isinstance), the concatenation, per-tensor
    # scaling's aligned scales (reshape, pad, enumerate), and the stand-in
    # grouped kernel's tensor builtins (C++ in TE, counted here).
    grouped = 2 * 12 if sharding.is_fsdp2 else 0
    assert 0 < few <= BUDGET + (24 if sharding.is_fsdp2 else 8) + grouped, (few, few_where)
    # Our frames per expert: the quantize_weight seam (in place of TE's), also under FSDP2.
    assert per_expert <= 1, f"{per_expert} of our calls per expert: {ours}"
    if not sharding.is_fsdp2:
        assert (many - few) / 6 <= 1, f"{(many - few) / 6} calls per expert: {many_where}"
