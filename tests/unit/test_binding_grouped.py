"""The GroupedLinear adapter on CPU, with a stand-in of TE 2.20's GroupedLinear.

Every test runs a drop-in and a stock twin (same seed) through the same
calls and compares outputs and gradients bit for bit; what the drop-in
saves for backward, rebuilds there and caches is read from the stand-in's
storages (``_fake_te_grouped``), in both parameter layouts and on both of
TE's paths.
"""

from __future__ import annotations

import pytest
import torch

import _fake_te
import _fake_te_grouped as grouped
from _fake_te import load_full_binding
from workspace_manager import LeanWorkspacePolicy, Sharding
from workspace_manager.testing.plans import FixedSharding

EXPERTS, IN, OUT = 3, 8, 6
SPLITS = [2, 3, 1]
#: (single_grouped_weight, use_grouped_tensor): the layouts and paths TE has.
LAYOUTS = [(False, False), (False, True), (True, True)]
LAYOUT_IDS = ["split-quantize", "grouped-tensor", "single-grouped-weight"]


@pytest.fixture
def ti(monkeypatch):
    grouped.GroupedFunction.backwards.clear()
    return load_full_binding(monkeypatch)


def _pair(ti, layout, sharding=Sharding.NONE, policy=None):
    single, use_grouped = layout
    stock, managed = (grouped.TEGroupedLinear(EXPERTS, IN, OUT, seed=5, single_grouped_weight=single,
                                              use_grouped_tensor=use_grouped) for _ in range(2))
    ti.modules.convert_model(managed)
    state = ti.state.ModuleWorkspaceState(ti.state.ModuleKind("grouped_linear"), policy, probe=FixedSharding(sharding))
    managed.__dict__["_wm_state"] = state
    return stock, managed


def _step(module, x, first=None):
    out = module(x, SPLITS, is_first_microbatch=first)
    saved = _saved_weight_parts(out.grad_fn, module)
    out.square().sum().backward()
    return [out.detach(), x.grad] + [p.grad.clone() for p in module.parameters()], saved


def _inputs(seed: int):
    x = torch.randn(sum(SPLITS), IN, generator=torch.Generator().manual_seed(seed))
    return x.clone().requires_grad_(), x.clone().requires_grad_()


def _saved_weight_parts(grad_fn, module) -> list[str]:
    """What the Function saved in the workspaces' place, per expert:
    ``param`` (the high-precision weight), ``col`` (columnwise data only),
    ``row+col``, or ``none``."""
    params = {id(p) for p in module.parameters()}
    objects = grad_fn.tensor_objects
    saved = list(grad_fn.saved_tensors)
    kinds, position = [], 0
    for obj in objects:
        if obj is None:
            tensor = saved[position]
            position += 1
            kinds.append("param" if tensor is not None and id(tensor) in params
                         else ("none" if tensor is None else "tensor"))
            continue
        if isinstance(obj, _fake_te._Whole):  # a cache entry, saved whole
            position += 1
            usages = obj.tensor.get_usages()
            kinds.append("cached:" + "+".join(u[:3] for u in ("rowwise", "columnwise") if usages[u]))
            continue
        width = 4 if isinstance(obj, grouped.GroupedWorkspace) else 3
        parts = saved[position:position + width]
        position += width
        kinds.append({(True, True): "row+col", (False, True): "col", (True, False): "row"}.get(
            (parts[0] is not None, parts[1] is not None), "none"))
    return kinds


def _train(stock, managed, first_flags=(None,), steps=2):
    seen = []
    for step in range(steps):
        for micro, first in enumerate(first_flags):
            xs, xm = _inputs(10 * step + micro)
            want, _ = _step(stock, xs, first)
            got, saved = _step(managed, xm, first)
            for a, b in zip(want, got):
                assert torch.equal(a, b), f"step {step} microbatch {micro}: numerics differ"
            seen.append(saved)
            stock.zero_grad(set_to_none=True)
            managed.zero_grad(set_to_none=True)
    return seen


