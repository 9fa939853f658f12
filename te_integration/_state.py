"""The one typed object a drop-in module keeps: its workspace state.

Everything the binding remembers about a module lives in its
:class:`ModuleWorkspaceState`: the pinned policy, the probe that reads the
module's FSDP2 sharding, the memo of TE levers per call shape, the plans of
the latest call, and the workspaces a call is filling. The module holds it
as ``_wm_state``; nothing else of ours is stored on the module.

Why a memo of levers: a training step repeats a handful of call shapes.
The first call of each shape builds a :class:`WorkspaceContext`, asks the
policy and turns the plan into :class:`Levers`, the few values TE's code
reads; every later call of that shape is one dictionary lookup. The plan
stays reachable from its levers, for :func:`last_plans`, ``explain`` and
attribution. Sound because policies are frozen and pure, and the key holds
everything a context is built from (``default_registry.generation`` voids
the memo when quantizer registrations change).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from workspace_manager import (
    BackwardOverride,
    BackwardSource,
    CacheAction,
    CallShape,
    Microbatch,
    RecomputePass,
    RecomputeScope,
    Release,
    Sharding,
    ShardingProbe,
    Usage,
    WeightSource,
    WorkspaceContext,
    WorkspacePlan,
    WorkspacePolicy,
    default_registry,
    plan_call,
    probe_fsdp2_sharding,
    quantizer_capabilities,
)

from . import _compat as te
from ._steps import track
from ._support import require_same_passes, require_supported

__all__ = ["ModuleKind", "Levers", "ModuleWorkspaceState", "RebuildQuantizer", "state_of", "levers_from_plan"]


class ModuleKind(enum.Enum):
    """Which TE module a drop-in is; the autograd Function seams check it."""

    LINEAR = "linear"
    LAYERNORM_LINEAR = "layernorm_linear"
    LAYERNORM_MLP = "layernorm_mlp"


#: Recompute codes the seams compute from TE's flags (ints: cheap to hash).
RECOMPUTE_CODES = (RecomputePass.NONE, RecomputePass.FIRST, RecomputePass.RECOMPUTE)
#: Shardings by code: memo keys hold the code, since an enum member hashes in Python.
SHARDINGS = (Sharding.NONE, Sharding.FSDP2_RESHARD, Sharding.FSDP2_KEEP, Sharding.DISTRIBUTED_WEIGHT)
_NONE, _RESHARD, _KEEP = SHARDINGS[:3]
if set(SHARDINGS) != set(Sharding):  # the codes below must cover every sharding
    raise ImportError(f"te_integration._state knows the shardings {SHARDINGS}, workspace_manager has {tuple(Sharding)}")
_DISTRIBUTED_CODE = 3
#: Instance-dependent capabilities -> a small int for memo keys (see
#: ModuleWorkspaceState._instance_keys); process-wide, as capabilities are values.
_CAPABILITY_TOKENS: dict[Any, int] = {}
#: Weight type -> whether it is a quantized tensor (isinstance, once per type).
_IS_QUANTIZED: dict[type, bool] = {}


def _learn_quantized(wtype: type) -> bool:
    is_qp = _IS_QUANTIZED[wtype] = issubclass(wtype, te.QuantizedTensorStorage)
    return is_qp


@dataclass(frozen=True, slots=True)
class Levers:
    """What one weight's plan turns into for TE, for one call shape."""

    key: str
    context: WorkspaceContext
    plan: WorkspacePlan
    is_quantized_param: bool
    #: Forward quantizes columnwise data too (high-precision weights).
    forward_columnwise: bool
    cache: CacheAction
    #: TE's ``is_fsdp2`` in forward: True makes TE save no workspace.
    drops_workspace: bool
    #: TE's in-backward ``clear_columnwise_cache`` on the weight dgrad read.
    te_clear: bool
    #: ``backward_override="high_precision"``: TE must not rebuild a quantized weight.
    no_backward_quantizer: bool
    #: After backward: clear the quantized parameter's derived columnwise data.
    release_columnwise: bool
    #: After backward: mark the cached workspace for release after the step.
    release_cache: bool
    #: Either release: the call's backward has something to do.
    releases: bool
    #: D11: the workspace saved for backward keeps only its columnwise data;
    #: the rowwise data is dropped once the forward GEMM has read it.
    saves_columnwise_only: bool
    #: D9: the usages a backward rebuild builds where they are fewer than
    #: the both usages TE's rebuild asks for; None: TE's own rebuild (or none).
    rebuild_usage: Usage | None


