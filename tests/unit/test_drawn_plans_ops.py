"""Any valid plan for a te.ops op runs as planned, or is refused by name
(CPU, the te.ops stand-ins): the drawn-plan test of ``test_drawn_plans``
for ``te.ops.BasicLinear`` (alone, fused with a bias, in a Sequential) and
``te.ops.GroupedLinear``.

Hypothesis draws a setting (sharding, backward_override, fusion, plain /
no_grad / te.checkpoint reentrant or not, input grad) and, through the same
:class:`DrawnPlanPolicy` chooser, a plan for every context. Each run either
is refused at the call with a PolicyMismatchError naming a plan field and
the context, or gives outputs and gradients equal to a stock twin's; in a
plain training call, what each weight's forward quantizes, what is saved
for backward (from the fuser's ctx) and what backward rebuilds or
dequantizes must be what the plan says. It draws three times the Hypothesis
profile's max_examples (each takes milliseconds).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

import _fake_te
import _fake_te_ops as ops
from _fake_te_ops_grouped import GroupedLinear
from _examples import scaled
from test_drawn_plans import _HYPOTHESIS, _assert_refusal_names_the_plan, _drawing
from test_ops_binding import IN, OUT, _sharded, _usages, ti  # noqa: F401  (the fixture)
from workspace_manager import PolicyMismatchError, Sharding, Usage

GROUPS, TOKENS = 2, 4


@dataclass(frozen=True)
class OpsSetting:
    sharding: Sharding
    override: str | None
    fuse: bool
    mode: str  # plain, no_grad, reentrant, non_reentrant
    input_grad: bool
    grouped: bool
    #: Draw among the plans the rules accept (most of the others are refused,
    #: which the runs without it test).
    supported: bool


@st.composite
def ops_settings(draw) -> OpsSetting:
    mode = draw(st.sampled_from(["plain", "plain", "plain", "no_grad", "reentrant", "non_reentrant"]))
    return OpsSetting(
        sharding=draw(st.sampled_from([Sharding.NONE, Sharding.FSDP2_RESHARD, Sharding.FSDP2_KEEP])),
        override=draw(st.sampled_from([None, "high_precision", "dequantized"])), fuse=draw(st.booleans()),
        mode=mode, input_grad=True if mode == "reentrant" else draw(st.booleans()), grouped=draw(st.booleans()),
        supported=draw(st.sampled_from([True, True, True, False])),
    )


def _model(setting: OpsSetting):
    first = GroupedLinear(GROUPS, IN, OUT, seed=5) if setting.grouped else ops.Linear(IN, OUT, seed=3)
    return ops.Sequential(first, ops.Linear(OUT, IN, bias=False, seed=4))


def _drop_ins(model) -> list:
    return [m for m in model.modules() if type(m).__name__.startswith("Ops")]


def _run(model, setting: OpsSetting):
    x = torch.randn(TOKENS, IN, generator=torch.Generator().manual_seed(9)).requires_grad_(setting.input_grad)
    if setting.mode == "no_grad":
        with torch.no_grad():
            return [model(x)], []
    if setting.mode == "plain":
        out = model(x)
    else:
        out = _fake_te.checkpoint(model, x, use_reentrant=setting.mode == "reentrant")
    objects = list(getattr(out.grad_fn, "tensor_objects", None) or []) if setting.mode == "plain" else []
    out.square().sum().backward()
    return [out, x.grad, *[p.grad for p in model.parameters()]], objects


def _plans(ti, model) -> list:
    """Each drop-in's plans in call order (the grouped op's groups share one)."""
    return [next(iter(ti.modules.last_plans(op).values()))[1] for op in _drop_ins(model)]


def _check_plain(ti, managed, setting: OpsSetting, objects, logs) -> None:
    forward, rebuilt, dequantized = logs
    plans = _plans(ti, managed)
    counts = [GROUPS if setting.grouped and i == 0 else 1 for i in range(len(plans))]
    fp8_forward = [u for p, n in zip(plans, counts) for u in [_usages(p.forward_usage)] * n]
    assert forward == fp8_forward, (forward, [p.summary() for p in plans])
    saved = [o for o in objects if isinstance(o, _fake_te.Workspace)]
    wanted = [p for p, n in zip(plans, counts) for _ in range(n) if p.backward_source.value == "saved_workspace"]
    assert [o.get_usages() for o in saved] == [_usages(p.backward_usage) for p in wanted]
    # The stand-in logs BasicLinear's backward (GroupedLinear's rebuild is checked by its numerics).
    linears = plans[1:] if setting.grouped else plans
    if setting.override == "dequantized":  # dgrad dequantizes what is kept or rebuilt, never the weight itself
        assert dequantized == [_usages(p.backward_usage) for p in reversed(linears)] and rebuilt == []
    elif setting.override is None:
        rebuild = [p for p in reversed(linears) if p.backward_source.value == "requantize"]
        assert rebuilt == [_usages(p.backward_usage) for p in rebuild]


def _accepted(ctx, plan) -> bool:
    """Whether the binding's rules (the modules' and te.ops's) accept ``plan``."""
    import sys

    modules = sys.modules["te_integration.runtime._plan_support"]
    ops_rules = sys.modules["te_integration.runtime._plan_support_ops"]
    return modules.unsupported_reason(ctx, plan) is None and ops_rules.ops_unsupported_reason(ctx, plan) is None


def _carried_out_or_refused(ti, setting: OpsSetting, data) -> None:
    for log in (ops.FORWARD, ops.REBUILT, ops.DEQUANTIZED):
        log.clear()
    ops._STATE["override"], ops._STATE["fuse"] = setting.override, setting.fuse
    policy = _drawing(data, _accepted) if setting.supported else _drawing(data)
    stock, managed = _model(setting), _model(setting)
    ti.modules.convert_model(managed)
    for op in _drop_ins(managed):
        _sharded(ti, op, setting.sharding, policy)
    try:
        got, objects = _run(managed, setting)
    except PolicyMismatchError as err:
        _assert_refusal_names_the_plan(err)
        event("refused")
        return
    event(f"ran: {setting.mode}")
    logs = (list(ops.FORWARD), list(ops.REBUILT), list(ops.DEQUANTIZED))
    want, _ = _run(stock, setting)
    for a, b in zip(want, got):
        assert (a is None and b is None) or torch.equal(a, b), "numerics differ from stock"
    if setting.mode == "plain" and setting.input_grad:
        _check_plain(ti, managed, setting, objects, logs)


@pytest.fixture(autouse=True)
def _switches(monkeypatch):
    monkeypatch.setitem(ops._STATE, "fuse", True)
    monkeypatch.setitem(ops._STATE, "override", None)


#: A te.ops example takes milliseconds and draws its setting too, so it draws more.
@settings(_HYPOTHESIS, max_examples=scaled(3))
@given(setting=ops_settings(), data=st.data())
def test_every_drawn_te_ops_plan_is_carried_out_or_refused_by_name(ti, setting, data):
    _carried_out_or_refused(ti, setting, data)
