"""The seams through which plans reach TE, installed once and gated.

Which module is calling: a drop-in marks itself :data:`ACTIVE` in
``prepare_forward`` and unmarks itself in ``end_forward``. TE calls both
around exactly its own autograd Function (``module/linear.py``,
``layernorm_linear.py``, ``layernorm_mlp.py``: ``prepare_forward`` before
the ``try`` whose ``finally`` calls ``end_forward``), so a TE module called
before or after that window, inside a user subclass's ``forward`` (a LoRA
adapter, say), sees no active drop-in and is planned as itself: stock TE
for a stock module, its own plan for a drop-in.

Two kinds of seam, both gated by :data:`ACTIVE`, so stock TE modules (and
managed calls TE handles itself) run TE's code unchanged:

* ``quantize_weight`` in the globals of TE's three module files: carries
  the cache action and the forward usage for high-precision weights.
* The autograd Functions ``_Linear``, ``_LayerNormLinear`` and
  ``_LayerNormMLP`` (same names, so ``grad_fn`` names do not change): look
  up each weight's :class:`~te_integration._state.Levers`, set TE's
  ``is_fsdp2`` lever (whether the workspace is saved), the in-backward clear
  and the rebuild quantizer on the autograd ctx, and run the release after
  backward, also when backward raises. See [Note: workspace lifetime] in
  ``workspace_manager._policy`` for what each plan means.
"""

from __future__ import annotations

import threading
from typing import Any

from workspace_manager import CacheAction

from . import _attribution
from . import _compat as te
from ._state import Levers, ModuleKind, ModuleWorkspaceState, RebuildQuantizer
from ._steps import release_after_step
from ._foreign import ForeignPatchError, SeamedName, foreign_patches, in_place, refuse_foreign_patches

class _Active(threading.local):
    """The drop-in module whose TE forward is running in this thread
    (between its ``prepare_forward`` and ``end_forward``), or None.

    The hot paths read and write ``module`` directly: an attribute of a
    thread-local costs no Python call, where a ``ContextVar`` costs one per
    read. Per thread, as autograd runs a recompute pass's forward on its own
    thread. ``get``/``set``/``reset`` are the same for other callers."""

    module: Any = None

    def get(self) -> Any:
        return self.module

    def set(self, module: Any) -> Any:
        """Mark ``module``; returns the token for :meth:`reset` (the module marked before)."""
        previous, self.module = self.module, module
        return previous

    def reset(self, token: Any) -> None:
        self.module = token


ACTIVE = _Active()

_LEDGER = _attribution.LEDGER
_INSTALL_LOCK = threading.Lock()
#: Held by a LayerNormMLP call whose FC1 and FC2 save differently while it swaps
#: ``prepare_for_saving`` (:func:`_forward_split`); reentrant, as a lock taken in a
#: forward must not deadlock a nested call on the same thread.
_SPLIT_LOCK = threading.RLock()
#: Whether install() ran (read by the drop-ins before each call).
INSTALLED = False


def te_recompute_code() -> int:
    """Where ``te.checkpoint`` says the call is: 0 none, 1 first pass, 2
    recompute pass (TE sets its flags only while FP8 is on, the only time a
    workspace exists). The hot paths ask only inside a recompute region
    (TE's ``_IN_ACTIVATION_RECOMPUTE_REGION``, read as an attribute)."""
    if not te.is_fp8_activation_recompute_enabled():
        return 0
    return 2 if te.in_fp8_activation_recompute_phase() else 1


def is_distributed(weight: Any) -> bool:
    """A TE ``DistributedWeight``: TE's own check validates a flagged weight
    (the Linear seam asks only for a flagged one: one getattr per call)."""
    return bool(getattr(weight, "is_distributed_weight", False)) and te.is_distributed_weight(weight)