def _weight_slots(saved: list[str], layout) -> list[str]:
    """The slots of the experts' workspaces in what was saved."""
    single, use_grouped = layout
    if not use_grouped:
        return saved[EXPERTS:2 * EXPERTS]
    return saved[1:2] if single else saved[1:1 + EXPERTS]


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_unsharded_saves_only_the_columnwise_data_dgrad_reads(ti, layout):
    stock, managed = _pair(ti, layout)
    seen = _train(stock, managed)
    assert all(slot == "col" for saved in seen for slot in _weight_slots(saved, layout)), seen
    assert ti.modules.last_plans(managed)["weight"][1].backward_source.name == "SAVED_WORKSPACE"


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_stock_grouped_linear_keeps_both_usages(ti, layout):
    """The twin the drop-in is compared with: what TE saves (both usages), untouched by the seams."""
    stock, managed = _pair(ti, layout)
    managed(_inputs(0)[1], SPLITS)  # installs the seams
    xs, _ = _inputs(1)
    _, saved = _step(stock, xs)
    assert all(slot == "row+col" for slot in _weight_slots(saved, layout)), saved


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("sharding", [Sharding.FSDP2_RESHARD, Sharding.FSDP2_KEEP])
def test_fsdp2_saves_no_workspace_and_backward_quantizes_the_weights_again(ti, layout, sharding, monkeypatch):
    rebuilt = []
    original = ti.grouped_linear.ExpertRebuild.before_te_backward

    def watching(self, ctx, saved):
        saved = original(self, ctx, saved)
        count = ctx.num_gemms
        weights = saved[count:2 * count] if not ctx.grouped_tensor_supported else (
            [saved[1]] if ctx.single_grouped_weight else saved[1:1 + count])
        rebuilt.append([w.get_usages() for w in weights])
        return saved

    monkeypatch.setattr(ti.grouped_linear.ExpertRebuild, "before_te_backward", watching)
    stock, managed = _pair(ti, layout, sharding)
    seen = _train(stock, managed, first_flags=(True, False))
    assert all(slot == "param" for saved in seen for slot in _weight_slots(saved, layout)), seen
    assert len(rebuilt) == len(seen)
    assert all(usages == {"rowwise": False, "columnwise": True} for call in rebuilt for usages in call), rebuilt
    assert managed._fp8_workspaces == {}, "no cache under FSDP2"


def test_microbatches_unsharded_cache_each_expert_under_te_s_key(ti):
    layout = (False, False)
    stock, managed = _pair(ti, layout)
    _train(stock, managed, first_flags=(True, False, False))
    assert sorted(managed._fp8_workspaces) == [f"weight{i}" for i in range(EXPERTS)]
    assert sorted(stock._fp8_workspaces) == sorted(managed._fp8_workspaces)
    refreshes = [managed._fp8_workspaces[f"weight{i}"].refreshes for i in range(EXPERTS)]
    assert refreshes == [1] * EXPERTS, "filled at each step's first microbatch, reused after"


def test_single_grouped_weight_keeps_te_s_own_cache_entry_unsharded(ti):
    stock, managed = _pair(ti, (True, True))
    _train(stock, managed, first_flags=(True, False))
    assert list(managed._fp8_workspaces) == ["weight"] == list(stock._fp8_workspaces)


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_lean_policy_keeps_nothing_for_backward_unsharded(ti, layout):
    stock, managed = _pair(ti, layout, policy=LeanWorkspacePolicy())
    seen = _train(stock, managed)
    assert all(slot == "param" for saved in seen for slot in _weight_slots(saved, layout)), seen


def test_the_plan_is_made_once_per_call_shape_not_per_expert(ti):
    stock, managed = _pair(ti, (False, False))
    _train(stock, managed, steps=3)
    state = ti.modules.workspace_state(managed)
    assert state.shapes_planned() == 1
    assert list(ti.modules.last_plans(managed)) == ["weight"]


def test_under_no_grad_the_drop_in_computes_what_stock_does(ti):
    stock, managed = _pair(ti, (False, False))
    with torch.no_grad():
        a, b = stock(_inputs(3)[0], SPLITS), managed(_inputs(3)[1], SPLITS)
    assert torch.equal(a, b)


def test_convert_model_and_managed_construction_make_drop_ins(ti, monkeypatch):
    model = torch.nn.Sequential(grouped.TEGroupedLinear(EXPERTS, IN, OUT))
    ti.modules.convert_model(model)
    assert type(model[0]) is ti.kinds.GroupedLinear
    te = ti.call.te
    package = te.tep
    for module, name in ((te.mha_module, "Linear"), (te.mha_module, "LayerNormLinear"),
                         (te.transformer_module, "LayerNormMLP")):  # the dense kinds' names
        monkeypatch.setattr(module, name, object(), raising=False)
    with ti.construction.managed_construction():
        assert package.GroupedLinear is ti.kinds.GroupedLinear
    assert package.GroupedLinear is grouped.TEGroupedLinear


