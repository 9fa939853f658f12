"""A reference runtime that carries out plans on a fake quantizer.

``ModuleRuntime`` plays the part a binding plays for a real TE module: it
asks the policy for a plan per call and does exactly what the plan says with
a :class:`FakeQuantizer` that counts every live quantized byte and who holds
it. Tests drive it through forward, backward, optimizer-step and reshard
events and check that nothing a plan said to free is still alive.

It is deliberately small and literal, so that a reader can check it against
[Note: workspace lifetime] in ``workspace_manager._policy``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

from .._context import QuantizerCapabilities, RecomputePass, Sharding, WeightSource, WorkspaceContext
from .._plan import BackwardSource, CacheAction, Release, Usage, WorkspacePlan
from .._policy import WorkspacePolicy
from .._selection import resolve_policy

__all__ = ["FakeWorkspace", "FakeQuantizer", "ModuleRuntime", "RuntimeModelError"]


class RuntimeModelError(AssertionError):
    """A plan could not be carried out (stale data, a missing usage, a
    derivation the format cannot do). Raised by the reference runtime, so a
    test that drives it fails with the plan that caused it."""


_ids = itertools.count()


@dataclass(eq=False)
class FakeWorkspace:
    """A quantized copy of weight ``version`` holding ``usages``."""

    usages: Usage
    version: int
    numel: int
    derived: Usage = Usage.NONE
    ident: int = field(default_factory=lambda: next(_ids))

    @property
    def nbytes(self) -> int:
        # One byte per element per direction, as FP8 has.
        return self.numel * bin(self.usages.value).count("1")


class FakeQuantizer:
    """Counts quantizations and live bytes by holder.

    A workspace is alive while at least one holder ("cache", "saved:<n>",
    "transient") names it; dropping the last holder frees it.
    """

    def __init__(self, capabilities: QuantizerCapabilities, numel: int = 4096) -> None:
        self.capabilities = capabilities
        self.numel = numel
        self.quantizations = 0
        self._holders: dict[int, set[str]] = {}
        self._live: dict[int, FakeWorkspace] = {}

    def quantize(self, version: int, usages: Usage, holder: str) -> FakeWorkspace:
        self.quantizations += 1
        return self._track(FakeWorkspace(usages=usages, version=version, numel=self.numel), holder)

    def _track(self, ws: FakeWorkspace, holder: str) -> FakeWorkspace:
        """Record a new workspace as alive, held by ``holder``."""
        self._live[ws.ident] = ws
        self._holders[ws.ident] = {holder}
        return ws

    def derive_columnwise(self, ws: FakeWorkspace) -> None:
        if not self.capabilities.columnwise_derivable:
            raise RuntimeModelError(
                f"plan asked to derive columnwise data, but {self.capabilities.name} cannot derive it"
            )
        ws.usages |= Usage.COLUMNWISE
        ws.derived |= Usage.COLUMNWISE

    def hold(self, ws: FakeWorkspace, holder: str) -> None:
        self._holders[ws.ident].add(holder)

    def drop(self, ws: FakeWorkspace, holder: str) -> None:
        holders = self._holders.get(ws.ident)
        if holders is None or holder not in holders:
            raise RuntimeModelError(f"{holder} does not hold workspace {ws.ident}")
        holders.discard(holder)
        if not holders:
            del self._holders[ws.ident]
            del self._live[ws.ident]

    def usages_of(self, ws: FakeWorkspace) -> Usage:
        """The usages the workspace's data really holds (here: what it says)."""
        return ws.usages

    def live(self) -> list[FakeWorkspace]:
        return list(self._live.values())

    def live_bytes(self) -> int:
        return sum(ws.nbytes for ws in self._live.values())


@dataclass
class _Pending:
    ctx: WorkspaceContext
    plan: WorkspacePlan
    saved: FakeWorkspace | None
    tag: str