#: Stands for a distributed weight's slot in a call's weights: TE quantizes
#: the weight it gathered, a tensor the seam never sees before.
GATHERED = object()
_SEAMED: tuple[SeamedName, ...] = ()
#: What each seamed name held before install put the seam there (TE's own
#: definition: install refuses anything else), for uninstall to put back.
_REPLACED: dict[tuple[int, str], object] = {}


# -- S1: quantize_weight ------------------------------------------------------
def managed_quantize_weight(*, tensor=None, quantizer=None, workspace=None, update_workspace=True,
                            skip_update_flag=None, fsdp_group=None, workspace_dtype=None, cache=False):
    """TE's ``quantize_weight`` with the cache and usage taken from the plan.

    The binding owns the cache: TE's ``workspace``/``cache`` arguments are
    ignored and no new workspace is returned, so TE never stores one.
    """
    module = ACTIVE.module
    levers = None
    if module is not None:
        weights = module._wm_state.weights
        if weights and (weights[0] is tensor or weights[0] is GATHERED):  # the common case: the first weight
            levers = weights[1]
        elif weights:
            levers = module._wm_state.slot_for(tensor)
    if levers is None or levers.is_quantized_param:
        # Quantized parameters are never cached; TE only adds the usages
        # their own quantizer holds. Everything unplanned is stock TE.
        out, new = te.quantize_weight(tensor=tensor, quantizer=quantizer, workspace=workspace,
                                      update_workspace=update_workspace, skip_update_flag=skip_update_flag,
                                      fsdp_group=fsdp_group, workspace_dtype=workspace_dtype, cache=cache)
        if _LEDGER.enabled and levers is None and not isinstance(tensor, te.QuantizedTensorStorage):
            _attribution.forward_workspace(None, None, None, out, from_cache=bool(cache) or out is workspace,
                                           weight=tensor)
        return out, new
    if levers.cache is not CacheAction.BYPASS:
        out, hit = _cached_quantize(module, levers, tensor, quantizer, skip_update_flag, workspace_dtype)
    else:  # the common case, spelled here: one Python call fewer per module call
        want_columnwise, hit = levers.forward_columnwise, False
        if quantizer.columnwise_usage is not want_columnwise or not quantizer.rowwise_usage:
            quantizer.set_usage(rowwise=True, columnwise=want_columnwise)
        out, _ = te.quantize_weight(tensor=tensor, quantizer=quantizer, workspace=None, update_workspace=True,
                                    skip_update_flag=skip_update_flag, workspace_dtype=workspace_dtype)
    if levers.drops_workspace and module._wm_state.dropped is not None:  # FC1 and FC2 save differently
        module._wm_state.dropped.append(out)
    if levers.saves_columnwise_only and not hit:  # a fresh workspace (a cache entry keeps what it holds)
        # D11: the rowwise tensors, found now: TE's prepare_for_saving
        # empties the storage before its forward returns (see _end_call).
        parts = _rowwise_parts(out)
        if parts:
            state = module._wm_state
            state.rowwise_parts = parts if state.rowwise_parts is None else state.rowwise_parts + parts
    if _LEDGER.enabled:
        _attribution.forward_workspace(module, levers.key, levers.plan, out, from_cache=hit)
    return out, None


