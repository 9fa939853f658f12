"""Workspace attribution (issue 6) on CPU, with the testing kit's reference quantizer.

The ledger follows storages, not Python objects, so these tests hold and
drop real CPU tensors the way caches, autograd and FSDP2 would.
"""

from __future__ import annotations

import gc

import pytest
import torch
from _spaces import holds_for_each, selected_plans

from workspace_manager import BackwardSource, CacheAction, Release, Sharding, Usage, WeightSource, select_policy
from workspace_manager.attribution import (
    Lifetime,
    WorkspaceKind,
    WorkspaceLedger,
    WorkspaceReport,
    buffers_of,
    expected_lifetime,
    workspace_kind,
)
from workspace_manager.testing.reference import Float8PerTensorQuantizer


class Owner:
    """Stands for a module (weakly referenced by the ledger)."""


@pytest.fixture
def q():
    return Float8PerTensorQuantizer()


@pytest.fixture
def weight():
    return torch.randn(64, 32, generator=torch.Generator().manual_seed(0))


def _plan(sharding=Sharding.NONE, **kw):
    from workspace_manager._profiles import FLOAT8_CURRENT_SCALING
    from workspace_manager import WorkspaceContext

    ctx = WorkspaceContext(capabilities=FLOAT8_CURRENT_SCALING, sharding=sharding, **kw)
    return select_policy(ctx).plan(ctx)


# -- the pure questions -----------------------------------------------------------
def test_kind_and_lifetime_follow_the_plan():
    """For every context (``_spaces``) and the plan select_policy's policy makes."""
    def check(ctx, plan):
        kind = workspace_kind(plan, from_cache=False)
        life = expected_lifetime(kind, plan)
        if plan.cache in (CacheAction.FILL, CacheAction.REUSE):
            assert kind is WorkspaceKind.CACHED
            assert life is (Lifetime.STEP if Release.CACHED_WORKSPACE in plan.release else Lifetime.KEPT)
        elif plan.backward_source is BackwardSource.SAVED_WORKSPACE:
            assert kind is WorkspaceKind.SAVED_FOR_BACKWARD and life is Lifetime.BACKWARD
        else:
            assert kind is WorkspaceKind.FORWARD_ONLY and life is Lifetime.CALL
        assert workspace_kind(plan, from_cache=True) is WorkspaceKind.CACHED

    holds_for_each(check, selected_plans())


def test_under_fsdp2_resharding_no_forward_workspace_outlives_the_step():
    """TE#2681 in attribution terms: nothing the plan makes in forward is kept across steps."""
    def check(ctx, plan):
        if ctx.sharding is Sharding.FSDP2_RESHARD and ctx.weight is WeightSource.HIGH_PRECISION:
            assert expected_lifetime(workspace_kind(plan, from_cache=False), plan).ends_by_step

    holds_for_each(check, selected_plans())


def test_parameter_columnwise_lifetimes():
    fsdp2_qp = _plan(Sharding.FSDP2_RESHARD, weight=WeightSource.QUANTIZED_PARAM)
    assert expected_lifetime(WorkspaceKind.PARAMETER_COLUMNWISE, fsdp2_qp) is Lifetime.BACKWARD
    # The shard of a derivable format keeps rowwise data only (D10): its columnwise copy ends at the step.
    assert expected_lifetime(WorkspaceKind.PARAMETER_COLUMNWISE, fsdp2_qp, sharded=True) is Lifetime.STEP
    assert expected_lifetime(WorkspaceKind.GATHERED, fsdp2_qp) is Lifetime.FSDP2
    assert expected_lifetime(WorkspaceKind.FORWARD_ONLY, None) is Lifetime.UNPLANNED
    assert expected_lifetime(WorkspaceKind.UNPLANNED, fsdp2_qp) is Lifetime.UNPLANNED


def test_buffers_are_split_by_direction_from_their_names(q, weight):
    from workspace_manager.attribution._ledger import direction_of

    handle = q.quantize(weight, rowwise=True, columnwise=True)
    assert set(buffers_of(handle)) == {"rowwise", "columnwise", "scale"}
    assert direction_of("_transpose") is Usage.COLUMNWISE and direction_of("_columnwise_scale_inv") is Usage.COLUMNWISE
    assert direction_of("_data") is Usage.ROWWISE and direction_of("_scale_inv") is Usage.ROWWISE


