"""Any valid plan runs for GroupedLinear, or is refused by name (CPU, the TE stand-in).

As ``test_drawn_plans.py`` does for the dense modules: hypothesis draws a
call setting (layout, sharding, microbatches, recompute, grad, input grad)
and, through :class:`DrawnPlanPolicy`, a meaningful plan for every context
the binding plans. The drop-in and a stock twin run the same steps; every
output and gradient must be equal bit for bit, or the call is refused with a
PolicyMismatchError naming a plan field and the context. After each forward
with grad (outside a recompute region), what the autograd ctx holds in each
expert's workspace slot is checked against the plan: the high-precision
weight where backward gets no saved workspace, else a workspace holding what
backward reads (only that for a fresh one, D11), or a cache entry.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import _fake_te
import _fake_te_grouped as grouped
from _fake_te import load_full_binding
from _examples import scaled
from test_binding_grouped import EXPERTS, IN, LAYOUTS, OUT, SPLITS, _saved_weight_parts, _weight_slots
from test_drawn_plans import _HYPOTHESIS, _assert_refusal_names_the_plan
from workspace_manager import BackwardSource, CacheAction, ColumnwiseSource, PolicyMismatchError, Sharding, Usage
from workspace_manager.testing.plans import DrawnPlanPolicy, FixedSharding


@dataclass(frozen=True)
class Setting:
    layout: tuple
    sharding: Sharding
    microbatches: tuple
    #: plain, no_grad, or recompute: ``te.checkpoint``'s reentrant form, as in
    #: ``test_drawn_plans.py`` (a non-reentrant one is the GPU tests' to check:
    #: the stand-in's cache entries, saved whole, do not pass torch's count of
    #: recomputed tensors)
    mode: str
    input_grad: bool
    #: The recipe's backward_override (TE's grouped-tensor path takes none:
    #: drawn for the discrete layouts, which fall back to the split-quantize path).
    override: str | None = None


@st.composite
def settings_(draw) -> Setting:
    mode = draw(st.sampled_from(["plain", "no_grad", "recompute"]))
    layout = draw(st.sampled_from(LAYOUTS))
    return Setting(
        layout=layout,
        override=None if layout[0] else draw(st.sampled_from([None, "high_precision", "dequantized"])),
        sharding=draw(st.sampled_from([Sharding.NONE, Sharding.FSDP2_RESHARD, Sharding.FSDP2_KEEP])),
        microbatches=draw(st.sampled_from([(None,), (True, False, False)])),
        mode=mode, input_grad=True if mode == "recompute" else draw(st.booleans()),
    )


def _call(module, setting: Setting, x, first):
    if setting.mode == "no_grad":
        with torch.no_grad():
            return module(x, SPLITS, is_first_microbatch=first)
    if setting.mode == "recompute":
        return _fake_te.checkpoint(module, x, m_splits=SPLITS, is_first_microbatch=first)
    return module(x, SPLITS, is_first_microbatch=first)


_NAMES = {"col": Usage.COLUMNWISE, "row": Usage.ROWWISE, "row+col": Usage.BOTH}


def _slot_problem(slot: str, plan) -> str | None:
    """Why ``slot`` (what the ctx holds for one expert) is not what ``plan`` says."""
    if plan.backward_source is not BackwardSource.SAVED_WORKSPACE:
        return None if slot in ("param", "none") else f"holds {slot}; the plan saves no workspace"
    if slot.startswith("cached:"):
        return None if plan.cache in (CacheAction.FILL, CacheAction.REUSE, CacheAction.READ_ONLY) \
            else f"holds a cache entry under cache={plan.cache.value}"
    if slot not in _NAMES:
        return f"holds {slot}; the plan saves a workspace"
    held = _NAMES[slot]
    reads = plan.backward_usage
    if plan.columnwise_source is ColumnwiseSource.DERIVED and Usage.COLUMNWISE in reads:
        reads = (reads & ~Usage.COLUMNWISE) | Usage.ROWWISE  # derived from rowwise data in backward
    if reads & ~held:
        return f"holds {slot}; backward reads {reads}"
    built = plan.forward_usage
    keeps = built & ~Usage.ROWWISE if reads == Usage.COLUMNWISE and Usage.COLUMNWISE in built else built
    return None if held == keeps else f"holds {slot}; a fresh workspace keeps {keeps} (D11)"


def _train(ti, setting: Setting, policy: DrawnPlanPolicy, steps: int = 2) -> list[str]:
    grouped.set_backward_override(ti.call.te, setting.override)
    single, use_grouped = setting.layout
    stock, managed = (grouped.TEGroupedLinear(EXPERTS, IN, OUT, seed=3, single_grouped_weight=single,
                                              use_grouped_tensor=use_grouped) for _ in range(2))
    ti.modules.convert_model(managed)
    managed.__dict__["_wm_state"] = ti.state.ModuleWorkspaceState(ti.state.ModuleKind("grouped_linear"), policy,
                                                                  probe=FixedSharding(setting.sharding))
    opts = [torch.optim.SGD(m.parameters(), lr=0.25) for m in (stock, managed)]
    problems = []
    for step in range(steps):
        for micro, first in enumerate(setting.microbatches):
            gen = torch.Generator().manual_seed(17 * step + micro)
            x = torch.randn(sum(SPLITS), IN, generator=gen)
            seen = []
            for module in (stock, managed):
                xi = x.clone().requires_grad_(setting.input_grad)
                out = _call(module, setting, xi, first)
                if module is managed and setting.mode == "plain":
                    problems += _check_saved(ti, managed, out, setting, f"step {step} call {micro}")
                if setting.mode != "no_grad":
                    out.square().sum().backward()
                seen.append([out, xi.grad])
            for a, b in zip(*seen):
                assert (a is None and b is None) or torch.equal(a, b), f"step {step} call {micro}: numerics differ"
        if setting.mode != "no_grad":
            for a, b in zip(stock.parameters(), managed.parameters()):
                assert torch.equal(a.grad, b.grad), f"step {step}: weight gradients differ"
            for opt in opts:
                opt.step()
                opt.zero_grad(set_to_none=True)
    return problems


def _check_saved(ti, module, out, setting: Setting, where: str) -> list[str]:
    plan = ti.modules.last_plans(module)["weight"][1]
    single, use_grouped = setting.layout  # an override takes TE's split-quantize path
    slots = _weight_slots(_saved_weight_parts(out.grad_fn, module), (single, use_grouped and not setting.override))
    return [f"{where}: {problem}" for slot in slots if (problem := _slot_problem(slot, plan)) is not None]


@pytest.fixture
def ti(monkeypatch):
    monkeypatch.setattr(grouped.RECIPE, "backward_override", None)  # put back after each test
    return load_full_binding(monkeypatch)


#: An example takes milliseconds (no liveness readings), so the settings are
#: drawn, as many as the profile's max_examples.
@settings(_HYPOTHESIS, max_examples=scaled(1))
@given(setting=settings_(), data=st.data())
def test_every_drawn_grouped_linear_plan_is_carried_out_or_refused_by_name(ti, setting, data):
    policy = DrawnPlanPolicy(chooser=lambda ctx, plans: data.draw(st.sampled_from(plans), label=f"plan for {ctx}"))
    try:
        problems = _train(ti, setting, policy)
    except PolicyMismatchError as err:
        _assert_refusal_names_the_plan(err)
        return
    assert not problems, "\n".join(problems)


def test_the_slot_check_can_fail():
    """A workspace kept whole where D11 keeps columnwise data only, and a
    workspace where the plan saves none, are both found."""
    from workspace_manager import WorkspaceContext, WorkspacePolicy
    from workspace_manager.extending import PROFILES

    ctx = WorkspaceContext(capabilities=PROFILES["float8_current_scaling"], sharding=Sharding.NONE)
    plan = WorkspacePolicy().plan(ctx)
    assert _slot_problem("col", plan) is None
    assert "D11" in _slot_problem("row+col", plan)
    from workspace_manager import FSDP2WorkspacePolicy

    fsdp2 = FSDP2WorkspacePolicy().plan(WorkspaceContext(capabilities=PROFILES["float8_current_scaling"],
                                                         sharding=Sharding.FSDP2_RESHARD))
    assert _slot_problem("param", fsdp2) is None
    assert "saves no workspace" in _slot_problem("col", fsdp2)