def _cached_quantize(module, levers: Levers, tensor, quantizer, skip_update_flag, workspace_dtype):
    """Quantize a high-precision weight through the module's cache as its
    plan says (FILL, REUSE or READ_ONLY); returns the workspace and whether
    it came from the cache."""
    state: ModuleWorkspaceState = module._wm_state
    want_columnwise = levers.forward_columnwise
    if quantizer.columnwise_usage is not want_columnwise or not quantizer.rowwise_usage:
        quantizer.set_usage(rowwise=True, columnwise=want_columnwise)
    action, key = levers.cache, levers.key
    cached = state.cached(module._fp8_workspaces, key)  # this call's fill first, then the module's cache
    # An entry this state filled with the usages wanted serves as it is
    # (see ModuleWorkspaceState.filled); any other is checked in full.
    filled = state.filled.get(key)
    if cached is not None and (
            (filled is not None and filled[0] == id(cached) and (filled[1] or not want_columnwise))
            or _usable(cached, tensor, quantizer, want_columnwise)):
        if action is not CacheAction.FILL and skip_update_flag is None:
            return cached, True  # what TE's quantize_weight returns for a hit it must not refresh
        out, _ = te.quantize_weight(tensor=tensor, quantizer=quantizer, workspace=cached, update_workspace=True,
                                    skip_update_flag=skip_update_flag, workspace_dtype=workspace_dtype)
        return out, True
    if action is CacheAction.READ_ONLY:  # missed: a fresh workspace, not stored
        out, _ = te.quantize_weight(tensor=tensor, quantizer=quantizer, workspace=None, update_workspace=True,
                                    skip_update_flag=skip_update_flag, workspace_dtype=workspace_dtype)
        return out, False
    out, new = te.quantize_weight(tensor=tensor, quantizer=quantizer, workspace=None, update_workspace=True,
                                  skip_update_flag=skip_update_flag, workspace_dtype=workspace_dtype, cache=True)
    state.fill(key, new, want_columnwise)
    return out, False


def _rowwise_parts(workspace) -> list:
    """The tensors only rowwise reads of ``workspace`` need, where its
    columnwise data exists apart from them (TE 2.20.2's storages: FP8
    ``_data`` next to a valid ``_transpose``; block/MX/NVFP4
    ``_rowwise_data`` and ``_rowwise_scale_inv`` next to ``_columnwise_data``).
    Per-tensor FP8's ``_scale_inv`` serves both, so it stays."""
    if type(workspace) in _TRANSPOSE_LAYOUTS:  # every D11 call of per-tensor FP8: attribute reads only
        data = workspace._data
        return [data] if data is not None and workspace._transpose is not None and not workspace._transpose_invalid \
            else []
    transpose = getattr(workspace, "_transpose", None)
    if transpose is not None and not getattr(workspace, "_transpose_invalid", False):
        data = getattr(workspace, "_data", None)
        if data is not None and isinstance(workspace, te.QuantizedTensorStorage):  # a TE class: one layout
            _TRANSPOSE_LAYOUTS.add(type(workspace))
        return [data] if data is not None else []
    if getattr(workspace, "_columnwise_data", None) is not None:
        return [t for t in (getattr(workspace, "_rowwise_data", None), getattr(workspace, "_rowwise_scale_inv", None))
                if t is not None]
    return []


#: Storage classes seen with the per-tensor layout (``_data``, ``_transpose``,
#: ``_transpose_invalid``).
_TRANSPOSE_LAYOUTS: set[type] = set()


def _save_columnwise_only(ctx, parts: list) -> None:
    """D11: leave ``parts`` (see :func:`_rowwise_parts`) out of what ``ctx``
    saves for backward. TE's storages were split into their tensors by
    ``prepare_for_saving`` and handed to ``ctx.save_for_backward``; a None in
    a rowwise slot restores as a storage without rowwise data, as
    ``update_usage(rowwise_usage=False)`` would leave it. The memory is freed
    when this forward returns; the GEMM that read it was queued first on the
    same stream."""
    saved = getattr(ctx, "to_save", None)
    if not saved:
        return
    if len(parts) == 1:  # per-tensor FP8: its data only (list comprehensions are inlined: no calls)
        part = parts[0]
        ctx.to_save = tuple([None if t is part else t for t in saved])
    else:
        drop = {id(t) for t in parts}
        ctx.to_save = tuple([None if t is not None and id(t) in drop else t for t in saved])


