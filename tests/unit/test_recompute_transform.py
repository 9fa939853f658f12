"""A recompute pass's plan is one transform of the inner policy's plan
(``recompute_pass_plan``), and it plans what the recompute wrapper planned
before the transform existed.

``data/recompute_plans_before_the_transform.json`` holds, per shipped
recompute policy (either ``recompute_copy``, every inner policy with and
without its options) and per capability set (the TE profiles and every
combination of the three flags: ``_spaces.CAPABILITIES``), a SHA-256 of
every plan (or error) over every valid context, recorded with the code
before the transform (the duck-typed ``_RecomputeCall``).
``data/recompute_plans_before_the_transform.plans.json.gz`` holds those
plans themselves, so that a difference names its context and both plans:
each distinct outcome once (``outcomes``: a plan's repr, or an error's type
and message) and, per policy and capability set, the index of each
context's outcome, in ``valid_contexts`` order. It was written from the
plans the digests were checked against; the first test below checks it
against the digests, so it holds exactly the recorded plans.

The record predates the quantized all-gather (``ShardGather``,
``WorkspacePlan.workspace_origin``, ``QuantizedGather``,
``shard_quantization_exact``). It is compared over the contexts it holds
(no quantized all-gather set up), for the policies and capability sets it
holds, with the new fields' renderings taken out of what is compared
(:func:`_as_recorded`); where they are not at their old meaning (a
workspace made from the shard), nothing is taken out and the comparison fails.
"""

from __future__ import annotations

import abc
import gzip
import hashlib
import inspect
import json
from pathlib import Path

import pytest
from _spaces import CAPABILITIES, FLAG_SETS, every_context, holds_for_each

from workspace_manager import (
    FSDP2WorkspacePolicy,
    InvalidContextError,
    Policy,
    QuantizedGather,
    QuantizerCapabilities,
    RecomputeCopy,
    RecomputePass,
    RecomputeWorkspacePolicy,
    WorkspaceContext,
    WorkspacePolicy,
    resolve_policy,
)
from workspace_manager.extending import PROFILES
from workspace_manager._context import ShardGather, valid_contexts
from workspace_manager._policy import inner_policy_context, recompute_pass_plan
from workspace_manager.testing.invariants import SHIPPED_POLICIES

DATA = Path(__file__).parent / "data"
RECORDED = json.loads((DATA / "recompute_plans_before_the_transform.json").read_text())
_PLANS = json.loads(gzip.decompress((DATA / "recompute_plans_before_the_transform.plans.json.gz").read_bytes()))
WRAPPERS = tuple(p for p in SHIPPED_POLICIES if isinstance(p, RecomputeWorkspacePolicy))
#: What the record predates, as reprs render it where it keeps the old meaning.
_NEW_FIELDS = (", shard_quantization_exact=True", ", shard_quantization_exact=False",
               ", shard_gather=<ShardGather.NONE: 'none'>", ", workspace_origin=<WorkspaceOrigin.CALL: 'call'>",
               ", quantized_gather=<QuantizedGather.AUTO: 'auto'>")


def _as_recorded(text: str) -> str:
    for rendering in _NEW_FIELDS:
        text = text.replace(rendering, "")
    return text.replace("(quantized_gather=<QuantizedGather.AUTO: 'auto'>)", "()")


#: The recompute wrappers and capability sets the record holds, and its contexts.
RECORDED_WRAPPERS = tuple(p for p in WRAPPERS if _as_recorded(repr(p)) in RECORDED)
RECORDED_CAPABILITIES = tuple(c for c in CAPABILITIES if c in FLAG_SETS or c.name in PROFILES)


def _contexts(caps: QuantizerCapabilities):
    return valid_contexts(caps, gathers=[ShardGather.NONE])
QUESTIONS = ("cache_action", "forward_usage", "backward_source", "columnwise_source", "release", "parameter_keeps")


def _key(caps: QuantizerCapabilities) -> str:
    return (f"{caps.name} derivable={caps.columnwise_derivable} derived_caches={caps.derived_caches} "
            f"exact={caps.requantization_safe}")


def _outcomes(policy: RecomputeWorkspacePolicy, caps: QuantizerCapabilities) -> list[str]:
    """What ``policy`` plans for every valid context with ``caps``, in order:
    the plan's repr, or the error's type and message (recorded too)."""
    found = []
    for ctx in _contexts(caps):
        try:
            found.append(_as_recorded(repr(policy.plan(ctx))))
        except Exception as err:  # an outcome to compare, not swallowed: the test compares it
            found.append(_as_recorded(f"{type(err).__name__}: {err}"))
    return found


