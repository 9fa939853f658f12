"""No weight copy outlives its source (issue #36), in the reference runtime.

The runtime keeps the weight's data version (what the bytes are) apart from
what a binding can observe (the version counter, the optimizer-step
generation). Three writers change the data: a torch.optim step, a silent
optimizer write (FusedAdam on FP8 parameters: no version counter moves,
only the step hook fires) and an in-place write (the counter moves, no
step). Kept copies are refreshed by the observation alone; every read is
checked against the data. These tests show that the two observations
together keep every shipped policy from reading stale data, and that with
either one missing a stale read is found.
"""

from __future__ import annotations

import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from workspace_manager import Microbatch, MicrobatchCache, RecomputeWorkspacePolicy, WeightSource, WorkspaceContext
from workspace_manager._profiles import FLOAT8_DELAYED_SCALING, MXFP8
from workspace_manager.testing import (
    FakeQuantizer,
    Freshness,
    LifecycleSession,
    ModuleRuntime,
    RuntimeModelError,
    WeightWrite,
)
from workspace_manager.testing._model import Observed
from workspace_manager.testing.invariants import SHIPPED_POLICIES
from workspace_manager.testing.lifecycle import WorkspaceLifecycleMachine
from workspace_manager.testing.reference import REFERENCE_CAPABILITIES, Float8PerTensorQuantizer

#: For each write, the one check that would miss it: the runtime that
#: watches only the other reads stale data after it.
BLIND_TO = {
    WeightWrite.SILENT_OPTIMIZER_WRITE: Freshness.VERSION_COUNTER,
    WeightWrite.INPLACE_WRITE: Freshness.STEP_GENERATION,
}


def _forward_backward(rt: ModuleRuntime, microbatch: Microbatch = Microbatch.NONE) -> None:
    rt.forward(WorkspaceContext(capabilities=rt.quantizer.capabilities, weight=rt.weight, microbatch=microbatch))
    rt.backward()


@pytest.mark.parametrize(
    "write, seen",
    [
        (WeightWrite.OPTIMIZER_STEP, Observed(counter=1, generation=1)),
        (WeightWrite.SILENT_OPTIMIZER_WRITE, Observed(counter=0, generation=1)),
        (WeightWrite.INPLACE_WRITE, Observed(counter=1, generation=0)),
    ],
    ids=lambda v: v.name if isinstance(v, WeightWrite) else "",
)
def test_every_write_changes_the_data_and_moves_what_its_writer_moves(write, seen):
    rt = ModuleRuntime(FakeQuantizer(MXFP8))
    rt.write(write)
    assert (rt.version, rt.observed) == (1, seen)


@pytest.mark.parametrize("write", list(BLIND_TO), ids=lambda w: w.name)
def test_a_cache_made_before_a_write_is_made_again_though_the_caller_says_later(write):
    """The caller says "later microbatch" (is_first_microbatch=False) after
    the weight changed: the plan says REUSE, the runtime quantizes again."""
    rt = ModuleRuntime(FakeQuantizer(MXFP8))
    _forward_backward(rt, Microbatch.FIRST)
    rt.write(write)
    _forward_backward(rt, Microbatch.LATER)
    assert rt.quantizer.quantizations == 2 and rt.cache.version == 1


@pytest.mark.parametrize("write", list(BLIND_TO), ids=lambda w: w.name)
def test_a_runtime_blind_to_a_write_reuses_a_stale_cache(write):
    rt = ModuleRuntime(FakeQuantizer(MXFP8), freshness=BLIND_TO[write])
    _forward_backward(rt, Microbatch.FIRST)
    rt.write(write)
    with pytest.raises(RuntimeModelError, match="stale read: forward's cache workspace was made from weight data "
                                                "version 0, but the weight's data is at version 1"):
        rt.forward(WorkspaceContext(capabilities=MXFP8, microbatch=Microbatch.LATER))


def _whole_fp8_parameter(freshness: Freshness = Freshness.FULL) -> ModuleRuntime:
    return ModuleRuntime(FakeQuantizer(FLOAT8_DELAYED_SCALING), weight=WeightSource.QUANTIZED_PARAM,
                         freshness=freshness)


@pytest.mark.parametrize("write", list(BLIND_TO), ids=lambda w: w.name)
def test_a_whole_quantized_parameter_derives_its_transpose_again_after_a_write(write):
    """Unsharded, the FP8 parameter keeps its transpose from step to step
    (its plans release nothing); after a write dgrad derives it again."""
    rt = _whole_fp8_parameter()
    _forward_backward(rt)
    assert rt.param.derived.version == 0  # built with the parameter, read, kept
    rt.write(write)
    _forward_backward(rt)
    assert rt.param.derived.version == 1 and rt.param.derived.observed == rt.observed


