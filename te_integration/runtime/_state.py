"""The one typed object a drop-in module keeps: its workspace state.

Everything the binding remembers about a module across calls lives in its
:class:`ModuleWorkspaceState`: the pinned policy, the probe that reads the
module's FSDP2 sharding, the memo of TE levers per call shape, the plans of
the latest call, what it knows of the cache entries it filled, its rebuild
quantizers, the clock its quantized copies are stamped with (D12), and the
model it belongs to (:class:`~te_integration.runtime._model.ModelWorkspaceState`).
The module holds it as ``_wm_state``. The only other attribute the binding
sets on a module is TE's own ``is_fsdp2`` flag, answered from FSDP2's
state and held in the instance dict during a call (``_modules._FSDP2Flag``);
nothing of one call is kept here (that is the
:class:`~te_integration.runtime._call.CallRecord`).

Why a memo of levers: a training step repeats a handful of call shapes.
The first call of each shape describes it as a
:class:`~workspace_manager.WorkspaceContext`, asks the policy
(``plan_call``) and turns the plan into
:class:`~te_integration.runtime._levers.Levers`, the few values TE's code reads;
every later call of that shape is one dictionary lookup. This memo is the
only one between a call and its plan; the plan and its context stay
reachable from the levers, for :func:`last_plans`, ``explain`` and
attribution. Sound because policies are frozen and pure, and the key holds
everything the context is built from (``default_registry.generation`` voids
the memo when quantizer registrations change).

The clock (:attr:`ModuleWorkspaceState.writes`) counts the writes of the
module's weights the binding was told of: the optimizer steps that wrote one
of its parameters, and ``release_workspaces``. A copy stamped with an older
count was made from older weights (``_freshness``); another model's step
moves nothing here.
"""

from __future__ import annotations

from typing import Any

from workspace_manager import (
    BackwardOverride,
    Microbatch,
    plan_call,
    Policy,
    RecomputePass,
    RecomputeScope,
    Sharding,
    WeightSource,
    WorkspaceContext,
    WorkspacePlan,
)
from workspace_manager.extending import default_registry, probe_fsdp2_sharding, quantizer_capabilities, ShardingProbe

from ..te import _compat as te
from ._levers import Levers, levers_from_plan
from ._plan_support import UnsupportedPlanError, require_same_passes, require_supported
from ._freshness import STAMP, refresh_parameter
from ._rebuild import RebuildQuantizer
from ._model import model_state
from ._kind_registry import ModuleKind, refusal_of
from ._step_hook import ensure_hook

__all__ = ["ModuleWorkspaceState", "state_of"]


#: Instance-dependent capabilities -> a small int for memo keys (see
#: ModuleWorkspaceState._instance_keys); process-wide, as capabilities are values.
_CAPABILITY_TOKENS: dict[Any, int] = {}
#: Weight type -> whether it is a quantized tensor (isinstance, once per type).
_IS_QUANTIZED: dict[type, bool] = {}


def _learn_quantized(wtype: type) -> bool:
    is_qp = _IS_QUANTIZED[wtype] = issubclass(wtype, te.QuantizedTensorStorage)
    return is_qp


