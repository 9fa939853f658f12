"""One managed module call: how a TE call becomes a context, a plan, and
the knobs TE reads.

The module mixin opens a :class:`ManagedCall` around ``super().forward``;
the autograd-Function seams plan each weight (a :class:`WeightSlot`) there,
where TE has already chosen the recipe and quantizers; the
``quantize_weight`` seam reads the slot back by the weight's identity.
Backward never reads the context variable (autograd runs it on other
threads); what it needs travels on the autograd ctx as a
:class:`ReleaseRecord`.
"""

from __future__ import annotations

import contextvars
import weakref
from dataclasses import dataclass, field
from typing import Any

from workspace_manager import (
    BackwardOverride,
    BackwardSource,
    Microbatch,
    RecomputePass,
    RecomputeScope,
    Release,
    WeightSource,
    WorkspacePlan,
    plan_call,
    quantizer_capabilities,
)

from . import _compat as te

ACTIVE: contextvars.ContextVar[ManagedCall | None] = contextvars.ContextVar("te_wm_active_call", default=None)


def te_recompute_pass() -> RecomputePass:
    """Where TE's ``te.checkpoint`` says the call is (its flags are set only
    while FP8 is on, which is the only time a workspace exists)."""
    if not te.is_fp8_activation_recompute_enabled():
        return RecomputePass.NONE
    return RecomputePass.RECOMPUTE if te.in_fp8_activation_recompute_phase() else RecomputePass.FIRST


def passes_through(*, fp8: bool, debug: bool, fsdp_group: Any, skip_update: Any, cpu_offloading: bool,
                   weights: tuple[Any, ...]) -> bool:
    """Calls TE handles on its own: no FP8 (no workspace), debug quantizers,
    FSDP1, CUDA-graph capture, CPU offload, distributed weights. Listed in
    docs/te-integration.md."""
    return (
        not fp8
        or bool(debug)
        or fsdp_group is not None
        or skip_update is not None
        or te.is_graph_capturing()
        or bool(cpu_offloading)
        or any(te.is_distributed_weight(w) for w in weights)
    )


@dataclass
class WeightSlot:
    """One weight of one call, with its plan and the TE knobs derived from it."""

    key: str
    tensor: Any
    plan: WorkspacePlan
    is_quantized_param: bool

    @property
    def drops_workspace(self) -> bool:
        """TE's ``is_fsdp2`` lever in forward: True makes TE save no
        workspace for a high-precision weight (``wt_save = None``)."""
        return not self.is_quantized_param and self.plan.backward_source in (
            BackwardSource.REQUANTIZE,
            BackwardSource.HIGH_PRECISION,
            BackwardSource.NONE,
        )

    @property
    def te_clear(self) -> bool:
        """TE's in-backward ``clear_columnwise_cache`` on the weight dgrad
        used: for a derived cache on a quantized parameter, and for a
        rebuilt temporary (freed earlier, lowering the backward peak); never
        for a cached workspace."""
        if self.plan.backward_source is BackwardSource.REQUANTIZE:
            return True
        return self.is_quantized_param and Release.DERIVED_COLUMNWISE in self.plan.release

    @property
    def no_backward_quantizer(self) -> bool:
        """``backward_override="high_precision"``: dgrad reads the
        high-precision weight, so TE must not rebuild a quantized one."""
        return self.plan.backward_source is BackwardSource.HIGH_PRECISION


@dataclass
class ReleaseRecord:
    """What to release once a call's backward is done (kept on the autograd ctx)."""

    module: weakref.ref
    items: list[tuple[str, Release, Any]] = field(default_factory=list)

    def add(self, slot: WeightSlot) -> None:
        param = weakref.ref(slot.tensor) if slot.is_quantized_param else None
        if slot.plan.release is not Release.NOTHING:
            self.items.append((slot.key, slot.plan.release, param))

    def release(self) -> None:
        module = self.module()
        for key, release, param in self.items:
            if Release.DERIVED_COLUMNWISE in release and param is not None:
                tensor = param()
                if isinstance(tensor, te.QuantizedTensorStorage):
                    te.clear_columnwise_cache(tensor)
            if Release.CACHED_WORKSPACE in release and module is not None:
                from ._steps import release_after_step

                release_after_step(module, key)
        self.items = []


class ManagedCall:
    """The state of one managed module call, shared by the seams."""

    def __init__(self, module: Any, kind: str) -> None:
        self.module = module
        self.kind = kind
        self.slots: list[WeightSlot] = []
        #: Workspaces filled this call, stored in the module's cache only
        #: when the forward returns: a failed forward leaves the cache as it was.
        self.pending_cache: dict[str, Any] = {}

    def commit(self) -> None:
        self.module._fp8_workspaces.update(self.pending_cache)
        self.pending_cache = {}
        self.slots = []  # no tensor outlives the call through this object

    def cached(self, key: str) -> Any:
        if key in self.pending_cache:
            return self.pending_cache[key]
        return self.module._fp8_workspaces.get(key)

    def slot_for(self, tensor: Any) -> WeightSlot | None:
        for slot in self.slots:
            if slot.tensor is tensor:
                return slot
        return None

    def plan_weight(self, key: str, weight: Any, quantizer: Any, *, grad: bool, input_requires_grad: bool,
                    is_first_microbatch: bool | None, backward_override: str | None,
                    recompute: RecomputePass, scope: RecomputeScope = RecomputeScope.REGION) -> WeightSlot:
        """Describe the call to the policy and keep its plan for the other seams."""
        is_qp = isinstance(weight, te.QuantizedTensorStorage)
        source_quantizer = weight._quantizer if is_qp else quantizer
        ctx, plan = plan_call(
            self.module.workspace_policy,
            quantizer_capabilities(source_quantizer),
            self.module._te_wm_sharding(),
            recompute,
            scope,
            bool(grad),
            bool(input_requires_grad),
            WeightSource.QUANTIZED_PARAM if is_qp else WeightSource.HIGH_PRECISION,
            Microbatch.from_is_first_microbatch(is_first_microbatch),
            BackwardOverride.from_te(backward_override),
        )
        if is_qp and ctx.sharding.is_fsdp2:
            from ._shards import track

            track(self.module)  # its shards are trimmed after every optimizer step
        slot = WeightSlot(key=key, tensor=weight, plan=plan, is_quantized_param=is_qp)
        self.slots = [s for s in self.slots if s.key != key] + [slot]
        self.module._te_wm_last_plans[key] = (ctx, plan)
        return slot

    def release_record(self, slots: list[WeightSlot]) -> ReleaseRecord | None:
        record = ReleaseRecord(module=weakref.ref(self.module))
        for slot in slots:
            record.add(slot)
        return record if record.items else None
