"""A Hypothesis state machine of the workspace lifecycle.

It drives :class:`~workspace_manager.testing.ModuleRuntime` through forward
(plain, first recompute pass, inference), backward, optimizer step,
microbatch and reshard events, and after every step checks that nothing a
plan said to free is still alive. Run it with::

    TestLifecycle = WorkspaceLifecycleMachine.TestCase
"""

from __future__ import annotations

from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from .._context import (
    BackwardOverride,
    Microbatch,
    RecomputePass,
    Sharding,
    WeightSource,
    WorkspaceContext,
)
from .._plan import BackwardSource, Release
from ._model import FakeQuantizer, ModuleRuntime
from .strategies import capabilities

__all__ = ["WorkspaceLifecycleMachine"]


class WorkspaceLifecycleMachine(RuleBasedStateMachine):
    """One module under the policy the manager selects for each call."""

    def __init__(self) -> None:
        super().__init__()
        self.runtime: ModuleRuntime | None = None
        self.use_microbatches = False
        self.forwards_this_step = 0
        self.step_plans: list = []

    @initialize(
        caps=capabilities(),
        sharding=st.sampled_from(list(Sharding)),
        weight=st.sampled_from(list(WeightSource)),
        use_microbatches=st.booleans(),
    )
    def setup(self, caps, sharding, weight, use_microbatches) -> None:
        self.runtime = ModuleRuntime(FakeQuantizer(caps, numel=1024), sharding=sharding, weight=weight)
        self.use_microbatches = use_microbatches
        note(f"module: {caps} sharding={sharding.name} weight={weight.name} microbatches={use_microbatches}")

    # -- events --------------------------------------------------------------
    @rule(
        grad=st.booleans(),
        input_requires_grad=st.booleans(),
        recompute=st.sampled_from([RecomputePass.NONE, RecomputePass.FIRST]),
        override=st.sampled_from(list(BackwardOverride)),
    )
    def forward(self, grad, input_requires_grad, recompute, override) -> None:
        rt = self.runtime
        ctx = WorkspaceContext(
            capabilities=rt.quantizer.capabilities,
            sharding=rt.sharding,
            recompute=recompute,
            grad_enabled=grad,
            input_requires_grad=input_requires_grad,
            weight=rt.weight,
            microbatch=self._microbatch(),
            backward_override=override,
        )
        plan = rt.forward(ctx)
        self.forwards_this_step += 1
        self.step_plans.append(plan)
        note(f"forward {ctx.recompute.name} grad={grad} mb={ctx.microbatch.name}: {plan.summary()}")

    @precondition(lambda self: self.runtime is not None and bool(self.runtime.pending))
    @rule()
    def backward(self) -> None:
        plan = self.runtime.backward()
        self.step_plans.append(plan)
        note(f"backward: {plan.summary()}")

    @precondition(lambda self: self.runtime is not None and not self.runtime.pending)
    @rule()
    def optimizer_step(self) -> None:
        self.runtime.optimizer_step()
        note("optimizer step")
        self._check_step_end()
        self.forwards_this_step = 0
        self.step_plans = []

    @precondition(lambda self: self.runtime is not None and not self.runtime.pending)
    @rule()
    def reshard(self) -> None:
        """FSDP2 reshards between microbatches or after the step."""
        self.runtime.reshard()
        note("reshard")
        if self.runtime.sharding.is_fsdp2:
            # FSDP2 frees only its own buffers: derived data must be gone by now (TE#2717).
            assert not self.runtime.param.derived_columnwise, "derived columnwise data survived a reshard"

    def _microbatch(self) -> Microbatch:
        if not self.use_microbatches:
            return Microbatch.NONE
        return Microbatch.FIRST if self.forwards_this_step == 0 else Microbatch.LATER

    def _check_step_end(self) -> None:
        rt = self.runtime
        asked = any(Release.CACHED_WORKSPACE in p.release for p in self.step_plans)
        if asked:
            assert rt.cache is None, "a plan released the cache after the step, but it is still alive"
        if rt.sharding is not Sharding.NONE:
            # No unsharded quantized copy may outlive a step of a sharded weight.
            assert rt.cache is None, f"cached workspace outlived the step under {rt.sharding.name}"

    # -- invariants ----------------------------------------------------------
    @invariant()
    def only_reachable_workspaces_are_alive(self) -> None:
        if self.runtime is None:
            return
        live = {ws.ident for ws in self.runtime.quantizer.live()}
        assert live == self.runtime.reachable(), f"alive {live} but reachable {self.runtime.reachable()}"

    @invariant()
    def fsdp2_reshard_keeps_no_quantized_copy(self) -> None:
        """TE#2681: under FSDP2 resharding after forward, no layer holds a
        quantized copy of its high-precision weight between forward and backward."""
        rt = self.runtime
        if rt is None or rt.sharding is not Sharding.FSDP2_RESHARD or rt.weight is not WeightSource.HIGH_PRECISION:
            return
        assert rt.quantizer.live_bytes() == 0, f"{rt.quantizer.live_bytes()} quantized bytes alive under FSDP2"

    @invariant()
    def idle_fsdp2_parameter_has_no_derived_data(self) -> None:
        rt = self.runtime
        if rt is None or rt.pending or not rt.sharding.is_fsdp2:
            return
        assert not rt.param.derived_columnwise, "derived columnwise data alive on an idle FSDP2 parameter"

    @invariant()
    def saved_workspaces_serve_their_backward(self) -> None:
        rt = self.runtime
        if rt is None:
            return
        for pending in rt.pending:
            if pending.plan.backward_source is BackwardSource.SAVED_WORKSPACE and pending.ctx.training:
                assert pending.saved is not None, "a plan that saves the workspace saved nothing"