class ModuleWorkspaceState:
    """A drop-in module's workspace state (see the module docstring)."""

    __slots__ = ("kind", "_policy", "sharding_probe", "_memo", "_generation", "_quantizer_keys", "_instance_keys",
                 "_last", "filled", "_rebuilders", "writes", "model", "installed", "holds_quantized", "alike")

    def __init__(self, kind: ModuleKind, policy: Policy | None = None, *,
                 probe: ShardingProbe | None = None) -> None:
        """``probe``: how to read the module's sharding (default: made from
        FSDP2's state at the first call); anything with ``read()``,
        ``current()``, ``stale()`` and ``is_fsdp2``, e.g. for describing a
        sharding without FSDP2, and, for FSDP2's, ``parameters(module)``
        (FSDP2's records of the module's parameters; see :meth:`sharded_sources`)."""
        self.kind = kind
        self._policy = policy
        #: How this module's sharding is read (see :meth:`probe`); None until the first call, or as given.
        self.sharding_probe = probe
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
        #: weight key -> (id of the cache entry this state filled, whether it
        #: holds columnwise data, its stamp: the module's clock and the
        #: weight's version counter when it was made). A hit on that entry
        #: skips re-validating it: the binding built it with those usages,
        #: and TE never adds to or strips a cached workspace (its in-backward
        #: clear reaches only workspaces built for that call); an old stamp
        #: makes it be refreshed (D12). An id, not a reference: the entry's
        #: lifetime stays the cache's.
        self.filled: dict[str, tuple[int, bool, tuple[int, int]]] = {}
        #: weight key -> the rebuild quantizer made for it (see backward_quantizer).
        self._rebuilders: dict[str, Any] = {}
        #: The clock of the module's copies: how many writes of its weights
        #: the binding was told of (see the module docstring).
        self.writes = 0
        #: The model the module belongs to (set at its first use, or by convert_model).
        self.model: Any = None
        #: Whether the module's first managed call has run ``install`` (the
        #: state may exist before: TE's constructor calls ``reset_parameters``).
        self.installed = False
        #: Whether the module has computed with quantized parameters: their
        #: transposes are made again, and their shards trimmed, at each step that writes them.
        self.holds_quantized = False
        #: ``(ids, quantizers)`` of the expert quantizers last found alike
        #: (``_expert_quantize``), holding them so that no id is reused meanwhile.
        self.alike: tuple | None = None
        # The clock must count every optimizer step from the first drop-in
        # on: the freshness of every copy is judged by it (D12).
        ensure_hook()

    def __reduce__(self):
        # Copies and pickles keep the pinned policy only: probes point at
        # FSDP2 state and levers at this process's plans.
        return (ModuleWorkspaceState, (self.kind, self._policy))

    # -- policy -----------------------------------------------------------------
    @property
    def policy(self) -> Policy | None:
        return self._policy

    @policy.setter
    def policy(self, policy: Policy | None) -> None:
        self._policy = policy
        self._memo.clear()

    # -- the clock (D12) -----------------------------------------------------------
    def note_written(self) -> None:
        """The module's weights were written: every copy made before counts as old."""
        self.writes += 1

    def sharded_sources(self, module: Any) -> list[int] | tuple | None:
        """The ids of the sharded parameters FSDP2 gathers this module's
        parameters from (its records; empty where FSDP2 does not manage the
        module): an optimizer holds these, not what the module registers
        while it holds the unsharded ones. None: FSDP2 manages the module
        but its records list none of its parameters, so every step counts
        as writing it. A probe given to describe a sharding without FSDP2
        (one without ``parameters``) has no sharded parameters."""
        probe = self.probe(module)
        if not probe.is_fsdp2 or not hasattr(probe, "parameters"):
            return ()
        records = probe.parameters(module)
        return [id(record.sharded) for record in records] if records else None

    # -- sharding -----------------------------------------------------------------
    def sharding(self, module: Any) -> Sharding:
        """The module's sharding now, read from FSDP2's own state."""
        return self.probe(module).read()

    def probe(self, module: Any) -> ShardingProbe:
        """The module's sharding probe, made again when FSDP2 state changed."""
        probe = self.sharding_probe
        if probe is None or probe.stale():
            probe = self.sharding_probe = probe_fsdp2_sharding(module)
        return probe

    # -- levers -------------------------------------------------------------------
    def levers(self, module: Any, sharding: Sharding | None, *, key: str, weight: Any, quantizer: Any, grad: bool,
               input_requires_grad: bool, is_first_microbatch: bool | None, backward_override: str | None,
               recompute: RecomputePass, scope: RecomputeScope) -> Levers:
        """The levers for weight ``key`` in this call: a memo lookup, or the
        full planning path for the first call of a shape. ``sharding``: the
        call record's (``Sharding.DISTRIBUTED_WEIGHT`` for a TE
        ``DistributedWeight``, whose sharding is its own); None outside a
        module call (a recompute pass in backward), read from the probe then.

        Every call of every managed module runs this, so a repeated shape
        costs no Python call: attribute reads, subscripts and one tuple
        hash (the enums in the key hash by identity, in C)."""
        wtype = type(weight)
        is_qp = _IS_QUANTIZED[wtype] if wtype in _IS_QUANTIZED else _learn_quantized(wtype)
        if is_qp:
            try:
                version = weight._version
            except (AttributeError, RuntimeError):  # none kept (an inference tensor): _freshness.version_of, inline
                version = 0
            if getattr(weight, STAMP, None) != (self.writes, version):
                # Written since its derived data was made (docs/decisions.md, D12).
                refresh_parameter(weight, self.writes)
        source = weight._quantizer if is_qp else quantizer
        if default_registry.generation != self._generation:
            self._forget()
        keys, stype = self._quantizer_keys, type(source)
        if stype in keys:
            caps_key = keys[stype]
        else:
            known = self._instance_keys.get(id(source))
            caps_key = known[1] if known is not None and known[0] is source else self._capabilities_key(source)
        if sharding is None:
            sharding = self.probe(module).read()
        # The memo's key is the call as TE hands it over, not the
        # WorkspaceContext built from it: building and checking a context
        # takes 68 Python calls and hashing it 12 more, this tuple none, and
        # the call budget (tests/unit/test_call_budget.py) has no room for
        # them. It is a key only: nothing reads it but _plan, which builds
        # the one description of the call, the context, from it once.
        shape = (key, caps_key, is_qp, grad, input_requires_grad, is_first_microbatch, backward_override, recompute,
                 scope, sharding)
        try:
            levers = self._memo[shape]
        except KeyError:
            levers = self._memo[shape] = self._plan(shape, source)
            if is_qp:
                # Its parameters' transposes are made again at every
                # optimizer step that writes them (D12); under FSDP2 its shards are trimmed too.
                self.holds_quantized = True
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

    def _plan(self, shape: tuple, quantizer: Any) -> Levers:
        key, _, is_qp, grad, input_rg, first, override, recompute, scope, sharding = shape
        ctx = WorkspaceContext(
            capabilities=quantizer_capabilities(quantizer), sharding=sharding, recompute=recompute,
            recompute_scope=scope, grad_enabled=grad, input_requires_grad=input_rg,
            weight=WeightSource.QUANTIZED_PARAM if is_qp else WeightSource.HIGH_PRECISION,
            microbatch=Microbatch.from_is_first_microbatch(first), backward_override=BackwardOverride.from_te(override),
        )
        plan = plan_call(ctx, self._policy)
        require_supported(key, ctx, plan)
        self._require_kind_supports(key, ctx, plan)
        if recompute is RecomputePass.FIRST and grad and scope is RecomputeScope.REGION:
            # Only a non-reentrant checkpoint's first pass runs with grad on:
            # its recompute pass must keep the same things (see _plan_support).
            require_same_passes(key, ctx, plan, plan_call(ctx.as_recompute_pass(), self._policy))
        return levers_from_plan(key, ctx, plan)

    def _require_kind_supports(self, key: str, ctx: WorkspaceContext, plan: WorkspacePlan) -> None:
        """The kind's own refusals (its adapter's), at planning."""
        found = refusal_of(self.kind)
        reason = found[1](ctx, plan) if found is not None else None
        if reason is not None:
            name = found[0]
            raise UnsupportedPlanError(
                f"TE 2.20's {name} cannot carry out the plan for {key}: {reason}. Plan: {plan.summary()}. "
                f"Context: {ctx}. Change the policy so that it plans this context differently.")

    # -- what the latest call planned ----------------------------------------------
    def remember(self, levers: Levers) -> None:
        """Make ``levers`` the latest plan of its weight (as a call does)."""
        self._last[levers.key] = levers

    def last_plans(self) -> dict[str, tuple[WorkspaceContext, WorkspacePlan]]:
        """``{weight key: (context, plan)}`` of the latest managed call."""
        return {key: (lv.context, lv.plan) for key, lv in self._last.items()}

    def plan_of(self, key: str) -> WorkspacePlan | None:
        levers = self._last.get(key)
        return levers.plan if levers is not None else None

    def shapes_planned(self) -> int:
        """How many call shapes were planned in full (the memo's size)."""
        return len(self._memo)

    # -- backward ---------------------------------------------------------------------
    def backward_quantizer(self, levers: Levers, quantizer: Any) -> Any:
        """The weight quantizer TE's backward gets: none where dgrad reads the
        high-precision weight (TE must not rebuild), and a
        :class:`RebuildQuantizer` that builds only the plan's usages where
        they are fewer than TE's (made once per weight and quantizer)."""
        if levers.dgrad_reads_high_precision or quantizer is None:
            return None
        if type(quantizer) is RebuildQuantizer:  # set already (LayerNormMLP's own recompute)
            quantizer = quantizer.quantizer
        key, usage = levers.key, levers.rebuild_usage
        rebuilders = self._rebuilders
        rebuilder = rebuilders[key] if key in rebuilders else None
        if rebuilder is None or rebuilder.quantizer is not quantizer or rebuilder.usage is not usage:
            rebuilder = rebuilders[key] = RebuildQuantizer(quantizer, usage)
        return rebuilder


def state_of(module: Any, model: Any = None) -> ModuleWorkspaceState:
    """The drop-in ``module``'s state, made on first use, in a model: in
    ``model`` (a ``ModelWorkspaceState``) where given, which takes the module
    in, else in the model it belongs to or, for none yet, one of its own."""
    state = module._wm_state
    if state is None:
        state = ModuleWorkspaceState(module._wm_kind)
        module.__dict__["_wm_state"] = state  # not a parameter, buffer or submodule
    if model is not None:
        model.add(module, state)
    elif state.model is None:  # new, or a copy's (copies keep only the pinned policy)
        model_state(module, state)
    return state