def _usable(workspace, tensor, quantizer, want_columnwise: bool) -> bool:
    """Stricter than TE's ``_is_weight_workspace_valid``: it also checks
    block-FP8 usages, missing rowwise data, shape and format."""
    if not te.is_weight_workspace_valid(workspace, quantizer):
        return False
    try:
        usages = workspace.get_usages()
    except (AttributeError, NotImplementedError):
        # Storages that cannot report their usages (TE's Python reference
        # quantizers) are judged by TE's own check alone, as stock TE does.
        usages = {"rowwise": True, "columnwise": True}
    if not usages.get("rowwise", False) or (want_columnwise and not usages.get("columnwise", False)):
        return False
    if tuple(workspace.shape) != tuple(tensor.shape):
        return False
    return type(getattr(workspace, "_quantizer", quantizer)) is type(quantizer)


# -- S2: the autograd Functions ---------------------------------------------
# These run on every call of every TE module once installed, so their common
# paths are spelled inline: attribute reads, one memo lookup
# (ModuleWorkspaceState.levers) and TE's own Function; each Python call
# avoided is about a microsecond of host time per module call.

# Calls TE handles on its own pass through every seam unchanged: no FP8 (no
# workspace), debug quantizers, FSDP1 (``fsdp_group``), CUDA-graph capture
# (``skip_fp8_weight_update`` or TE's capture flag), CPU offload. Listed in
# docs/te-integration.md; each Function seam spells the test inline.

def _gate(args: dict) -> tuple[int, ...] | None:
    """Positions of the pass-through test's fields in TE's argument tuple
    (None for an argument map without them: a test stand-in of TE)."""
    names = ("fp8", "debug", "fsdp_group", "skip_fp8_weight_update", "cpu_offloading")
    return tuple(args[name] for name in names) if all(name in args for name in names) else None


_LINEAR, _LNL, _LNMLP = ModuleKind.LINEAR, ModuleKind.LAYERNORM_LINEAR, ModuleKind.LAYERNORM_MLP
_LNL_GATE, _LNMLP_GATE = _gate(getattr(te, "LNL_ARGS", {})), _gate(getattr(te, "LNMLP_ARGS", {}))


def _end_call(module, ctx) -> None:
    """TE's forward returned with something to keep: the workspaces it
    filled go into the module's cache, and D11 edits what ``ctx`` saves
    (see :func:`_save_columnwise_only`). A failed forward keeps neither."""
    state: ModuleWorkspaceState = module._wm_state
    if state.pending:
        state.commit(module._fp8_workspaces)
    if state.rowwise_parts and ctx is not None:
        _save_columnwise_only(ctx, state.rowwise_parts)


class _Linear(te.LinearFunction):
    """TE's ``_Linear``, with the weight's plan applied."""

    @staticmethod
    def forward(ctx, weight, inp, bias, fwd_args):
        module = ACTIVE.module  # then the pass-through test (see _gate)
        if (module is None or module._wm_kind is not _LINEAR or not fwd_args.fp8 or fwd_args.debug
                or fwd_args.fsdp_group is not None or fwd_args.skip_fp8_weight_update is not None
                or fwd_args.cpu_offloading or te.graph_flags._IS_GRAPH_CAPTURING):
            out = te.LinearFunction.forward(ctx, weight, inp, bias, fwd_args)
            if ctx is not None:
                ctx._te_wm_release = None
                if _LEDGER.enabled:
                    _attribution.tag(ctx, _attribution.current_module())
            return out
        state: ModuleWorkspaceState = module._wm_state
        distributed = getattr(weight, "is_distributed_weight", False) and is_distributed(weight)
        levers = state.levers(
            module, "weight", weight, fwd_args.weight_quantizer, fwd_args.is_grad_enabled,
            fwd_args.input_requires_grad, fwd_args.is_first_microbatch, fwd_args.backward_override,
            te_recompute_code() if te.recompute_flags._IN_ACTIVATION_RECOMPUTE_REGION else 0, False, distributed,
        )
        fwd_args.is_fsdp2 = levers.drops_workspace
        state.weights = (GATHERED if distributed else weight, levers)
        try:
            out = te.LinearFunction.forward(ctx, weight, inp, bias, fwd_args)
            if state.pending or state.rowwise_parts:
                _end_call(module, ctx)
        finally:
            state.weights, state.pending, state.rowwise_parts = (), None, None
        if ctx is not None:
            bwd = ctx.backward_objects
            bwd.is_fsdp2 = levers.te_clear
            if levers.no_backward_quantizer or levers.rebuild_usage is not None:
                bwd.weight_quantizer = state.backward_quantizer(levers, bwd.weight_quantizer)
            ctx._te_wm_release = _release_record(module, (weight, levers)) if levers.releases else None
            if _LEDGER.enabled:
                _attribution.tag(ctx, module)
        return out

    @staticmethod
    def backward(ctx, grad_output, grad_workspace):
        if ctx._te_wm_release is None and not _LEDGER.enabled:
            return te.LinearFunction.backward(ctx, grad_output, grad_workspace)
        return _backward(ctx, te.LinearFunction.backward, grad_output, grad_workspace)


