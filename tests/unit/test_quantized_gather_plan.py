"""Where an FSDP2 weight's workspace is made (docs/decisions.md, D13): the
decision table of the FSDP2 policy's rule, the plans it makes, the plans and
contexts it refuses, and ``explain`` showing it.

The rule: from the shard (``WorkspaceOrigin.SHARD``) only where a quantized
all-gather is set up (``ShardGather``), for formats whose shard quantization
is exact; with ``QuantizedGather.AUTO`` over many ranks only, with ``ON``
over one rank too, with ``OFF`` never.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
from _spaces import every_context, holds_for_each

from workspace_manager import (
    BackwardOverride,
    BackwardSource,
    CacheAction,
    ColumnwiseSource,
    ContextTypeError,
    FSDP2WorkspacePolicy,
    InvalidContextError,
    InvalidPlanError,
    KeepForBackwardWorkspacePolicy,
    QuantizedGather,
    RecomputePass,
    RecomputeWorkspacePolicy,
    Release,
    ShardGather,
    Sharding,
    Usage,
    WeightSource,
    WorkspaceContext,
    WorkspaceOrigin,
    WorkspacePlan,
    WorkspacePolicy,
    explain,
    plan_call,
)
from workspace_manager.extending import PROFILES, shard_gather_refusal

EXACT = ("float8_current_scaling", "float8_block_2d")
ONE, MANY, NONE = ShardGather.ONE_RANK, ShardGather.MANY_RANKS, ShardGather.NONE
AUTO, ON, OFF = QuantizedGather.AUTO, QuantizedGather.ON, QuantizedGather.OFF


def _ctx(profile: str = "float8_current_scaling", **fields) -> WorkspaceContext:
    base = dict(capabilities=PROFILES[profile], sharding=Sharding.FSDP2_RESHARD, shard_gather=MANY)
    return WorkspaceContext(**{**base, **fields})


#: (gather, option) -> whether an exact format's workspace is made from the shard.
RULE = {
    (NONE, AUTO): False, (NONE, ON): False, (NONE, OFF): False,
    (ONE, AUTO): False, (ONE, ON): True, (ONE, OFF): False,
    (MANY, AUTO): True, (MANY, ON): True, (MANY, OFF): False,
}


@pytest.mark.parametrize("profile", sorted(PROFILES))
@pytest.mark.parametrize("gather, option", sorted(RULE, key=str), ids=str)
def test_the_decision_table(profile, gather, option):
    policy = FSDP2WorkspacePolicy(quantized_gather=option)
    for sharding in (Sharding.FSDP2_RESHARD, Sharding.FSDP2_KEEP):
        plan = policy.plan(_ctx(profile, sharding=sharding, shard_gather=gather))
        expected = RULE[gather, option] and profile in EXACT
        assert (plan.workspace_origin is WorkspaceOrigin.SHARD) is expected, (profile, gather, option, plan.notes)
        if gather is not NONE and not expected:
            why = next(n for n in plan.notes if n.startswith("made in the call, not from the shard: "))
            if option is OFF:
                assert "QuantizedGather.OFF" in why
            elif profile not in EXACT:
                assert PROFILES[profile].name in why
            else:
                assert "one rank" in why and "QuantizedGather.ON" in why


def test_the_capability_is_claimed_by_exactly_current_and_2d_block_scaling():
    assert sorted(name for name, caps in PROFILES.items() if caps.shard_quantization_exact) == sorted(EXACT)
    assert "DelayedScaling"  # its refusal names the capability it lacks:
    assert "shard_quantization_exact=False" in shard_gather_refusal(_ctx("float8_delayed_scaling"))


@pytest.mark.parametrize("fields, reason", [
    (dict(shard_gather=NONE), "no quantized all-gather is set up"),
    (dict(backward_override=BackwardOverride.HIGH_PRECISION), "dgrad reads the high-precision weight"),
])
def test_a_set_up_gather_of_an_exact_format_still_falls_back_where_it_must(fields, reason):
    ctx = _ctx(**fields)
    assert reason in shard_gather_refusal(ctx)
    assert FSDP2WorkspacePolicy(quantized_gather=ON).plan(ctx).workspace_origin is WorkspaceOrigin.CALL


def test_a_format_claiming_exactness_must_also_requantize_exactly_and_derive_columnwise():
    claims = replace(PROFILES["float8_current_scaling"], name="claims")
    for lacking, words in [("requantization_safe", "does not requantize exactly"),
                           ("columnwise_derivable", "cannot derive dgrad's columnwise data")]:
        ctx = replace(_ctx(), capabilities=replace(claims, **{lacking: False}))
        assert words in shard_gather_refusal(ctx)
        assert FSDP2WorkspacePolicy().plan(ctx).workspace_origin is WorkspaceOrigin.CALL


def test_from_the_shard_the_call_is_planned_as_the_weight_arrives():
    """Every plan made from the shard is the plan of the same call with the
    weight arriving quantized (a quantized parameter), save that the
    parameter keeps nothing quantized itself: it is high precision."""
    def check(ctx, policy):
        plan = policy.plan(ctx)
        if plan.workspace_origin is not WorkspaceOrigin.SHARD:
            return
        arrived = policy.plan(replace(ctx, weight=WeightSource.QUANTIZED_PARAM, shard_gather=NONE))
        assert plan == replace(arrived, parameter_keeps=Usage.NONE, workspace_origin=WorkspaceOrigin.SHARD)
        assert plan.notes[0].startswith("made from the shard before FSDP2's all-gather")

    policies = (FSDP2WorkspacePolicy(), FSDP2WorkspacePolicy(quantized_gather=ON), KeepForBackwardWorkspacePolicy(),
                RecomputeWorkspacePolicy(inner=FSDP2WorkspacePolicy()))
    cases = ((ctx, p) for ctx in every_context() if ctx.shard_gather is not NONE for p in policies if p.covers(ctx))
    assert holds_for_each(check, cases) > 1_000


def test_the_training_plan_from_the_shard():
    plan = FSDP2WorkspacePolicy().plan(_ctx())
    assert (plan.cache, plan.forward_usage, plan.backward_source, plan.backward_usage, plan.columnwise_source,
            plan.release, plan.parameter_keeps, plan.workspace_origin) == (
        CacheAction.BYPASS, Usage.ROWWISE, BackwardSource.SAVED_PARAMETER, Usage.COLUMNWISE, ColumnwiseSource.DERIVED,
        Release.DERIVED_COLUMNWISE, Usage.NONE, WorkspaceOrigin.SHARD)
    assert plan.summary().endswith(" origin=shard") and plan.to_dict()["workspace_origin"] == "shard"
    # Each pass of a te.checkpoint region receives the gathered weight as it is.
    recompute = RecomputeWorkspacePolicy(inner=FSDP2WorkspacePolicy())
    first = recompute.plan(_ctx(recompute=RecomputePass.FIRST, grad_enabled=False))
    again = recompute.plan(_ctx(recompute=RecomputePass.RECOMPUTE))
    assert first.workspace_origin is again.workspace_origin is WorkspaceOrigin.SHARD
    assert first.backward_source is BackwardSource.NONE and again.backward_source is BackwardSource.SAVED_PARAMETER


def _shard_plan(**fields) -> WorkspacePlan:
    base = dict(cache=CacheAction.BYPASS, forward_usage=Usage.ROWWISE, backward_source=BackwardSource.SAVED_PARAMETER,
                backward_usage=Usage.COLUMNWISE, columnwise_source=ColumnwiseSource.DERIVED,
                release=Release.DERIVED_COLUMNWISE, workspace_origin=WorkspaceOrigin.SHARD)
    return WorkspacePlan(**{**base, **fields})


@pytest.mark.parametrize("fields, words", [
    (dict(cache=CacheAction.FILL, release=Release.DERIVED_COLUMNWISE | Release.CACHED_WORKSPACE), "cache must be bypass"),
    (dict(forward_usage=Usage.BOTH), "rowwise data only"),
    (dict(backward_source=BackwardSource.REQUANTIZE, columnwise_source=ColumnwiseSource.REQUANTIZED),
     "as the gathered parameter"),
    (dict(columnwise_source=ColumnwiseSource.GATHERED), "derived after the gather"),
    (dict(parameter_keeps=Usage.ROWWISE), "parameter_keeps=none"),
])
def test_contradictory_plans_from_the_shard_are_refused_by_name(fields, words):
    assert _shard_plan().workspace_origin is WorkspaceOrigin.SHARD  # the plan without the change is valid
    with pytest.raises(InvalidPlanError, match=words):
        _shard_plan(**fields)


def test_a_plan_from_the_shard_where_nothing_is_set_up_is_refused_by_plan_call():
    class Eager(FSDP2WorkspacePolicy):
        def workspace_origin(self, ctx):
            return WorkspaceOrigin.SHARD

    with pytest.raises(InvalidPlanError, match="no quantized all-gather is set up for this weight"):
        plan_call(_ctx(shard_gather=NONE), Eager())
    with pytest.raises(InvalidPlanError, match="float8_delayed_scaling does not quantize a shard"):
        plan_call(_ctx("float8_delayed_scaling"), Eager())
    assert plan_call(_ctx(), Eager()).workspace_origin is WorkspaceOrigin.SHARD


@pytest.mark.parametrize("fields", [dict(sharding=Sharding.NONE), dict(sharding=Sharding.DISTRIBUTED_WEIGHT),
                                    dict(weight=WeightSource.QUANTIZED_PARAM)], ids=str)
def test_a_quantized_gather_is_fsdp2s_of_a_high_precision_weight(fields):
    with pytest.raises(InvalidContextError, match="describes FSDP2's all-gather of a high-precision weight"):
        _ctx(**fields)


def test_the_option_and_the_context_field_take_their_enums_only():
    with pytest.raises(ContextTypeError, match="QuantizedGather.AUTO"):
        FSDP2WorkspacePolicy(quantized_gather=True)
    with pytest.raises(ContextTypeError, match="ShardGather"):
        _ctx(shard_gather="many_ranks")
    assert [ShardGather.for_world_size(n) for n in (1, 2, 64)] == [ONE, MANY, MANY]
    with pytest.raises(ContextTypeError, match="at least 1"):
        ShardGather.for_world_size(0)


def test_the_plain_policy_makes_every_workspace_in_the_call():
    assert WorkspacePolicy().workspace_origin(_ctx()) is WorkspaceOrigin.CALL
    assert "WorkspacePolicy makes every workspace in the call" in WorkspacePolicy().gather_refusal(_ctx())


def test_explain_shows_it_with_gather_and_its_reasons_with_why():
    plain = explain("fsdp2", "Float8CurrentScaling")
    assert "gather:" not in plain and not any(line.split()[:1] == ["shard"] for line in plain.splitlines())
    table = explain("fsdp2", ["Float8CurrentScaling", "DelayedScaling"], gather=True, why=True)
    assert "fsdp2_reshard train hp_weight gather:many_ranks" in table.splitlines()
    assert re.search(r"^ +(mb:\w+ +)?shard +row +saved_param:col +derived +derived_col +-$", table, re.M)
    assert "why: made from the shard before FSDP2's all-gather, once per optimizer" in table
    assert "why: made in the call, not from the shard: one rank" in table
    assert "shard: made from the shard before FSDP2's all-gather" in " ".join(table.split())
    rows = json.loads(explain("fsdp2", "Float8CurrentScaling", as_json=True, gather=True))
    made = {(r["context"]["shard_gather"], r["plan"]["workspace_origin"]) for r in rows
            if r["context"]["weight"] == "high_precision"}
    assert made == {("none", "call"), ("one_rank", "call"), ("many_ranks", "shard")}
    on = json.loads(explain("fsdp2_quantized_gather_on", "Float8CurrentScaling", as_json=True, gather=True))
    assert {r["plan"]["workspace_origin"] for r in on if r["context"]["shard_gather"] == "one_rank"} == {"shard"}
