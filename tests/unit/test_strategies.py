"""The Hypothesis strategies the package ships for quantizer and policy
authors (``workspace_manager.testing.strategies``) draw from the space the
core's own tests enumerate (``_spaces``): valid contexts, and policies
that plan them."""

from __future__ import annotations

import functools

from hypothesis import given
from hypothesis import strategies as st

from workspace_manager import QuantizerCapabilities, WorkspaceContext
from workspace_manager.testing.invariants import all_contexts
from workspace_manager.testing.plans import meaningful_plans
from workspace_manager.testing.strategies import contexts, covering_policies, valid_plans


@functools.cache
def _every(caps: QuantizerCapabilities) -> frozenset[WorkspaceContext]:
    return frozenset(all_contexts(caps))


@given(contexts())
def test_a_drawn_context_is_a_valid_one(ctx):
    assert ctx in _every(ctx.capabilities)


@given(covering_policies())
def test_a_drawn_policy_plans_its_context(pair):
    policy, ctx = pair
    assert policy.covers(ctx)
    policy.plan(ctx)


@given(st.data())
def test_a_drawn_plan_is_a_meaningful_one(data):
    ctx = data.draw(contexts())
    assert data.draw(valid_plans(ctx)) in meaningful_plans(ctx)