class _LayerNormLinear(te.LNLFunction):
    """TE's ``_LayerNormLinear``, with the weight's plan applied."""

    @staticmethod
    def forward(ctx, inp, ln_weight, ln_bias, weight, weight_workspace, bias, non_tensor_args):
        module, a, nta = ACTIVE.module, te.LNL_ARGS, non_tensor_args
        fp8, debug, group, skip, offload = _LNL_GATE
        if (module is None or module._wm_kind is not _LNL or not nta[fp8] or nta[debug] or nta[group] is not None
                or nta[skip] is not None or nta[offload] or te.graph_flags._IS_GRAPH_CAPTURING):
            out = te.LNLFunction.forward(ctx, inp, ln_weight, ln_bias, weight, weight_workspace, bias, nta)
            return _observed(ctx, None, out) if _LEDGER.enabled else out
        state: ModuleWorkspaceState = module._wm_state
        distributed = getattr(weight, "is_distributed_weight", False) and is_distributed(weight)
        recipe = te.FP8GlobalStateManager.get_fp8_recipe()
        levers = state.levers(
            module, "weight", weight, nta[a["weight_quantizer"]], nta[a["is_grad_enabled"]], True,
            nta[a["is_first_microbatch"]], getattr(recipe, "backward_override", None),
            te_recompute_code() if te.recompute_flags._IN_ACTIVATION_RECOMPUTE_REGION else 0, False, distributed,
        )
        i = a["is_fsdp2"]
        nta = nta[:i] + (levers.drops_workspace,) + nta[i + 1:]
        state.weights = (GATHERED if distributed else weight, levers)
        try:
            out = te.LNLFunction.forward(ctx, inp, ln_weight, ln_bias, weight, weight_workspace, bias, nta)
            if state.pending or state.rowwise_parts:
                _end_call(module, ctx)
        finally:
            state.weights, state.pending, state.rowwise_parts = (), None, None
        if ctx is not None and nta[a["is_grad_enabled"]]:
            ctx.is_fsdp2 = levers.te_clear
            if levers.no_backward_quantizer or levers.rebuild_usage is not None:
                ctx.weight_quantizer = state.backward_quantizer(levers, ctx.weight_quantizer)
            ctx._te_wm_release = _release_record(module, (weight, levers)) if levers.releases else None
        return _observed(ctx, module, out) if _LEDGER.enabled else out

    @staticmethod
    def backward(ctx, *grad_outputs):
        if getattr(ctx, "_te_wm_release", None) is None and not _LEDGER.enabled:
            return te.LNLFunction.backward(ctx, *grad_outputs)
        return _backward(ctx, te.LNLFunction.backward, *grad_outputs)