def levers_from_plan(key: str, context: WorkspaceContext, plan: WorkspacePlan) -> Levers:
    """The TE levers that carry out ``plan`` (a pure function of the plan)."""
    is_qp = context.is_quantized_param
    source = plan.backward_source
    rebuilds = source is BackwardSource.REQUANTIZE
    release_columnwise = is_qp and Release.DERIVED_COLUMNWISE in plan.release
    release_cache = Release.CACHED_WORKSPACE in plan.release
    return Levers(
        key=key,
        context=context,
        plan=plan,
        is_quantized_param=is_qp,
        forward_columnwise=Usage.COLUMNWISE in plan.forward_usage,
        cache=plan.cache,
        drops_workspace=not is_qp and source in _DROPPING_SOURCES,
        # A rebuilt temporary is freed early (lower backward peak); a derived
        # cache on a quantized parameter is cleared by TE; never a cached workspace.
        te_clear=rebuilds or (is_qp and Release.DERIVED_COLUMNWISE in plan.release),
        no_backward_quantizer=source is BackwardSource.HIGH_PRECISION,
        release_columnwise=release_columnwise,
        release_cache=release_cache,
        releases=release_columnwise or release_cache,
        saves_columnwise_only=_saves_columnwise_only(context, plan),
        rebuild_usage=plan.backward_usage if rebuilds and plan.backward_usage is not Usage.BOTH else None,
    )


#: Backward sources for which TE must not save the forward's workspace.
_DROPPING_SOURCES = (BackwardSource.REQUANTIZE, BackwardSource.REGATHER, BackwardSource.HIGH_PRECISION,
                     BackwardSource.NONE)


#: Cache actions under which a saved workspace is fresh: always for BYPASS,
#: on a miss for READ_ONLY (a miss is not stored).
_FRESH_WORKSPACE_CACHE_ACTIONS = (CacheAction.BYPASS, CacheAction.READ_ONLY)


def _saves_columnwise_only(context: WorkspaceContext, plan: WorkspacePlan) -> bool:
    """D11: a fresh high-precision-weight workspace saved for a backward that
    reads only its columnwise data. Not a cache entry (later microbatches
    read its rowwise data), not a quantized parameter (it is the weight),
    and not in a recompute pass (TE hands that copy to backward itself)."""
    return (
        not context.is_quantized_param
        and plan.cache in _FRESH_WORKSPACE_CACHE_ACTIONS
        and plan.backward_source is BackwardSource.SAVED_WORKSPACE
        and plan.backward_usage == Usage.COLUMNWISE
        and Usage.COLUMNWISE in plan.forward_usage
        and context.recompute is RecomputePass.NONE
    )