@dataclass
class _Parameter:
    """A quantized parameter (``WeightSource.QUANTIZED_PARAM``)."""

    version: int = 0
    #: columnwise data the quantizer derived and owns (an FP8 transpose);
    #: FSDP2's reshard cannot free it.
    derived_columnwise: bool = False
    #: FSDP2 all-gather output alive (FSDP2 owns and frees it).
    gathered: bool = False


class ModuleRuntime:
    """One module with one weight, driven by plans."""

    def __init__(
        self,
        quantizer: FakeQuantizer,
        *,
        sharding: Sharding = Sharding.NONE,
        weight: WeightSource = WeightSource.HIGH_PRECISION,
        pinned: WorkspacePolicy | None = None,
    ) -> None:
        self.quantizer = quantizer
        self.sharding = sharding
        self.weight = weight
        self.pinned = pinned
        self.version = 0
        self.cache: FakeWorkspace | None = None
        self.pending: list[_Pending] = []
        self.param = _Parameter()
        self.plans: list[tuple[WorkspaceContext, WorkspacePlan]] = []
        self.step_release = Release.NOTHING
        self._tags = itertools.count()

    # -- events ------------------------------------------------------------
    def forward(self, ctx: WorkspaceContext) -> WorkspacePlan:
        if ctx.sharding is not self.sharding or ctx.weight is not self.weight:
            raise RuntimeModelError("context does not describe this module's weight")
        plan = resolve_policy(ctx, self.pinned).plan(ctx)
        self.plans.append((ctx, plan))
        if ctx.is_quantized_param:
            self._forward_quantized_param(ctx, plan)
        else:
            self._forward_high_precision(ctx, plan)
        return plan

    def backward(self) -> WorkspacePlan:
        """Backward of the most recent forward that is still pending (autograd
        runs backward in reverse order)."""
        if not self.pending:
            raise RuntimeModelError("backward without a pending forward")
        pending = self.pending.pop()
        if pending.ctx.recompute is RecomputePass.FIRST:
            # te.checkpoint: replay the forward, then run its backward at once.
            replay = replace_recompute(pending.ctx)
            self.forward(replay)
            return self.backward()
        self._run_backward(pending)
        return pending.plan

    def optimizer_step(self) -> None:
        if self.pending:
            raise RuntimeModelError("optimizer step with backward still pending")
        self.version += 1
        self.param.version = self.version
        self._parameter_updated()
        if Release.CACHED_WORKSPACE in self.step_release and self.cache is not None:
            self.quantizer.drop(self.cache, "cache")
            self.cache = None
        self.step_release = Release.NOTHING

    def reshard(self) -> None:
        """FSDP2 frees what it gathered (only what it allocated)."""
        self.param.gathered = False

    # -- forward ------------------------------------------------------------
    def _forward_high_precision(self, ctx: WorkspaceContext, plan: WorkspacePlan) -> None:
        ws, holder = self._acquire(plan)
        if ws.version != self.version:
            raise RuntimeModelError(f"forward read a workspace of weight version {ws.version}, current is {self.version}")
        if Usage.ROWWISE not in ws.usages:
            raise RuntimeModelError("forward workspace lacks rowwise data")
        saved = None
        if ctx.training and plan.backward_source is BackwardSource.SAVED_WORKSPACE:
            saved = ws
        self._push(ctx, plan, saved)
        if holder == "transient":
            self.quantizer.drop(ws, "transient")

    def _acquire(self, plan: WorkspacePlan) -> tuple[FakeWorkspace, str]:
        want = plan.forward_usage
        valid = self.cache is not None and want in self.cache.usages and self.cache.version == self.version
        if plan.cache is CacheAction.FILL or (plan.cache is CacheAction.REUSE and not valid):
            if self.cache is not None:
                self.quantizer.drop(self.cache, "cache")
            self.cache = self.quantizer.quantize(self.version, want, "cache")
            return self.cache, "cache"
        if plan.cache is CacheAction.REUSE or (plan.cache is CacheAction.READ_ONLY and valid):
            assert self.cache is not None
            return self.cache, "cache"
        return self.quantizer.quantize(self.version, want, "transient"), "transient"

    def _forward_quantized_param(self, ctx: WorkspaceContext, plan: WorkspacePlan) -> None:
        if plan.cache.writes:
            raise RuntimeModelError("a quantized parameter was planned into the cache")
        if self.sharding.is_fsdp2:
            self.param.gathered = True
        self._push(ctx, plan, None)
        if self.sharding is Sharding.FSDP2_RESHARD:
            self.reshard()

    def _push(self, ctx: WorkspaceContext, plan: WorkspacePlan, saved: FakeWorkspace | None) -> None:
        if not (ctx.training or ctx.recompute is RecomputePass.FIRST):
            return  # inference: autograd records nothing
        tag = f"saved:{next(self._tags)}"
        if saved is not None:
            self.quantizer.hold(saved, tag)
        self.pending.append(_Pending(ctx, plan, saved, tag))

    # -- backward -----------------------------------------------------------
    def _run_backward(self, pending: _Pending) -> None:
        plan, ctx = pending.plan, pending.ctx
        source = plan.backward_source
        if source is BackwardSource.SAVED_WORKSPACE:
            self._use_saved(pending)
        elif source in (BackwardSource.REQUANTIZE, BackwardSource.REGATHER):
            temp = self.quantizer.quantize(self.version, plan.backward_usage, "transient")
            self.quantizer.drop(temp, "transient")
        elif source is BackwardSource.SAVED_PARAMETER or (ctx.is_quantized_param and self.sharding.is_fsdp2):
            self._backward_parameter(ctx, plan)
        if pending.saved is not None:
            self.quantizer.drop(pending.saved, pending.tag)
        if Release.DERIVED_COLUMNWISE in plan.release:
            self._release_parameter_derived()
        self.step_release |= plan.release & Release.CACHED_WORKSPACE

    def _use_saved(self, pending: _Pending) -> None:
        ws, plan = pending.saved, pending.plan
        if ws is None:
            raise RuntimeModelError("plan said backward gets the saved workspace, but nothing was saved")
        if ws.version != self.version:
            raise RuntimeModelError("saved workspace is stale")
        missing = plan.backward_usage & ~ws.usages
        if Usage.ROWWISE in missing:
            raise RuntimeModelError("backward needs rowwise data the saved workspace lacks")
        if Usage.COLUMNWISE in missing:
            self.quantizer.derive_columnwise(ws)

    def _backward_parameter(self, ctx: WorkspaceContext, plan: WorkspacePlan) -> None:
        if not self.sharding.is_fsdp2:
            return  # the parameter carries its usages since it was created
        # FSDP2's backward all-gather: formats that can derive columnwise
        # data gather rowwise data and derive it into quantizer-owned memory.
        self.param.gathered = True
        if self.quantizer.capabilities.columnwise_derivable and self.quantizer.capabilities.derived_caches:
            self._derive_parameter_columnwise()
        self.reshard()

    # -- the quantized parameter's derived data (hooks for real quantizers) ---
    def _derive_parameter_columnwise(self) -> None:
        self.param.derived_columnwise = True

    def _release_parameter_derived(self) -> None:
        self.param.derived_columnwise = False

    def _parameter_updated(self) -> None:
        """The optimizer changed the (quantized) parameter."""

    def parameter_derived_bytes(self) -> int:
        """Bytes of derived columnwise data alive on the quantized parameter
        (one byte per element in this model)."""
        return self.quantizer.numel if self.param.derived_columnwise else 0

    # -- what tests read ----------------------------------------------------
    def saved_workspaces(self) -> list[FakeWorkspace]:
        return [p.saved for p in self.pending if p.saved is not None]

    def reachable(self) -> set[int]:
        ids = {ws.ident for ws in self.saved_workspaces()}
        if self.cache is not None:
            ids.add(self.cache.ident)
        return ids


def replace_recompute(ctx: WorkspaceContext) -> WorkspaceContext:
    """The recompute-pass context that replays a first-pass call."""
    return replace(ctx, recompute=RecomputePass.RECOMPUTE, grad_enabled=True)
