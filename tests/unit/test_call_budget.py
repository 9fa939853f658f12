"""The host cost of a managed call, counted rather than timed: Python-level
calls (Python functions and builtins) of a drop-in Linear call, forward and
backward, over a stock call with the seams taken out, on the CPU stand-in
TE. A count is exact on any machine, so this can hold a budget that a timed
unit test could not (the GPU benchmark ``benchmarks/call_overhead.py``
measures the time)."""

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