class ModuleWorkspaceState:
    """A drop-in module's workspace state (see the module docstring).

    Per-call fields (``weights``, ``pending``) are filled by the seams inside
    one module call and emptied when it ends; a module call never runs inside
    another call of the same module.
    """

    __slots__ = ("kind", "_policy", "sharding_probe", "call_sharding", "previous_active", "_memo", "_generation",
                 "_quantizer_keys", "_instance_keys", "_last", "weights", "pending", "rowwise_parts", "dropped",
                 "filled", "_rebuilders")

    def __init__(self, kind: ModuleKind, policy: WorkspacePolicy | None = None, *,
                 probe: ShardingProbe | None = None) -> None:
        """``probe``: how to read the module's sharding (default: made from
        FSDP2's state at the first call); anything with ``read()`` and
        ``stale()``, e.g. for describing a sharding without FSDP2."""
        self.kind = kind
        self._policy = policy
        #: How this module's sharding is read (see :meth:`probe`); None
        #: until the first call, or as given.
        self.sharding_probe = probe
        #: The sharding the drop-in's prepare_forward read for the call in
        #: flight; None between calls (then levers() reads the probe).
        self.call_sharding: Sharding | None = None
        #: The module the active mark named before this module's call (restored at its end).
        self.previous_active: Any = None
        self._memo: dict[tuple, Levers] = {}
        self._generation = default_registry.generation
        #: quantizer class -> what its capabilities depend on (the class itself
        #: for fixed capabilities; absent for instance-dependent ones).
        self._quantizer_keys: dict[type, type] = {}
        #: id(quantizer) -> (quantizer, token) for classes whose capabilities
        #: depend on the instance (block FP8's 1D or 2D scaling, NVFP4's
        #: options): read once per quantizer object, which TE makes with
        #: those options and never changes. The token is an int, so the memo
        #: key hashes without Python (a Quantizer's and the capabilities'
        #: ``__hash__`` are Python code).
        self._instance_keys: dict[int, tuple[Any, int]] = {}
        self._last: dict[str, Levers] = {}
        #: The weights of the call in flight, with their levers: (tensor, levers, ...).
        self.weights: tuple = ()
        #: Workspaces this call filled, stored in the module's cache only
        #: when the forward GEMMs returned: a failed call leaves the cache as it was.
        self.pending: dict[str, Any] | None = None
        #: D11: rowwise tensors of this call's fresh workspaces that backward
        #: will not read, to be left out of what the autograd ctx saves.
        self.rowwise_parts: list | None = None
        #: LayerNormMLP with FC1 and FC2 planned to save differently: the
        #: workspaces of this call that backward must not get (None otherwise).
        self.dropped: list | None = None
        #: weight key -> (id of the cache entry this state filled, whether it
        #: holds columnwise data). A hit on that entry skips re-validating
        #: it: the binding built it with those usages, and TE never adds to
        #: or strips a cached workspace (its in-backward clear reaches only
        #: workspaces built for that call). An id, not a reference: the
        #: entry's lifetime stays the cache's.
        self.filled: dict[str, tuple[int, bool]] = {}
        #: weight key -> the D9 rebuild quantizer made for it (see rebuild_quantizer).
        self._rebuilders: dict[str, Any] = {}

    def __reduce__(self):
        # Copies and pickles keep the pinned policy only: probes point at
        # FSDP2 state and levers at this process's plans.
        return (ModuleWorkspaceState, (self.kind, self._policy))

    # -- policy -----------------------------------------------------------------
    @property
    def policy(self) -> WorkspacePolicy | None:
        return self._policy

    @policy.setter
    def policy(self, policy: WorkspacePolicy | None) -> None:
        self._policy = policy
        self._memo.clear()

    # -- sharding -----------------------------------------------------------------
    def sharding(self, module: Any) -> Sharding:
        """The module's sharding now, read from FSDP2's own state (the
        same read as :meth:`levers` does inline)."""
        return self.probe(module).read()

    def probe(self, module: Any) -> ShardingProbe:
        """The module's sharding probe, made again when FSDP2 state changed."""
        probe = self.sharding_probe
        if probe is None or probe.stale():
            probe = self.sharding_probe = probe_fsdp2_sharding(module)
        return probe

    # -- levers -------------------------------------------------------------------
    def levers(self, module: Any, key: str, weight: Any, quantizer: Any, grad: bool, input_requires_grad: bool,
               is_first_microbatch: bool | None, backward_override: str | None, recompute: int,
               module_scope: bool, distributed: bool = False) -> Levers:
        """The levers for this weight in this call: a memo lookup, or the
        full planning path for the first call of a shape. ``distributed``: a
        TE ``DistributedWeight``, whose sharding is its own, not FSDP2's.

        Every call of every managed module runs this, so a repeated shape
        costs no Python call: attribute reads, subscripts and one tuple
        hash (no enum in the key: enum members hash in Python)."""
        wtype = type(weight)
        is_qp = _IS_QUANTIZED[wtype] if wtype in _IS_QUANTIZED else _learn_quantized(wtype)
        source = weight._quantizer if is_qp else quantizer
        if default_registry.generation != self._generation:
            self._forget()
        keys, stype = self._quantizer_keys, type(source)
        if stype in keys:
            caps_key = keys[stype]
        else:
            known = self._instance_keys.get(id(source))
            caps_key = known[1] if known is not None and known[0] is source else self._capabilities_key(source)
        if distributed:
            code = _DISTRIBUTED_CODE
        else:
            sharding = self.call_sharding
            if sharding is None:  # outside a module call (a recompute pass in backward, a direct caller)
                sharding = self.probe(module).read()
            code = 0 if sharding is _NONE else 1 if sharding is _RESHARD else 2 if sharding is _KEEP else 3
        shape = (key, caps_key, is_qp, grad, input_requires_grad, is_first_microbatch, backward_override, recompute,
                 module_scope, code)
        try:
            levers = self._memo[shape]
        except KeyError:
            levers = self._memo[shape] = self._plan(shape, source)
            if is_qp and levers.context.sharding.is_fsdp2:
                track(module)  # its shards are checked after every optimizer step
        self._last[key] = levers
        return levers

    def _capabilities_key(self, quantizer: Any) -> Any:
        """What ``quantizer``'s capabilities depend on: its class, remembered
        per class, when that is the class alone; else a token for the
        capabilities, remembered per quantizer object."""
        caps_key = default_registry.capabilities_key(quantizer)
        if caps_key is type(quantizer):
            self._quantizer_keys[caps_key] = caps_key
            return caps_key
        tokens = _CAPABILITY_TOKENS
        token = tokens[caps_key] if caps_key in tokens else tokens.setdefault(caps_key, len(tokens))
        self._instance_keys[id(quantizer)] = (quantizer, token)
        return token

    def _forget(self) -> None:
        """Quantizer registrations changed: every memoized plan may be stale."""
        self._memo.clear()
        self._quantizer_keys.clear()
        self._instance_keys.clear()
        self._generation = default_registry.generation

    def remember(self, levers: Levers) -> None:
        """Make ``levers`` the latest plan of its weight (as a call does)."""
        self._last[levers.key] = levers

    def _plan(self, shape: tuple, quantizer: Any) -> Levers:
        key, _, is_qp, grad, input_rg, first, override, recompute, module_scope, sharding = shape
        call = CallShape(
            capabilities=quantizer_capabilities(quantizer), sharding=SHARDINGS[sharding],
            recompute=RECOMPUTE_CODES[recompute],
            recompute_scope=RecomputeScope.MODULE if module_scope else RecomputeScope.REGION,
            grad_enabled=grad, input_requires_grad=input_rg,
            weight=WeightSource.QUANTIZED_PARAM if is_qp else WeightSource.HIGH_PRECISION,
            microbatch=Microbatch.from_is_first_microbatch(first), backward_override=BackwardOverride.from_te(override),
        )
        planned = plan_call(self._policy, call)
        context, plan = planned.context, planned.plan
        require_supported(key, context, plan)
        if context.recompute is RecomputePass.FIRST and context.grad_enabled and not module_scope:
            # Only a non-reentrant checkpoint's first pass runs with grad on.
            replanned = plan_call(self._policy, replace(call, recompute=RecomputePass.RECOMPUTE, grad_enabled=True)).plan
            require_same_passes(key, context, plan, replanned)
        return levers_from_plan(key, context, plan)

    def last_plans(self) -> dict[str, tuple[WorkspaceContext, WorkspacePlan]]:
        """``{weight key: (context, plan)}`` of the latest managed call."""
        return {key: (lv.context, lv.plan) for key, lv in self._last.items()}

    def plan_of(self, key: str) -> WorkspacePlan | None:
        levers = self._last.get(key)
        return levers.plan if levers is not None else None

    def shapes_planned(self) -> int:
        """How many call shapes were planned in full (the memo's size)."""
        return len(self._memo)

    # -- the call in flight -------------------------------------------------------------
    def slot_for(self, tensor: Any) -> Levers | None:
        """The levers of ``tensor`` if it is a weight of the call in flight."""
        weights = self.weights
        for i in range(0, len(weights), 2):
            if weights[i] is tensor:
                return weights[i + 1]
        return None

    def cached(self, workspaces: dict, key: str) -> Any:
        pending = self.pending
        if pending is not None and key in pending:
            return pending[key]
        return workspaces.get(key)

    def fill(self, key: str, workspace: Any, columnwise: bool) -> None:
        """``workspace`` was built for the cache entry ``key`` by this call,
        with columnwise data or not; stored by :meth:`commit`."""
        if self.pending is None:
            self.pending = {}
        self.pending[key] = workspace
        self.filled[key] = (id(workspace), columnwise)

    def backward_quantizer(self, levers: Levers, quantizer: Any) -> Any:
        """The weight quantizer TE's backward gets: none where dgrad reads the
        high-precision weight (TE must not rebuild), and for D9 a
        :class:`RebuildQuantizer` that builds only the plan's usages (made
        once per weight and quantizer)."""
        if levers.no_backward_quantizer or quantizer is None:
            return None
        if type(quantizer) is RebuildQuantizer:  # set already (LayerNormMLP's own recompute)
            quantizer = quantizer.quantizer
        key, usage = levers.key, levers.rebuild_usage
        rebuilders = self._rebuilders
        rebuilder = rebuilders[key] if key in rebuilders else None
        if rebuilder is None or rebuilder.quantizer is not quantizer or rebuilder.usage is not usage:
            rebuilder = rebuilders[key] = RebuildQuantizer(quantizer, usage)
        return rebuilder

    def commit(self, workspaces: dict) -> None:
        """The call's GEMMs returned: its new cache entries become the module's."""
        if self.pending:
            workspaces.update(self.pending)
        self.pending = None


