"""The workspace lifecycle's events and invariants, without Hypothesis.

A :class:`LifecycleSession` drives one :class:`ModuleRuntime` through
forward, backward, reshard and weight-write events (an optimizer step, a
silent optimizer write, an in-place write) and checks, after each event,
that nothing a plan said to free is still alive and that no copy a later
read would take is older than the weight's data (the runtime checks every
read itself, and raises ``RuntimeModelError`` on a stale one). The Hypothesis
state machine (:mod:`workspace_manager.testing.lifecycle`) and
:func:`~workspace_manager.testing.check_quantizer` share it, so both check
the same things.
"""

from __future__ import annotations

from .._context import (
    BackwardOverride,
    Microbatch,
    RecomputePass,
    Sharding,
    WeightSource,
    WorkspaceContext,
)
from .._plan import BackwardSource, Release, WorkspacePlan
from ._model import ModuleRuntime
from .invariants import _keeps_for_backward

__all__ = ["LifecycleSession"]


class LifecycleSession:
    """One module's life: events plus the invariants checked after each."""

    def __init__(self, runtime: ModuleRuntime, *, use_microbatches: bool) -> None:
        self.runtime = runtime
        self.use_microbatches = use_microbatches
        self.forwards_this_step = 0
        self.step_plans: list[WorkspacePlan] = []

    # -- events --------------------------------------------------------------
    def forward(
        self,
        *,
        grad: bool,
        input_requires_grad: bool,
        recompute: RecomputePass,
        override: BackwardOverride,
        microbatch: Microbatch | None = None,
    ) -> tuple[WorkspaceContext, WorkspacePlan]:
        """One forward call. ``microbatch`` is what the caller passes, where
        it is not the session's count: ``Microbatch.LATER`` from a caller who
        passes ``is_first_microbatch=False`` whatever happened to the weight."""
        rt = self.runtime
        ctx = WorkspaceContext(
            capabilities=rt.quantizer.capabilities,
            sharding=rt.sharding,
            recompute=recompute,
            grad_enabled=grad,
            input_requires_grad=input_requires_grad,
            weight=rt.weight,
            microbatch=self._microbatch() if microbatch is None else microbatch,
            backward_override=override,
        )
        plan = rt.forward(ctx)
        self.forwards_this_step += 1
        self.step_plans.append(plan)
        return ctx, plan

    def backward(self) -> WorkspacePlan:
        plan = self.runtime.backward()
        self.step_plans.append(plan)
        return plan

    def optimizer_step(self) -> None:
        """A torch.optim step (the weight's version counter moves)."""
        self.runtime.optimizer_step()
        self._step_done()

    def silent_optimizer_write(self) -> None:
        """An optimizer step that writes the parameter in place without
        telling anyone (FusedAdam's FP8 kernel): no version counter moves,
        only the optimizer-step hook fires."""
        self.runtime.silent_optimizer_write()
        self._step_done()

    def inplace_write(self) -> None:
        """``param.copy_`` or ``load_state_dict`` between calls: the version
        counter moves, no step hook fires, and the step goes on (the
        microbatch count is not reset)."""
        self.runtime.inplace_write()

    def _step_done(self) -> None:
        self.check_step_end()
        self.forwards_this_step = 0
        self.step_plans = []

    def reshard(self) -> None:
        """FSDP2 reshards between microbatches or after the step."""
        self.runtime.reshard()
        if self.runtime.sharding.is_fsdp2:
            # FSDP2 frees only its own buffers: derived data must be gone by now (TE#2717).
            left = self.runtime.parameter_derived_bytes()
            assert left == 0, f"derived columnwise data ({left} bytes) survived a reshard"

    def _microbatch(self) -> Microbatch:
        if not self.use_microbatches:
            return Microbatch.NONE
        return Microbatch.FIRST if self.forwards_this_step == 0 else Microbatch.LATER

    def check_step_end(self) -> None:
        rt = self.runtime
        asked = any(Release.CACHED_WORKSPACE in p.release for p in self.step_plans)
        if asked:
            assert rt.cache is None, "a plan released the cache after the step, but it is still alive"
        if rt.sharding is not Sharding.NONE:
            # No unsharded quantized copy may outlive a step of a sharded weight.
            assert rt.cache is None, f"cached workspace outlived the step under {rt.sharding.name}"

    # -- invariants ----------------------------------------------------------
    def check_invariants(self) -> None:
        """Every invariant below; raises AssertionError on the first broken one."""
        self.only_reachable_workspaces_are_alive()
        self.live_workspaces_hold_their_data()
        self.fsdp2_reshard_keeps_no_quantized_copy()
        self.idle_fsdp2_parameter_has_no_derived_data()
        self.saved_workspaces_serve_their_backward()
        self.no_copy_outlives_its_source()

    def only_reachable_workspaces_are_alive(self) -> None:
        live = {ws.ident for ws in self.runtime.quantizer.live()}
        reachable = self.runtime.reachable()
        assert live == reachable, f"alive {sorted(live)} but reachable {sorted(reachable)}"

    def live_workspaces_hold_their_data(self) -> None:
        """Each live workspace still holds the usages it was built or derived
        with, in a nonzero number of bytes."""
        quantizer = self.runtime.quantizer
        for ws in quantizer.live():
            held = quantizer.usages_of(ws)
            assert held == ws.usages, f"a live workspace holds {held.label}, but was built with {ws.usages.label}"
            assert ws.nbytes > 0, f"a live {ws.usages.label} workspace reports {ws.nbytes} bytes"

    def fsdp2_reshard_keeps_no_quantized_copy(self) -> None:
        """TE#2681: under FSDP2 resharding after forward, no layer holds a
        quantized copy of its high-precision weight between forward and
        backward, but the copies a pinned KeepForBackwardWorkspacePolicy
        saves on purpose for a quantizer that requantizes exactly (as the
        plan invariant of the same name allows)."""
        rt = self.runtime
        if rt.sharding is not Sharding.FSDP2_RESHARD or rt.weight is not WeightSource.HIGH_PRECISION:
            return
        allowed = 0
        if _keeps_for_backward(rt.pinned) and rt.quantizer.capabilities.requantization_safe:
            allowed = sum(ws.nbytes for ws in rt.saved_workspaces())
        held = rt.quantizer.live_bytes()
        assert held == allowed, f"{held} quantized bytes alive under FSDP2 ({allowed} saved on purpose)"

    def idle_fsdp2_parameter_has_no_derived_data(self) -> None:
        rt = self.runtime
        if rt.pending or not rt.sharding.is_fsdp2:
            return
        left = rt.parameter_derived_bytes()
        assert left == 0, f"derived columnwise data ({left} bytes) alive on an idle FSDP2 parameter"

    def saved_workspaces_serve_their_backward(self) -> None:
        for pending in self.runtime.pending:
            if pending.plan.backward_source is BackwardSource.SAVED_WORKSPACE and pending.ctx.training:
                assert pending.saved is not None, "a plan that saves the workspace saved nothing"

    def no_copy_outlives_its_source(self) -> None:
        """Every copy a later read would take as it is (a saved workspace,
        the cache or the quantized parameter's derived columnwise data while
        the runtime trusts them) was made from the weight's current data."""
        rt = self.runtime
        for what, origin in rt.readable_copies():
            assert origin.version == rt.version, (
                f"stale copy: {what} was made from weight data version {origin.version}, the weight's data is at "
                f"version {rt.version}, and the runtime would still read it ({rt.freshness!r})"
            )