@pytest.mark.parametrize("write", list(BLIND_TO), ids=lambda w: w.name)
def test_a_runtime_blind_to_a_write_reads_a_stale_transpose_in_dgrad(write):
    """TE 2.20.2 with FusedAdam and DelayedScaling FP8 parameters: the
    transpose flagged valid is read by the next backward."""
    rt = _whole_fp8_parameter(BLIND_TO[write])
    _forward_backward(rt)
    rt.write(write)
    rt.forward(WorkspaceContext(capabilities=FLOAT8_DELAYED_SCALING, weight=WeightSource.QUANTIZED_PARAM))
    with pytest.raises(RuntimeModelError, match="stale read: the quantized parameter's derived columnwise data"):
        rt.backward()


def test_the_session_sees_a_stale_copy_before_it_is_read():
    session = LifecycleSession(_whole_fp8_parameter(Freshness.VERSION_COUNTER), use_microbatches=False)
    session.check_invariants()
    session.silent_optimizer_write()
    with pytest.raises(AssertionError, match="stale copy: the quantized parameter's derived columnwise data was made "
                                             "from weight data version 0, the weight's data is at version 1"):
        session.check_invariants()


def test_a_write_between_forward_and_backward_is_refused():
    rt = _whole_fp8_parameter()
    rt.forward(WorkspaceContext(capabilities=FLOAT8_DELAYED_SCALING, weight=WeightSource.QUANTIZED_PARAM))
    with pytest.raises(RuntimeModelError, match="silent optimizer write with backward still pending"):
        rt.silent_optimizer_write()


# -- the state machine ----------------------------------------------------------
def _run(machine, *, examples: int, steps: int, **extra) -> None:
    run_state_machine_as_test(
        machine,
        settings=settings(max_examples=examples, stateful_step_count=steps, deadline=None, database=None,
                          report_multiple_bugs=False, phases=[Phase.explicit, Phase.generate], **extra),
    )


def _policy_id(policy) -> str:
    if isinstance(policy, RecomputeWorkspacePolicy):
        return f"recompute[{_policy_id(policy.inner)}]-{policy.recompute_copy.value}"
    cached = getattr(policy, "microbatch_cache", MicrobatchCache.OFF) is not MicrobatchCache.OFF
    return policy.label + ("-microbatch_cache" if cached else "")


@pytest.mark.parametrize("policy", SHIPPED_POLICIES, ids=_policy_id)
def test_no_shipped_policy_reads_a_stale_copy_of_the_reference_quantizer(policy):
    """Each shipped policy pinned in every setting it plans, on the reference
    quantizer's real bytes, through every write: the freshness checks keep
    every read current whatever the policy kept."""
    machine = WorkspaceLifecycleMachine.for_quantizer(
        Float8PerTensorQuantizer, REFERENCE_CAPABILITIES, shape=(16, 32), policy=policy
    )
    _run(machine, examples=20, steps=25)


def test_a_machine_pins_one_policy_or_every_option_not_both():
    with pytest.raises(TypeError, match="not both"):
        WorkspaceLifecycleMachine.with_options().for_quantizer(
            Float8PerTensorQuantizer, REFERENCE_CAPABILITIES, policy=SHIPPED_POLICIES[0])


@pytest.mark.parametrize("blind", [Freshness.VERSION_COUNTER, Freshness.STEP_GENERATION, Freshness.NONE],
                         ids=lambda f: f.name)
def test_the_state_machine_finds_a_stale_read_when_a_freshness_check_is_dropped(blind):
    class Blind(WorkspaceLifecycleMachine.for_quantizer(Float8PerTensorQuantizer, REFERENCE_CAPABILITIES,
                                                        shape=(16, 32))):
        freshness = blind

    with pytest.raises(AssertionError, match="stale"):
        # derandomize: whether the search finds it does not depend on the seed
        _run(Blind, examples=300, steps=20, derandomize=True)


def test_the_state_machine_reaches_the_writes_and_distrusts_the_copies_they_leave_behind(monkeypatch):
    """The new events run, and after them the runtime refuses to trust a
    copy it kept (a cache or a transpose made from older data)."""
    seen = {"silent_optimizer_write": 0, "inplace_write": 0, "distrusted": 0}

    def counting(name, original):
        def event(self, *args):
            seen[name] += 1
            return original(self, *args)
        return event

    for name in ("silent_optimizer_write", "inplace_write"):
        monkeypatch.setattr(LifecycleSession, name, counting(name, getattr(LifecycleSession, name)))
    trusts = ModuleRuntime.trusts

    def counting_trusts(self, made):
        trusted = trusts(self, made)
        seen["distrusted"] += not trusted
        return trusted

    monkeypatch.setattr(ModuleRuntime, "trusts", counting_trusts)
    _run(WorkspaceLifecycleMachine.for_quantizer(Float8PerTensorQuantizer, REFERENCE_CAPABILITIES, shape=(16, 32)),
         examples=30, steps=25, derandomize=True)
    assert all(seen.values()), seen