class RebuildQuantizer:
    """Stands for a weight quantizer in TE's backward rebuild (D9).

    TE 2.20 asks for both usages there (``set_usage(rowwise=True,
    columnwise=True)`` before quantizing the gathered weight), although
    dgrad reads only columnwise data. This wrapper ignores that request and
    quantizes with the plan's usages. Formats whose kernels cannot build
    columnwise data alone (TE 2.20's per-tensor FP8: its cast-transpose
    needs rowwise output, and says so with ``NotImplementedError``) build
    both and drop the rest at once, so backward holds only what the plan
    names. Any other attribute TE reads comes from the wrapped quantizer;
    afterwards the quantizer is left as TE's rebuild leaves it (both usages).
    """

    __slots__ = ("quantizer", "usage", "_rowwise", "_columnwise")

    #: Quantizer classes found unable to build the narrow usage directly.
    builds_both: ClassVar[set] = set()

    def __init__(self, quantizer: Any, usage: Usage) -> None:
        self.quantizer = quantizer
        self.usage = usage
        self._rowwise = Usage.ROWWISE in usage
        self._columnwise = Usage.COLUMNWISE in usage

    def set_usage(self, *, rowwise: bool | None = None, columnwise: bool | None = None) -> None:
        """Ignored: the plan's usages stand."""

    def __call__(self, tensor: Any) -> Any:
        quantizer = self.quantizer
        if type(quantizer) not in RebuildQuantizer.builds_both:
            quantizer.set_usage(rowwise=self._rowwise, columnwise=self._columnwise)
            try:
                return quantizer(tensor)
            except NotImplementedError:
                RebuildQuantizer.builds_both.add(type(quantizer))
            finally:
                quantizer.set_usage(rowwise=True, columnwise=True)
        # Both usages, as TE's rebuild asks (and leaves the quantizer), then
        # the ones the plan does not name dropped at once.
        quantizer.set_usage(rowwise=True, columnwise=True)
        out = quantizer(tensor)
        out.update_usage(rowwise_usage=self._rowwise, columnwise_usage=self._columnwise)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.quantizer, name)


def state_of(module: Any) -> ModuleWorkspaceState:
    """The drop-in ``module``'s state, made on first use (a converted module
    gets its state at its first call)."""
    state = module._wm_state
    if state is None:
        state = ModuleWorkspaceState(module._wm_kind)
        module.__dict__["_wm_state"] = state  # not a parameter, buffer or submodule
    return state