def _recorded(policy: RecomputeWorkspacePolicy, caps: QuantizerCapabilities) -> list[str]:
    return [_PLANS["outcomes"][i] for i in _PLANS["plans"][_as_recorded(repr(policy))][_key(caps)]]


def _digest(outcomes: list[str], caps: QuantizerCapabilities) -> str:
    lines = (f"{_as_recorded(repr(ctx))} -> {got}" for ctx, got in zip(_contexts(caps), outcomes, strict=True))
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def _first_difference(policy, caps: QuantizerCapabilities, now: list[str], then: list[str]) -> str | None:
    """None where the two agree; else which context planned differently first, with both plans."""
    differ = [i for i, (a, b) in enumerate(zip(now, then, strict=True)) if a != b]
    if not differ:
        return None
    ctx = list(_contexts(caps))[differ[0]]
    return (f"{policy!r} with {_key(caps)}: {len(differ)} of {len(now)} contexts plan differently than before the "
            f"transform; the first:\n  context:  {ctx!r}\n  recorded: {then[differ[0]]}\n  now:      {now[differ[0]]}")


def test_the_record_covers_every_shipped_recompute_policy_and_capability_set():
    """Every shipped wrapper but those of the quantized gather's options, which the record predates."""
    assert sorted(RECORDED) == sorted(_PLANS["plans"]) == sorted(_as_recorded(repr(p)) for p in RECORDED_WRAPPERS)
    newer = {p.inner.quantized_gather for p in WRAPPERS if p not in RECORDED_WRAPPERS}
    assert newer == {QuantizedGather.ON, QuantizedGather.OFF}
    keys = sorted(_key(c) for c in RECORDED_CAPABILITIES)
    assert all(sorted(v) == keys for v in (*RECORDED.values(), *_PLANS["plans"].values()))


def test_the_plans_on_record_are_the_ones_whose_digests_were_recorded():
    for policy in RECORDED_WRAPPERS:
        for caps in RECORDED_CAPABILITIES:
            digest = RECORDED[_as_recorded(repr(policy))][_key(caps)]
            assert _digest(_recorded(policy, caps), caps) == digest, (policy, _key(caps))


@pytest.mark.parametrize("policy", RECORDED_WRAPPERS, ids=repr)
def test_every_plan_is_the_one_recorded_before_the_transform(policy):
    found = (_first_difference(policy, c, _outcomes(policy, c), _recorded(policy, c)) for c in RECORDED_CAPABILITIES)
    first = next((f for f in found if f is not None), None)
    if first is not None:
        pytest.fail(first, pytrace=False)


def test_a_difference_names_its_context_and_both_plans():
    policy, caps = RECORDED_WRAPPERS[0], RECORDED_CAPABILITIES[0]
    then = _recorded(policy, caps)
    now = [*then[:3], "a changed plan", *then[4:]]
    found = _first_difference(policy, caps, now, then)
    assert found.startswith(f"{policy!r} with {_key(caps)}: 1 of {len(then)} contexts")
    assert f"context:  {list(_contexts(caps))[3]!r}" in found
    assert f"recorded: {then[3]}" in found and "now:      a changed plan" in found


def _recompute_pass_contexts():
    """Every recompute-pass context; the transform reads the three facts, not the quantizer's name."""
    return (ctx for ctx in every_context(FLAG_SETS) if ctx.recompute is not RecomputePass.NONE)


def test_a_recompute_pass_is_planned_by_the_transform_of_the_inner_plan():
    def check(ctx, policy):
        inner_plan = policy.inner.plan(inner_policy_context(ctx))
        assert policy.plan(ctx) == recompute_pass_plan(ctx, inner_plan, policy.recompute_copy)

    cases = ((ctx, p) for ctx in _recompute_pass_contexts() for p in WRAPPERS if p.covers(ctx))
    assert holds_for_each(check, cases) > 10_000