class _LayerNormMLP(te.LNMLPFunction):
    """TE's ``_LayerNormMLP``; ``_forward`` is overridden because TE calls it
    both for the forward and for its own checkpoint recompute in backward."""

    @staticmethod
    def _forward(ctx, inp, ln_w, ln_b, fc1_w, fc1_ws, fc1_b, fc2_w, fc2_ws, fc2_b, non_tensor_args):
        nta, a = non_tensor_args, te.LNMLP_ARGS
        recompute = bool(nta[a["recompute_for_bwd"]])
        module = getattr(ctx, "_te_wm_module", None) if recompute else ACTIVE.module
        fp8, debug, group, skip, offload = _LNMLP_GATE
        # TE's LayerNormMLP has no distributed-weight path; such weights stay TE's.
        if (module is None or module._wm_kind is not _LNMLP or not nta[fp8] or nta[debug] or nta[group] is not None
                or nta[skip] is not None or nta[offload] or te.graph_flags._IS_GRAPH_CAPTURING
                or getattr(fc1_w, "is_distributed_weight", False) or getattr(fc2_w, "is_distributed_weight", False)):
            out = te.LNMLPFunction._forward(ctx, inp, ln_w, ln_b, fc1_w, fc1_ws, fc1_b, fc2_w, fc2_ws, fc2_b, nta)
            return out if recompute or not _LEDGER.enabled else _observed(ctx, None, out)
        weights = _plan_mlp(module, nta, fc1_w, fc2_w)
        split = weights[1].drops_workspace is not weights[3].drops_workspace
        i = a["is_fsdp2"]
        nta = nta[:i] + (weights[1].drops_workspace and weights[3].drops_workspace,) + nta[i + 1:]
        previous = ACTIVE.set(module) if recompute else None  # backward thread: not inside the module's window
        state: ModuleWorkspaceState = module._wm_state
        state.weights = weights
        try:
            args = (ctx, inp, ln_w, ln_b, fc1_w, fc1_ws, fc1_b, fc2_w, fc2_ws, fc2_b, nta)
            out = _forward_split(state, args) if split else te.LNMLPFunction._forward(*args)
            if state.pending or state.rowwise_parts:
                _end_call(module, ctx)
        finally:
            state.weights, state.pending, state.rowwise_parts, state.dropped = (), None, None, None
            if recompute:
                ACTIVE.reset(previous)
        if ctx is not None and nta[a["is_grad_enabled"]]:
            _edit_mlp_ctx(ctx, module, weights, nta, recompute)
        if recompute:
            return _rebuild_in_backward(out, weights) if weights[1].drops_workspace or weights[3].drops_workspace \
                else out
        return _observed(ctx, module, out) if _LEDGER.enabled else out

    @staticmethod
    def backward(ctx, *grad_outputs):
        try:
            # Own checkpoint (_te_wm_module set): the release record is
            # written by the recompute pass, inside TE's backward.
            if (getattr(ctx, "_te_wm_release", None) is None and getattr(ctx, "_te_wm_module", None) is None
                    and not _LEDGER.enabled):
                return te.LNMLPFunction.backward(ctx, *grad_outputs)
            return _backward(ctx, te.LNMLPFunction.backward, *grad_outputs)
        finally:
            ctx._te_wm_module = None


def _plan_mlp(module, nta: tuple, fc1_w, fc2_w) -> tuple:
    """(fc1 weight, its levers, fc2 weight, its levers) for this call."""
    a = te.LNMLP_ARGS
    grad, own_checkpoint = bool(nta[a["is_grad_enabled"]]), bool(nta[a["checkpoint"]])
    recompute = te_recompute_code() if te.recompute_flags._IN_ACTIVATION_RECOMPUTE_REGION else 0
    module_scope = False
    if own_checkpoint and grad:
        # The module's own checkpoint: its first pass saves inputs only, like
        # a reentrant checkpoint's first pass, so it is planned as one; its
        # recompute pass hands what it builds straight to backward.
        recompute = 2 if nta[a["recompute_for_bwd"]] else 1
        grad, module_scope = recompute == 2, True
    state: ModuleWorkspaceState = module._wm_state
    first = nta[a["is_first_microbatch"]]
    fc1 = state.levers(module, "fc1_weight", fc1_w, nta[a["fc1_weight_quantizer"]], grad, True, first, None,
                       recompute, module_scope)
    fc2 = state.levers(module, "fc2_weight", fc2_w, nta[a["fc2_weight_quantizer"]], grad, True, first, None,
                       recompute, module_scope)
    return (fc1_w, fc1, fc2_w, fc2)