def test_an_unknown_saving_layout_is_refused_by_name(ti):
    with pytest.raises(RuntimeError, match="neither of TE 2.20's layouts"):
        ti.grouped_linear._weights_in_workspace_slots((None,) * 5, (object(),) * 3, 3)


def test_the_saving_seam_leaves_a_slot_te_empties_empty(ti):
    """On the grouped-tensor path TE saves no workspace when no dgrad
    follows; the seam must not put a weight there."""
    weights = (torch.zeros(1), torch.zeros(1))
    out = ti.grouped_linear._weights_in_workspace_slots(("x", None, None, 1, 2, 3, 4), weights, 2)
    assert out == ("x", None, None, 1, 2, 3, 4)
    out = ti.grouped_linear._weights_in_workspace_slots(("x", "w0", "w1", 1, 2, 3, 4), weights, 2)
    assert out[1] is weights[0] and out[2] is weights[1]


def test_without_input_grad_nothing_is_rebuilt_and_numerics_match(ti):
    layout = (False, False)
    stock, managed = _pair(ti, layout, Sharding.FSDP2_RESHARD)
    for module in (stock, managed):
        out = module(torch.randn(sum(SPLITS), IN, generator=torch.Generator().manual_seed(4)), SPLITS)
        out.square().sum().backward()
    for a, b in zip(stock.parameters(), managed.parameters()):
        assert torch.equal(a.grad, b.grad)


def test_each_expert_s_copy_is_attributed_under_its_own_key(ti):
    """record_workspaces and workspace_report name each expert's workspace
    by TE's key (weight0 ...), with the call's one plan behind it."""
    _, managed = _pair(ti, (False, False))
    model = torch.nn.Sequential(managed)
    with ti.attribution.record_workspaces(model, timeline=False):
        out = managed(_inputs(0)[1], SPLITS, is_first_microbatch=True)
        report = ti.attribution.workspace_report(model)
        out.sum().backward()
    weights = sorted({e.record.weight for e in report.entries})
    assert weights == [f"weight{i}" for i in range(EXPERTS)], report.entries
    plan = ti.modules.last_plans(managed)["weight"][1]
    assert all(e.record.decision == plan.summary() and e.nbytes > 0 for e in report.entries), report.entries


def test_a_distributed_weight_keeps_te_s_gather_again_path(ti, monkeypatch):
    """Experts held as TE DistributedWeights: the plan is the distributed
    weight's (gathered again in backward, nothing saved), TE's own path runs
    unchanged, and numerics equal stock's."""
    monkeypatch.setattr(ti.call.te, "is_distributed_weight", lambda weight: True)
    stock, managed = _pair(ti, (False, False))
    managed.__dict__["_wm_state"] = ti.state.ModuleWorkspaceState(ti.state.ModuleKind("grouped_linear"))
    for module in (stock, managed):
        for p in module.parameters():
            p.is_distributed_weight = True
    seen = _train(stock, managed)
    assert all(slot == "none" for saved in seen for slot in _weight_slots(saved, (False, False))), seen
    context, plan = ti.modules.last_plans(managed)["weight"]
    assert context.sharding is Sharding.DISTRIBUTED_WEIGHT and plan.backward_source.name == "REGATHER"


def test_columnwise_data_derived_in_backward_is_refused_for_one_grouped_weight(ti):
    from workspace_manager import ColumnwiseSource, UnsupportedPlanError
    from workspace_manager.testing.plans import DrawnPlanPolicy

    def derived(ctx, plans):
        return next((p for p in plans if p.columnwise_source is ColumnwiseSource.DERIVED), plans[0])

    _, managed = _pair(ti, (True, True), policy=DrawnPlanPolicy(chooser=derived))
    with pytest.raises(UnsupportedPlanError, match="columnwise_source=derived.*Context"):
        managed(_inputs(0)[1], SPLITS)
    _, discrete = _pair(ti, (False, True), policy=DrawnPlanPolicy(chooser=derived))
    discrete(_inputs(0)[1], SPLITS).sum().backward()  # discrete weights derive it in TE's backward
