"""A reference runtime that carries out plans on a fake quantizer.

``ModuleRuntime`` plays the part a binding plays for a real TE module: it
asks the policy for a plan per call and does exactly what the plan says with
a :class:`FakeQuantizer` that counts every live quantized byte and who holds
it. Tests drive it through forward, backward, reshard and three kinds of
weight write (:class:`WeightWrite`) and check that nothing a plan said to
free is still alive, and that no read takes a copy made from older data
than the weight's current value.

The weight's data and what a binding can see of it are kept apart: writes
move the data version (the truth: what the bytes are) and, depending on the
writer, the tensor's version counter and the optimizer-step generation (the
observation, :class:`Observed`). The runtime decides whether a kept copy is
still current from the observation alone, through the checks
:class:`Freshness` names, as a binding must; every read is then checked
against the truth.

It is deliberately small and literal, so that a reader can check it against
[Note: workspace lifetime] in ``workspace_manager._policy``.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from .._context import QuantizerCapabilities, RecomputePass, Sharding, WeightSource, WorkspaceContext
from .._plan import BackwardSource, CacheAction, Release, Usage, WorkspacePlan
from .._policy import Policy
from .._selection import resolve_policy

__all__ = [
    "FakeWorkspace", "FakeQuantizer", "Freshness", "ModuleRuntime", "Observed", "Origin", "RuntimeModelError",
    "WeightWrite",
]


class RuntimeModelError(AssertionError):
    """A plan could not be carried out (stale data, a missing usage, a
    derivation the format cannot do). Raised by the reference runtime, so a
    test that drives it fails with the plan that caused it."""


_ids = itertools.count()


@dataclass(frozen=True)
class Observed:
    """What a binding can see of a weight's data: the tensor's version
    counter (torch's ``_version``, moved by in-place writes through autograd)
    and the step generation (moved by the one ``torch.optim`` optimizer-step
    hook). Neither is the data itself: a writer can change the bytes and move
    neither (see :class:`WeightWrite`)."""

    counter: int = 0
    generation: int = 0


class Freshness(enum.Flag):
    """What the runtime watches to tell whether a copy it kept (the cached
    workspace, the quantized parameter's derived columnwise data) is still
    current; a copy made when the watched values were different is made
    again at its next use. ``FULL`` is the freshness mechanism of issue #36;
    the others exist to show that each half is needed."""

    #: Trust every kept copy (TE 2.20.2's cache: the caller's
    #: ``is_first_microbatch`` alone decides).
    NONE = 0
    #: The weight's version counter: catches in-place writes and
    #: ``load_state_dict``, not a fused optimizer writing through raw pointers.
    VERSION_COUNTER = enum.auto()
    #: The optimizer-step generation: catches every ``torch.optim`` step
    #: (FusedAdam's included), not writes outside a step.
    STEP_GENERATION = enum.auto()
    #: Both: every writer of :class:`WeightWrite` moves at least one.
    FULL = VERSION_COUNTER | STEP_GENERATION


class WeightWrite(enum.Enum):
    """A write that changes the weight's data, by what a binding sees of it:
    whether the tensor's version counter moves, and whether the
    optimizer-step hook fires."""

    #: A torch.optim step through autograd-visible in-place ops.
    OPTIMIZER_STEP = ("optimizer step", True, True)
    #: TE's FusedAdam on an FP8 parameter: the kernel rewrites the data
    #: through raw pointers, so the counter stays; the hook fires, as FusedAdam
    #: is a torch.optim.Optimizer.
    SILENT_OPTIMIZER_WRITE = ("silent optimizer write", False, True)
    #: ``param.copy_(...)``, ``load_state_dict``: the counter moves, no step.
    INPLACE_WRITE = ("in-place write", True, False)

    def __init__(self, label: str, moves_counter: bool, fires_step_hook: bool) -> None:
        self.label = label
        self.moves_counter = moves_counter
        self.fires_step_hook = fires_step_hook


@dataclass(eq=False)
class FakeWorkspace:
    """A quantized copy of weight data ``version`` holding ``usages``;
    ``observed`` is what the runtime saw of the weight when it was made."""

    usages: Usage
    version: int
    numel: int
    derived: Usage = Usage.NONE
    ident: int = field(default_factory=lambda: next(_ids))
    observed: Observed = Observed()

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


@dataclass(frozen=True)
class Origin:
    """Where a kept copy came from: the weight data ``version`` it was made
    from, and what the runtime ``observed`` of the weight then."""

    version: int
    observed: Observed


@dataclass
class _Parameter:
    """A quantized parameter (``WeightSource.QUANTIZED_PARAM``)."""

    #: columnwise data the quantizer derived and owns (an FP8 transpose), and
    #: the data it was derived from; FSDP2's reshard cannot free it.
    derived: Origin | None = None
    #: FSDP2 all-gather output alive (FSDP2 owns and frees it).
    gathered: bool = False

    @property
    def derived_columnwise(self) -> bool:
        return self.derived is not None


class ModuleRuntime:
    """One module with one weight, driven by plans."""

    def __init__(
        self,
        quantizer: FakeQuantizer,
        *,
        sharding: Sharding = Sharding.NONE,
        weight: WeightSource = WeightSource.HIGH_PRECISION,
        pinned: Policy | None = None,
        freshness: Freshness = Freshness.FULL,
    ) -> None:
        self.quantizer = quantizer
        self.sharding = sharding
        self.weight = weight
        self.pinned = pinned
        self.freshness = freshness
        #: The weight's data version: the truth, which only reads are checked against.
        self.version = 0
        #: What a binding sees of the weight: all the runtime decides by.
        self.observed = Observed()
        self.cache: FakeWorkspace | None = None
        self.pending: list[_Pending] = []
        self.param = _Parameter()
        self.plans: list[tuple[WorkspaceContext, WorkspacePlan]] = []
        self.step_release = Release.NOTHING
        self._tags = itertools.count()
        if self._parameter_keeps_derived_columnwise():
            # quantized_model_init builds the parameter with its transpose.
            self.param.derived = Origin(self.version, self.observed)

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
            self.forward(pending.ctx.as_recompute_pass())
            return self.backward()
        self._run_backward(pending)
        return pending.plan

    def optimizer_step(self) -> None:
        """A torch.optim step: the data changes, the step hook fires."""
        self.write(WeightWrite.OPTIMIZER_STEP)

    def silent_optimizer_write(self) -> None:
        """A FusedAdam-like step: the data changes behind the version
        counter's back; only the step hook tells."""
        self.write(WeightWrite.SILENT_OPTIMIZER_WRITE)

    def inplace_write(self) -> None:
        """``param.copy_``, ``load_state_dict``: the counter moves, no step."""
        self.write(WeightWrite.INPLACE_WRITE)

    def write(self, kind: WeightWrite) -> None:
        if self.pending:
            # Autograd refuses a weight written between forward and backward
            # (its saved tensors' version check); no step does that.
            raise RuntimeModelError(f"{kind.label} with backward still pending")
        self.version += 1
        self.observed = Observed(
            counter=self.observed.counter + int(kind.moves_counter),
            generation=self.observed.generation + int(kind.fires_step_hook),
        )
        self._parameter_updated()
        if kind.fires_step_hook:
            self._after_step()

    def _after_step(self) -> None:
        """The optimizer-step hook: drop the caches plans marked for release."""
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
        self._check_current(ws.version, f"forward's {holder} workspace")
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
        # Valid by what a binding can see, not by the data: REUSE ("a later
        # microbatch") is the caller's word, which a step may have made false.
        valid = self.cache is not None and want in self.cache.usages and self.trusts(self.cache.observed)
        if plan.cache is CacheAction.FILL or (plan.cache is CacheAction.REUSE and not valid):
            if self.cache is not None:
                self.quantizer.drop(self.cache, "cache")
            self.cache = self._quantize(want, "cache")
            return self.cache, "cache"
        if plan.cache is CacheAction.REUSE or (plan.cache is CacheAction.READ_ONLY and valid):
            assert self.cache is not None
            return self.cache, "cache"
        return self._quantize(want, "transient"), "transient"

    def _quantize(self, usages: Usage, holder: str) -> FakeWorkspace:
        """Quantize the weight's current data, noting what was observed."""
        ws = self.quantizer.quantize(self.version, usages, holder)
        ws.observed = self.observed
        return ws

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
            temp = self._quantize(plan.backward_usage, "transient")
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
        self._check_current(ws.version, "backward's saved workspace")
        missing = plan.backward_usage & ~ws.usages
        if Usage.ROWWISE in missing:
            raise RuntimeModelError("backward needs rowwise data the saved workspace lacks")
        if Usage.COLUMNWISE in missing:
            self.quantizer.derive_columnwise(ws)

    def _backward_parameter(self, ctx: WorkspaceContext, plan: WorkspacePlan) -> None:
        dgrad = Usage.COLUMNWISE in plan.backward_usage
        if not self.sharding.is_fsdp2:
            if dgrad and self._parameter_keeps_derived_columnwise():
                self._read_parameter_columnwise()
            return  # otherwise the parameter carries its usages as its own data
        # FSDP2's backward all-gather: formats that can derive columnwise
        # data gather rowwise data and derive it into quantizer-owned memory.
        self.param.gathered = True
        if self._derives_columnwise() and dgrad:
            self._read_parameter_columnwise()
        elif self._derives_columnwise():
            self._refresh_parameter_columnwise()  # the all-gather derives it, dgrad or not
        self.reshard()

    def _derives_columnwise(self) -> bool:
        caps = self.quantizer.capabilities
        return caps.columnwise_derivable and caps.derived_caches

    def _parameter_keeps_derived_columnwise(self) -> bool:
        """A whole quantized parameter of a derivable format keeps its
        columnwise data (an FP8 transpose) from step to step, derived from
        its rowwise data (``parameter_keeps`` is both usages)."""
        whole = self.weight is WeightSource.QUANTIZED_PARAM and self.sharding is Sharding.NONE
        return whole and self._derives_columnwise()

    # -- the quantized parameter's derived data (hooks for real quantizers) ---
    def _refresh_parameter_columnwise(self) -> None:
        """Make the parameter's derived columnwise data ready for use: kept
        while trusted (TE keeps a transpose flagged valid), else derived again."""
        derived = self.param.derived
        if derived is not None and not self.trusts(derived.observed):
            self._release_parameter_derived()
        if self.param.derived is None:
            self._derive_parameter_columnwise()

    def _read_parameter_columnwise(self) -> None:
        """dgrad reads the parameter's derived columnwise data."""
        self._refresh_parameter_columnwise()
        assert self.param.derived is not None
        self._check_current(self.param.derived.version, "the quantized parameter's derived columnwise data")

    def _derive_parameter_columnwise(self) -> None:
        self.param.derived = Origin(self.version, self.observed)

    def _release_parameter_derived(self) -> None:
        self.param.derived = None

    def _parameter_updated(self) -> None:
        """The weight's data changed (a :class:`WeightWrite`)."""

    def parameter_derived_bytes(self) -> int:
        """Bytes of derived columnwise data alive on the quantized parameter
        (one byte per element in this model)."""
        return self.quantizer.numel if self.param.derived is not None else 0

    # -- freshness: what the runtime decides by, and what reads are checked against
    def trusts(self, made: Observed) -> bool:
        """Whether a copy made when the runtime observed ``made`` would be
        used as current, by the checks in ``self.freshness``."""
        if Freshness.VERSION_COUNTER in self.freshness and made.counter != self.observed.counter:
            return False
        return not (Freshness.STEP_GENERATION in self.freshness and made.generation != self.observed.generation)

    def _check_current(self, version: int, what: str) -> None:
        if version != self.version:
            raise RuntimeModelError(
                f"stale read: {what} was made from weight data version {version}, "
                f"but the weight's data is at version {self.version}"
            )

    def readable_copies(self) -> list[tuple[str, Origin]]:
        """Every kept copy a later read would take as it is, by name: the
        saved workspaces (backward reads them unchecked), and the cache and
        the parameter's derived data while the runtime trusts them."""
        readable = [(f"saved workspace {ws.ident}", Origin(ws.version, ws.observed)) for ws in self.saved_workspaces()]
        if self.cache is not None and self.trusts(self.cache.observed):
            readable.append(("the cached workspace", Origin(self.cache.version, self.cache.observed)))
        derived = self.param.derived
        if derived is not None and self.trusts(derived.observed):
            readable.append(("the quantized parameter's derived columnwise data", derived))
        return readable

    # -- what tests read ----------------------------------------------------
    def saved_workspaces(self) -> list[FakeWorkspace]:
        return [p.saved for p in self.pending if p.saved is not None]

    def reachable(self) -> set[int]:
        ids = {ws.ident for ws in self.saved_workspaces()}
        if self.cache is not None:
            ids.add(self.cache.ident)
        return ids