def _forward_split(state: ModuleWorkspaceState, args: tuple):
    """TE's ``_forward`` for FC1 and FC2 planned to save differently. TE
    2.20.2 saves or drops both workspaces with one ``is_fsdp2`` switch, so it
    runs with the switch off (both saved) while the workspaces of the weight
    that backward rebuilds (recorded by :func:`managed_quantize_weight`) are
    handed to TE's ``prepare_for_saving`` as None. Backward then finds None
    in that place, TE's own signal to quantize the weight again
    (``if fc1_weight is None``). The module's own recompute pass returns its
    tensors instead (:func:`_rebuild_in_backward`). The name is swapped in
    ``layernorm_mlp.py``'s globals for this call only. Another module's call
    on another thread meanwhile passes through the swap unchanged (it
    replaces only this call's workspaces); another such split call waits
    for this one, so that neither puts TE's name back under the other."""
    dropped = state.dropped = []
    with _SPLIT_LOCK:
        original = te.lnmlp_module.prepare_for_saving

        def prepare_for_saving(*tensors):
            return original(*[None if any(t is d for d in dropped) else t for t in tensors])

        te.lnmlp_module.prepare_for_saving = prepare_for_saving
        try:
            return te.LNMLPFunction._forward(*args)
        finally:
            te.lnmlp_module.prepare_for_saving = original


def _rebuild_in_backward(recomputed: tuple, weights: tuple) -> tuple:
    """The module's own recompute pass hands the workspaces it built straight
    to backward: TE skips the FSDP2 path there (``fsdp2_skip_columnwise`` is
    off while recomputing), so ``is_fsdp2`` cannot keep them out. For a
    weight whose plan requantizes in backward, its place in what the pass
    returns becomes None, which is TE's own signal to quantize the weight
    again with ``ctx``'s quantizer (``if fc1_weight is None`` in
    ``_LayerNormMLP.backward``), the one :func:`_edit_mlp_ctx` set."""
    out = list(recomputed)
    for name, weight, levers in (("fc1_weight", weights[0], weights[1]), ("fc2_weight", weights[2], weights[3])):
        i = te.LNMLP_RECOMPUTED[name]
        if levers.drops_workspace and out[i] is not weight:  # as TE: a quantized parameter is its own workspace
            out[i] = None
    return tuple(out)


def _edit_mlp_ctx(ctx, module, weights: tuple, nta: tuple, recompute: bool) -> None:
    a = te.LNMLP_ARGS
    if recompute or not nta[a["checkpoint"]]:
        # TE's ctx block ran: its clear flag is shared by FC1 and FC2, so it
        # is set only when both plans want it; the release covers the rest.
        ctx.is_fsdp2 = weights[1].te_clear and weights[3].te_clear
        ctx._te_wm_release = _release_record(module, weights)
        state: ModuleWorkspaceState = module._wm_state
        for levers, name in ((weights[1], "fc1_weight_quantizer"), (weights[3], "fc2_weight_quantizer")):
            if levers.no_backward_quantizer or levers.rebuild_usage is not None:
                setattr(ctx, name, state.backward_quantizer(levers, getattr(ctx, name, None)))
    if not recompute and nta[a["checkpoint"]]:
        ctx._te_wm_module = module  # read again by the module's own recompute in backward


# -- after backward -----------------------------------------------------------------
def _release_record(module, weights: tuple) -> tuple | None:
    """What to release once this call's backward is done, kept on the
    autograd ctx (backward never reads :data:`ACTIVE`: autograd may run it
    on another thread). None, the common case, costs nothing."""
    if not (weights[1].releases or (len(weights) > 2 and weights[3].releases)):
        return None
    items = tuple((weights[i], weights[i + 1]) for i in range(0, len(weights), 2) if weights[i + 1].releases)
    return (module, items)


