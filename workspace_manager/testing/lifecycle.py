"""A Hypothesis state machine of the workspace lifecycle.

It drives :class:`~workspace_manager.testing.ModuleRuntime` through forward
(plain, first recompute pass, inference; the microbatch position counted,
or ``is_first_microbatch=False`` from a caller who passes it whatever
happened), backward, reshard and three weight writes:

- ``optimizer_step``: a torch.optim step (the version counter moves, the
  optimizer-step hook fires);
- ``silent_optimizer_write``: the optimizer writes the parameter in place
  without telling anyone (TE's FusedAdam on FP8 parameters: the version
  counter does not move; only the step hook fires);
- ``inplace_write``: ``param.copy_`` or ``load_state_dict`` (the version
  counter moves, no step hook).

After every step it checks that nothing a plan said to free is still
alive, and that no read takes a copy made from older data than the
weight's current value (the cached workspace, a saved workspace, the
quantized parameter's derived columnwise data), whatever the policy
planned. Run it with::

    TestLifecycle = WorkspaceLifecycleMachine.TestCase

with the shipped policies' options switched on (they are off by default)::

    TestOptions = WorkspaceLifecycleMachine.with_options().TestCase

and on your own quantizer (see :class:`~workspace_manager.testing.QuantizerUnderTest`),
with its real bytes, with either of::

    TestMine = WorkspaceLifecycleMachine.for_quantizer(MyQuantizer, MY_CAPS).TestCase
    TestMineOptions = WorkspaceLifecycleMachine.with_options().for_quantizer(MyQuantizer, MY_CAPS).TestCase

or with one policy pinned in every setting it plans (``policy=...``).

The events and invariants live in :class:`~workspace_manager.testing.LifecycleSession`,
which :func:`~workspace_manager.testing.check_quantizer` drives too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from ._needs import require_hypothesis

require_hypothesis(__name__)

from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from .._context import BackwardOverride, Microbatch, QuantizerCapabilities, RecomputePass, Sharding, WeightSource
from .._policy import Policy
from ._adapter import QuantizerAdapter, QuantizerRuntime, versioned_weights
from ._model import FakeQuantizer, Freshness, ModuleRuntime
from ._protocol import QuantizerUnderTest
from ._session import LifecycleSession
from .invariants import every_option_on
from .strategies import capabilities

__all__ = ["WorkspaceLifecycleMachine"]


def _pinned(sharding: Sharding, options: bool) -> Policy | None:
    """None (the manager selects per call), or every option on."""
    return every_option_on(sharding) if options else None


class WorkspaceLifecycleMachine(RuleBasedStateMachine):
    """One module under the policy the manager selects for each call.

    :meth:`with_options` gives the same machine with the shipped policy's
    options switched on and pinned (``every_option_on``): the options are
    off by default, so the default alone never walks their caches and
    saved copies."""

    #: Pin the shipped policy with every option on instead of selecting per call.
    options: ClassVar[bool] = False
    #: What the runtime watches to refresh kept copies. Weaken it only to see
    #: the machine find the stale read that follows.
    freshness: ClassVar[Freshness] = Freshness.FULL

    def __init__(self) -> None:
        super().__init__()
        self.session: LifecycleSession | None = None

    @property
    def runtime(self) -> ModuleRuntime | None:
        return None if self.session is None else self.session.runtime

    @initialize(
        caps=capabilities(),
        sharding=st.sampled_from(list(Sharding)),
        weight=st.sampled_from(list(WeightSource)),
        use_microbatches=st.booleans(),
    )
    def setup(self, caps, sharding, weight, use_microbatches) -> None:
        runtime = ModuleRuntime(FakeQuantizer(caps, numel=1024), sharding=sharding, weight=weight,
                                pinned=_pinned(sharding, self.options), freshness=self.freshness)
        self._start(runtime, use_microbatches)

    def _start(self, runtime: ModuleRuntime, use_microbatches: bool) -> None:
        self.session = LifecycleSession(runtime, use_microbatches=use_microbatches)
        note(
            f"module: {runtime.quantizer.capabilities} sharding={runtime.sharding.name} "
            f"weight={runtime.weight.name} microbatches={use_microbatches} pinned={runtime.pinned!r}"
        )

    @classmethod
    def for_quantizer(
        cls,
        factory: Callable[[], QuantizerUnderTest],
        capabilities: QuantizerCapabilities,
        *,
        shape: tuple[int, int] = (128, 256),
        policy: Policy | None = None,
    ) -> type[WorkspaceLifecycleMachine]:
        """A machine whose module quantizes with ``factory()`` (claiming
        ``capabilities``); live bytes are the quantizer's ``bytes_held``.
        With ``policy``, that policy is pinned and the module's sharding is
        drawn from the ones it plans for."""
        if policy is not None and cls.options:
            raise TypeError("for_quantizer: pin one policy or switch every option on (with_options), not both")
        shardings = [s for s in Sharding if policy is None or s in policy.shardings]

        class QuantizerLifecycleMachine(cls):  # type: ignore[misc, valid-type]
            @initialize(
                sharding=st.sampled_from(shardings),
                weight=st.sampled_from(list(WeightSource)),
                use_microbatches=st.booleans(),
            )
            def setup(self, sharding, weight, use_microbatches) -> None:
                adapter = QuantizerAdapter(factory(), capabilities, versioned_weights(shape))
                pinned = policy if policy is not None else _pinned(sharding, self.options)
                runtime = QuantizerRuntime(adapter, sharding=sharding, weight=weight, pinned=pinned,
                                           freshness=self.freshness)
                self._start(runtime, use_microbatches)

        QuantizerLifecycleMachine.__name__ = f"LifecycleOf{capabilities.name.title().replace('_', '')}"
        return QuantizerLifecycleMachine

    @classmethod
    def with_options(cls) -> type[WorkspaceLifecycleMachine]:
        """This machine with every option of the shipped policies on, pinned."""

        class WithOptions(cls):  # type: ignore[misc, valid-type]
            options = True

        WithOptions.__name__ = f"{cls.__name__}WithOptions"
        return WithOptions

    # -- events --------------------------------------------------------------
    @rule(
        grad=st.booleans(),
        input_requires_grad=st.booleans(),
        recompute=st.sampled_from([RecomputePass.NONE, RecomputePass.FIRST]),
        override=st.sampled_from(list(BackwardOverride)),
        # None: the microbatch position the session counts; LATER: a caller
        # who says "later microbatch" after a step or a write too.
        claimed=st.sampled_from([None, None, None, Microbatch.LATER]),
    )
    def forward(self, grad, input_requires_grad, recompute, override, claimed) -> None:
        microbatch = claimed if self.session.use_microbatches else None
        ctx, plan = self.session.forward(
            grad=grad, input_requires_grad=input_requires_grad, recompute=recompute, override=override,
            microbatch=microbatch,
        )
        note(f"forward {ctx.recompute.name} grad={grad} mb={ctx.microbatch.name}: {plan.summary()}")

    @precondition(lambda self: self.runtime is not None and bool(self.runtime.pending))
    @rule()
    def backward(self) -> None:
        plan = self.session.backward()
        note(f"backward: {plan.summary()}")

    @precondition(lambda self: self.runtime is not None and not self.runtime.pending)
    @rule()
    def optimizer_step(self) -> None:
        note("optimizer step")
        self.session.optimizer_step()

    @precondition(lambda self: self.runtime is not None and not self.runtime.pending)
    @rule()
    def silent_optimizer_write(self) -> None:
        """The optimizer writes the parameter in place without telling
        anyone (FusedAdam): only the optimizer-step hook fires."""
        note("silent optimizer write")
        self.session.silent_optimizer_write()

    @precondition(lambda self: self.runtime is not None and not self.runtime.pending)
    @rule()
    def inplace_write(self) -> None:
        """``param.copy_`` or ``load_state_dict``: the version counter moves."""
        note("in-place write")
        self.session.inplace_write()

    @precondition(lambda self: self.runtime is not None and not self.runtime.pending)
    @rule()
    def reshard(self) -> None:
        """FSDP2 reshards between microbatches or after the step."""
        note("reshard")
        self.session.reshard()

    # -- invariants ----------------------------------------------------------
    @invariant()
    def only_reachable_workspaces_are_alive(self) -> None:
        if self.session is not None:
            self.session.only_reachable_workspaces_are_alive()

    @invariant()
    def live_workspaces_hold_their_data(self) -> None:
        if self.session is not None:
            self.session.live_workspaces_hold_their_data()

    @invariant()
    def fsdp2_reshard_keeps_no_quantized_copy(self) -> None:
        """TE#2681: under FSDP2 resharding after forward, no layer holds a
        quantized copy of its high-precision weight between forward and backward."""
        if self.session is not None:
            self.session.fsdp2_reshard_keeps_no_quantized_copy()

    @invariant()
    def idle_fsdp2_parameter_has_no_derived_data(self) -> None:
        if self.session is not None:
            self.session.idle_fsdp2_parameter_has_no_derived_data()

    @invariant()
    def saved_workspaces_serve_their_backward(self) -> None:
        if self.session is not None:
            self.session.saved_workspaces_serve_their_backward()

    @invariant()
    def no_copy_outlives_its_source(self) -> None:
        if self.session is not None:
            self.session.no_copy_outlives_its_source()
