"""A recompute pass's plan is one transform of the inner policy's plan
(``recompute_pass_plan``), and it plans what the recompute wrapper planned
before the transform existed.

``data/recompute_plans_before_the_transform.json`` holds, per shipped
recompute policy (either ``recompute_copy``, every inner policy with and
without its options) and per capability set (the TE profiles and every
combination of the three flags), a SHA-256 of every plan (or error) over
every valid context, recorded with the code before the transform (the
duck-typed ``_RecomputeCall``). Every context the Hypothesis strategies draw
is one of these (up to the invented name, which only the notes print).
"""

from __future__ import annotations

import hashlib
import inspect
import itertools
import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from workspace_manager import (
    PROFILES,
    FSDP2WorkspacePolicy,
    InvalidContextError,
    QuantizerCapabilities,
    RecomputeCopy,
    RecomputePass,
    RecomputeWorkspacePolicy,
    WorkspaceContext,
    WorkspacePolicy,
    resolve_policy,
)
from workspace_manager._context import valid_contexts
from workspace_manager._policy import inner_policy_context, recompute_pass_plan
from workspace_manager.testing.invariants import SHIPPED_POLICIES
from workspace_manager.testing.strategies import contexts

RECORDED = json.loads((Path(__file__).parent / "data" / "recompute_plans_before_the_transform.json").read_text())
WRAPPERS = tuple(p for p in SHIPPED_POLICIES if isinstance(p, RecomputeWorkspacePolicy))
CAPABILITIES = sorted(PROFILES.values(), key=lambda c: c.name) + [
    QuantizerCapabilities(name="fake_a", columnwise_derivable=a, derived_caches=b, requantization_safe=c)
    for a, b, c in itertools.product([False, True], repeat=3)
]
QUESTIONS = ("cache_action", "forward_usage", "backward_source", "columnwise_source", "release", "parameter_keeps")


def _key(caps: QuantizerCapabilities) -> str:
    return (f"{caps.name} derivable={caps.columnwise_derivable} derived_caches={caps.derived_caches} "
            f"exact={caps.requantization_safe}")


def _digest(policy: RecomputeWorkspacePolicy, caps: QuantizerCapabilities) -> str:
    lines = []
    for ctx in valid_contexts(caps):
        try:
            got = repr(policy.plan(ctx))
        except Exception as err:  # an error's type and message are recorded too
            got = f"{type(err).__name__}: {err}"
        lines.append(f"{ctx!r} -> {got}")
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def test_the_record_covers_every_shipped_recompute_policy_and_capability_set():
    assert sorted(RECORDED) == sorted(repr(p) for p in WRAPPERS)
    assert all(sorted(v) == sorted(_key(c) for c in CAPABILITIES) for v in RECORDED.values())


@pytest.mark.parametrize("policy", WRAPPERS, ids=repr)
def test_every_plan_is_the_one_recorded_before_the_transform(policy):
    changed = [_key(c) for c in CAPABILITIES if _digest(policy, c) != RECORDED[repr(policy)][_key(c)]]
    assert not changed, f"{policy!r} plans differently than before the transform for: {changed}"


def _recompute_pass_contexts():
    return contexts(recompute=st.sampled_from([RecomputePass.FIRST, RecomputePass.RECOMPUTE]))


@given(_recompute_pass_contexts(), st.sampled_from(WRAPPERS))
def test_a_recompute_pass_is_planned_by_the_transform_of_the_inner_plan(ctx, policy):
    if not policy.covers(ctx):
        return
    inner_plan = policy.inner.plan(inner_policy_context(ctx))
    assert policy.plan(ctx) == recompute_pass_plan(ctx, inner_plan, policy.recompute_copy)


@given(_recompute_pass_contexts())
def test_the_selected_policy_plans_a_recompute_pass_by_the_transform(ctx):
    policy = resolve_policy(ctx)
    assert isinstance(policy, RecomputeWorkspacePolicy)
    inner_plan = policy.inner.plan(inner_policy_context(ctx))
    assert policy.plan(ctx) == recompute_pass_plan(ctx, inner_plan, RecomputeCopy.AS_TE)


@given(contexts(recompute=st.just(RecomputePass.NONE)), st.sampled_from(WRAPPERS))
def test_outside_recompute_the_wrapper_plans_as_its_inner_policy(ctx, policy):
    if policy.covers(ctx):
        assert policy.plan(ctx) == policy.inner.plan(ctx)


@given(_recompute_pass_contexts())
def test_the_inner_policy_plans_the_steps_real_forward(ctx):
    step = inner_policy_context(ctx)
    assert step.recompute is RecomputePass.NONE and step.grad_enabled
    assert step == WorkspaceContext(**{**{f: getattr(ctx, f) for f in ctx.__dataclass_fields__},
                                      "recompute": RecomputePass.NONE, "recompute_scope": step.recompute_scope,
                                      "grad_enabled": True})


def test_the_transform_plans_recompute_passes_only():
    ctx = WorkspaceContext(capabilities=PROFILES["mxfp8"])
    with pytest.raises(InvalidContextError, match="recompute passes only"):
        recompute_pass_plan(ctx, WorkspacePolicy().plan(ctx), RecomputeCopy.AS_TE)


def test_the_wrapper_answers_no_question_of_its_own():
    """One policy protocol: the six methods are asked only of base
    policies; the wrapper defines none of them, and no property."""
    own = vars(RecomputeWorkspacePolicy)
    assert not [name for name in QUESTIONS if name in own]
    assert not [name for name, value in own.items() if isinstance(value, property)]
    assert set(n for n, v in own.items() if inspect.isfunction(v)) <= {"__post_init__", "covers", "check_context",
                                                                        "plan", "_check_inner", "__init__", "__repr__",
                                                                        "__eq__", "__hash__", "__setattr__",
                                                                        "__delattr__", "__getstate__", "__setstate__"}


def test_the_wrapper_plans_its_inner_policys_shardings_as_a_value():
    fsdp2 = RecomputeWorkspacePolicy(inner=FSDP2WorkspacePolicy())
    assert fsdp2.shardings == FSDP2WorkspacePolicy.shardings
    assert RecomputeWorkspacePolicy().shardings == WorkspacePolicy.shardings
    # Derived, not a field: equality, hashing and repr are inner's and recompute_copy's.
    assert fsdp2 == RecomputeWorkspacePolicy(inner=FSDP2WorkspacePolicy()) and hash(fsdp2) == hash(
        RecomputeWorkspacePolicy(inner=FSDP2WorkspacePolicy()))
    assert repr(fsdp2) == ("RecomputeWorkspacePolicy(inner=FSDP2WorkspacePolicy(microbatch_cache="
                           "<MicrobatchCache.OFF: 'off'>), recompute_copy=<RecomputeCopy.AS_TE: 'as_te'>)")