def _release(record: tuple) -> None:
    module, items = record
    for tensor, levers in items:
        if levers.release_columnwise and isinstance(tensor, te.QuantizedTensorStorage):
            te.clear_columnwise_cache(tensor)
        if levers.release_cache:
            release_after_step(module, levers.key)


def _backward(ctx, te_backward, *grads):
    """TE's backward, then the plan's release, also when TE's backward raises
    (a failed step must not leave cached or derived data behind)."""
    marking = _LEDGER.enabled and _attribution.marks_backward(ctx)
    if marking:
        _attribution.backward_mark(ctx, "start")
    try:
        return te_backward(ctx, *grads)
    finally:
        record = getattr(ctx, "_te_wm_release", None)
        if record is not None:
            ctx._te_wm_release = None
            _release(record)
        if marking:
            _attribution.backward_mark(ctx, "end")


def _observed(ctx, module, out):
    """While recording, remember whose backward ``ctx`` is (stock modules
    are named by the recording's forward hooks)."""
    if _LEDGER.enabled and ctx is not None:
        _attribution.tag(ctx, module if module is not None else _attribution.current_module())
    return out


def _seamed_names() -> tuple[SeamedName, ...]:
    """The names install replaces, with TE's own definition of each."""
    linear, lnl, lnmlp = te.linear_module, te.lnl_module, te.lnmlp_module
    qw = f"{te.base_module.__name__}.quantize_weight"
    return tuple(SeamedName(m, "quantize_weight", qw, managed_quantize_weight) for m in (linear, lnl, lnmlp)) + (
        SeamedName(linear, "_Linear", f"{linear.__name__}._Linear", _Linear, te.LinearFunction),
        SeamedName(lnl, "_LayerNormLinear", f"{lnl.__name__}._LayerNormLinear", _LayerNormLinear, te.LNLFunction),
        SeamedName(lnmlp, "_LayerNormMLP", f"{lnmlp.__name__}._LayerNormMLP", _LayerNormMLP, te.LNMLPFunction),
    )


def install() -> None:
    """Put the seams into TE's module globals, once per process.

    Raises :class:`ForeignPatchError`, changing nothing, while another
    library's patch holds one of those names, whether it was made before
    te_integration's import or before install. Each drop-in asks again at
    its first call, so a patch made over installed seams is found there.
    """
    global INSTALLED, _SEAMED
    with _INSTALL_LOCK:
        if INSTALLED and in_place(_SEAMED):
            return
        names = _SEAMED or _seamed_names()
        refuse_foreign_patches(names)
        for seamed in names:
            current = getattr(seamed.module, seamed.name)
            if current is not seamed.ours:
                _REPLACED[(id(seamed.module), seamed.name)] = current
            setattr(seamed.module, seamed.name, seamed.ours)
        _SEAMED, INSTALLED = names, True


def uninstall() -> None:
    """Put TE's own definitions back where install put the seams: stock TE
    modules then run TE's code untouched. The next drop-in call installs
    the seams again (each drop-in checks before its call).

    Raises :class:`ForeignPatchError`, changing nothing, while another
    library's patch holds one of those names (it is that library's to
    undo), and RuntimeError during a drop-in's forward."""
    global INSTALLED
    with _INSTALL_LOCK:
        if ACTIVE.get() is not None:
            raise RuntimeError("uninstall_seams() was called inside a drop-in's forward; call it between calls")
        if not _SEAMED:
            return  # never installed
        found = foreign_patches(_SEAMED)
        if found:
            raise ForeignPatchError("te_integration cannot take its seams out of TransformerEngine: " + "; ".join(found)
                                    + ". That patch is its library's to undo. Nothing was changed.")
        for seamed in _SEAMED:
            if getattr(seamed.module, seamed.name) is seamed.ours:
                setattr(seamed.module, seamed.name, _REPLACED[(id(seamed.module), seamed.name)])
        INSTALLED = False