# -- the record follows memory ---------------------------------------------------------
def test_an_entry_lives_exactly_as_long_as_its_storages(q, weight):
    ledger, owner = WorkspaceLedger(), Owner()
    handle = q.quantize(weight, rowwise=True, columnwise=True)
    rec = ledger.record(owner, "layer.fc", "weight", WorkspaceKind.SAVED_FOR_BACKWARD, _plan(), handle)
    assert rec is not None and rec.lifetime is Lifetime.BACKWARD
    (live,) = ledger.live()
    assert live.usage is Usage.BOTH and live.nbytes == q.bytes_held(handle) == 2 * 64 * 32 + 4
    q.update_usage(handle, columnwise=False)  # the transpose is dropped
    (live,) = ledger.live()
    assert live.usage is Usage.ROWWISE and live.nbytes == q.bytes_held(handle)
    saved_view = handle.rowwise.view(-1)  # another holder of the same storage (as autograd's saved tensors are)
    del handle
    gc.collect()
    assert ledger.live()[0].nbytes == 64 * 32, "the rowwise storage is still held through a view"
    del saved_view
    assert ledger.live() == []


def test_a_storage_is_attributed_once(q, weight):
    ledger, owner = WorkspaceLedger(), Owner()
    handle = q.quantize(weight, rowwise=True, columnwise=True)
    assert ledger.record(owner, "m", "weight", WorkspaceKind.CACHED, _plan(), handle) is not None
    assert ledger.record(owner, "m", "weight", WorkspaceKind.SAVED_FOR_BACKWARD, _plan(), handle) is None
    assert len(ledger.live()) == 1 and ledger.live()[0].record.kind is WorkspaceKind.CACHED


def test_usage_filter_records_one_direction(q, weight):
    ledger, owner = WorkspaceLedger(), Owner()
    param = q.quantize(weight, rowwise=True, columnwise=True)
    ledger.record(owner, "m", "weight", WorkspaceKind.PARAMETER_COLUMNWISE, _plan(), param, usage=Usage.COLUMNWISE)
    (live,) = ledger.live()
    assert live.usage is Usage.COLUMNWISE and live.nbytes == 64 * 32


def test_entries_go_with_their_module_and_filter_by_owner(q, weight):
    ledger, a, b = WorkspaceLedger(), Owner(), Owner()
    ha, hb = q.quantize(weight, rowwise=True, columnwise=False), q.quantize(weight, rowwise=True, columnwise=False)
    ledger.record(a, "a", "weight", WorkspaceKind.CACHED, _plan(), ha)
    ledger.record(b, "b", "weight", WorkspaceKind.CACHED, _plan(), hb)
    assert [e.record.module for e in ledger.live([a])] == ["a"]
    del b
    gc.collect()
    assert [e.record.module for e in ledger.live()] == ["a"]


# -- a training step, driven by plans ------------------------------------------------
def _step(q, weight, ledger, owner, plan, *, leak: bool):
    """One forward and backward the way a binding carries out ``plan``, with
    marks at the boundaries. ``leak`` keeps the forward workspace alive past
    the step, as a binding bug would."""
    kept = []
    ledger.mark("forward start", "forward", "layer")
    ws = q.quantize(weight, rowwise=True, columnwise=Usage.COLUMNWISE in plan.forward_usage)
    ledger.record(owner, "layer", "weight", workspace_kind(plan, from_cache=False), plan, ws)
    saved = ws if plan.backward_source is BackwardSource.SAVED_WORKSPACE else None
    if leak:
        kept.append(ws)
    del ws
    after_forward = ledger.mark("forward end", "forward", "layer")
    ledger.mark("backward start", "backward", "layer")
    del saved
    after_backward = ledger.mark("backward end", "backward", "layer")
    ledger.next_step()
    return after_forward, after_backward, kept


@pytest.mark.parametrize("sharding", [Sharding.NONE, Sharding.FSDP2_RESHARD])
def test_a_step_leaves_no_leftover_and_the_timeline_shows_each_phase(q, weight, sharding):
    ledger, owner = WorkspaceLedger(allocated=lambda: 123), Owner()
    plan = _plan(sharding)
    after_fwd, after_bwd, _ = _step(q, weight, ledger, owner, plan, leak=False)
    saves = plan.backward_source is BackwardSource.SAVED_WORKSPACE
    assert after_fwd.total == (q.bytes_held(q.quantize(weight, rowwise=True, columnwise=True)) if saves else 0)
    assert after_bwd.total == 0 and after_bwd.allocated == 123
    assert [p.label for p in ledger.timeline] == ["forward start", "forward end", "backward start", "backward end"]
    assert WorkspaceReport(tuple(ledger.live())).leftovers == ()


def test_a_workspace_kept_past_its_plan_is_reported_as_a_leftover(q, weight):
    ledger, owner = WorkspaceLedger(), Owner()
    plan = _plan(Sharding.FSDP2_RESHARD)
    _, after_bwd, kept = _step(q, weight, ledger, owner, plan, leak=True)
    report = WorkspaceReport(tuple(ledger.live()))
    (left,) = report.leftovers
    assert left.record.kind is WorkspaceKind.FORWARD_ONLY and left.record.lifetime is Lifetime.CALL
    assert after_bwd.total == left.nbytes == 64 * 32 + 4
    assert "LEFTOVER" in report.table() and "cache=" in report.table()
    kept.clear()
    assert WorkspaceReport(tuple(ledger.live())).leftovers == ()