def test_the_selected_policy_plans_a_recompute_pass_by_the_transform():
    def check(ctx):
        policy = resolve_policy(ctx)
        assert isinstance(policy, RecomputeWorkspacePolicy)
        inner_plan = policy.inner.plan(inner_policy_context(ctx))
        assert policy.plan(ctx) == recompute_pass_plan(ctx, inner_plan, RecomputeCopy.AS_TE)

    assert holds_for_each(check, ((ctx,) for ctx in _recompute_pass_contexts())) > 5_000


def test_outside_recompute_the_wrapper_plans_as_its_inner_policy():
    def check(ctx, policy):
        assert policy.plan(ctx) == policy.inner.plan(ctx)

    plain = (ctx for ctx in every_context(FLAG_SETS) if ctx.recompute is RecomputePass.NONE)
    assert holds_for_each(check, ((ctx, p) for ctx in plain for p in WRAPPERS if p.covers(ctx))) > 5_000


def test_the_inner_policy_plans_the_steps_real_forward():
    def check(ctx):
        step = inner_policy_context(ctx)
        assert step.recompute is RecomputePass.NONE and step.grad_enabled
        assert step == WorkspaceContext(**{**{f: getattr(ctx, f) for f in ctx.__dataclass_fields__},
                                          "recompute": RecomputePass.NONE, "recompute_scope": step.recompute_scope,
                                          "grad_enabled": True})

    assert holds_for_each(check, ((ctx,) for ctx in _recompute_pass_contexts())) > 5_000


def test_the_transform_plans_recompute_passes_only():
    ctx = WorkspaceContext(capabilities=PROFILES["mxfp8"])
    with pytest.raises(InvalidContextError, match="recompute passes only"):
        recompute_pass_plan(ctx, WorkspacePolicy().plan(ctx), RecomputeCopy.AS_TE)


def test_the_wrapper_answers_no_question_and_inherits_none():
    """The six methods are asked only of WorkspacePolicy and its
    subclasses; the wrapper is a Policy apart from them: it neither defines
    nor inherits any of them, and it inherits nothing from Policy but
    ``covers``, which it uses."""
    assert not issubclass(RecomputeWorkspacePolicy, WorkspacePolicy)
    assert RecomputeWorkspacePolicy.__mro__[1:] == (Policy, abc.ABC, object)
    assert not [name for name in QUESTIONS if hasattr(RecomputeWorkspacePolicy, name)]
    inherited = {n for n, v in vars(Policy).items() if inspect.isfunction(v) and n not in vars(RecomputeWorkspacePolicy)}
    assert inherited == {"covers"}
    own = vars(RecomputeWorkspacePolicy)
    assert not [name for name, value in own.items() if isinstance(value, property)]
    assert set(n for n, v in own.items() if inspect.isfunction(v)) <= {"__post_init__", "check_context",
                                                                        "plan", "_check_inner", "__init__", "__repr__",
                                                                        "__eq__", "__hash__", "__setattr__",
                                                                        "__delattr__", "__getstate__", "__setstate__"}


def test_what_a_policy_provides_is_abstract_and_every_shipped_policy_provides_it():
    with pytest.raises(TypeError, match="abstract"):
        Policy()
    assert all(isinstance(p, Policy) for p in SHIPPED_POLICIES)
    assert {p.recompute_passes for p in SHIPPED_POLICIES} == {frozenset({RecomputePass.NONE}), frozenset(RecomputePass)}
    assert all(p.recompute_passes == frozenset(RecomputePass) for p in WRAPPERS)


def test_the_wrapper_plans_its_inner_policys_shardings_as_a_value():
    fsdp2 = RecomputeWorkspacePolicy(inner=FSDP2WorkspacePolicy())
    assert fsdp2.shardings == FSDP2WorkspacePolicy.shardings
    assert RecomputeWorkspacePolicy().shardings == WorkspacePolicy.shardings
    # Derived, not a field: equality, hashing and repr are inner's and recompute_copy's.
    assert fsdp2 == RecomputeWorkspacePolicy(inner=FSDP2WorkspacePolicy()) and hash(fsdp2) == hash(
        RecomputeWorkspacePolicy(inner=FSDP2WorkspacePolicy()))
    assert repr(fsdp2) == ("RecomputeWorkspacePolicy(inner=FSDP2WorkspacePolicy(microbatch_cache="
                           "<MicrobatchCache.OFF: 'off'>, quantized_gather=<QuantizedGather.AUTO: 'auto'>), "
                           "recompute_copy=<RecomputeCopy.AS_TE: 'as_te'>)")