def test_report_table_and_dict_agree(q, weight):
    ledger, owner = WorkspaceLedger(), Owner()
    hs = [q.quantize(weight, rowwise=True, columnwise=c) for c in (True, False)]
    ledger.record(owner, "layers.0.fc1", "fc1_weight", WorkspaceKind.CACHED, _plan(), hs[0])
    ledger.record(owner, "layers.0.fc2", "fc2_weight", WorkspaceKind.CACHED, _plan(), hs[1])
    report = WorkspaceReport(tuple(ledger.live()))
    d = report.as_dict()
    assert d["total_bytes"] == report.total_bytes == sum(q.bytes_held(h) for h in hs)
    assert d["by_module"] == {"layers.0.fc1": q.bytes_held(hs[0]), "layers.0.fc2": q.bytes_held(hs[1])}
    assert d["by_kind"] == {"cached": report.total_bytes} and d["leftovers"] == []
    text = report.table()
    assert "layers.0.fc1" in text and "fc2_weight" in text and "0 leftover(s)" in text
    assert f"{report.total_bytes / 1024:.1f}" in text.splitlines()[-1]


def test_a_shared_scale_does_not_keep_a_workspace_alive(q, weight):
    """FSDP2 gives the gathered parameter the shard's scale: once the
    gathered data is freed, the entry is gone although the scale lives on."""
    ledger, owner = WorkspaceLedger(), Owner()
    shard_scale = torch.ones(1)

    class Gathered:
        def __init__(self):
            self._data = torch.empty(64 * 32, dtype=torch.uint8)
            self._scale_inv = shard_scale

    gathered = Gathered()
    ledger.record(owner, "m", "weight", WorkspaceKind.GATHERED, _plan(), gathered, usage=Usage.ROWWISE)
    assert ledger.live()[0].nbytes == 64 * 32 + 4
    del gathered
    assert ledger.live() == [] and shard_scale.numel() == 1
    # A new workspace can then claim the scale's storage.
    again = Gathered()
    assert ledger.record(owner, "m", "weight", WorkspaceKind.GATHERED, _plan(), again) is not None
    assert ledger.live()[0].nbytes == 64 * 32 + 4


def test_scales_alone_are_not_recorded(q, weight):
    ledger, owner = WorkspaceLedger(), Owner()

    class OnlyScale:
        def __init__(self):
            self._scale_inv = torch.ones(1)

    assert ledger.record(owner, "m", "weight", WorkspaceKind.CACHED, _plan(), OnlyScale()) is None


def test_a_storage_resized_to_nothing_is_freed(q, weight):
    """FSDP2 frees a gathered parameter by resizing its storage to 0 bytes
    (the storage object lives on, to be refilled at the next gather)."""
    ledger, owner = WorkspaceLedger(), Owner()
    handle = q.quantize(weight, rowwise=True, columnwise=False)
    ledger.record(owner, "m", "weight", WorkspaceKind.GATHERED, _plan(), handle, usage=Usage.ROWWISE)
    storage = handle.rowwise.untyped_storage()
    storage.resize_(0)
    assert ledger.live() == []
    storage.resize_(64 * 32)  # the next gather refills it: recorded again, as a new entry
    assert ledger.live() == []
    assert ledger.record(owner, "m", "weight", WorkspaceKind.GATHERED, _plan(), handle, usage=Usage.ROWWISE)
    assert ledger.live()[0].nbytes == 64 * 32 + 4


@pytest.mark.parametrize("field, kwargs, message", [
    ("kind", {"kind": "cached"}, r"kind must be a WorkspaceKind \(e\.g\. WorkspaceKind\.SAVED_FOR_BACKWARD\); received 'cached' \(str\)"),
    ("usage", {"usage": "rowwise"}, r"usage must be a Usage \(e\.g\. Usage\.BOTH\); received 'rowwise'"),
    ("plan", {"plan": "cache=fill"}, r"plan must be a WorkspacePlan .* or None .*received 'cache=fill' \(str\)"),
])
def test_record_rejects_arguments_of_the_wrong_type(q, weight, field, kwargs, message):
    from workspace_manager import ContextTypeError

    args = {"kind": WorkspaceKind.CACHED, "plan": _plan(), "usage": Usage.BOTH, **kwargs}
    handle = q.quantize(weight, rowwise=True, columnwise=False)
    with pytest.raises(ContextTypeError, match=message):
        WorkspaceLedger().record(Owner(), "m", "weight", args["kind"], args["plan"], handle, usage=args["usage"])
