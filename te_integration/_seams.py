"""The seams through which plans reach TE, installed once and gated.

Two kinds, both gated by the active :class:`ManagedCall`, so stock TE
modules (and managed calls TE handles itself) run TE's code unchanged:

* ``quantize_weight`` in the globals of TE's three module files: carries
  the cache action and the forward usage for high-precision weights.
* The autograd Functions ``_Linear``, ``_LayerNormLinear`` and
  ``_LayerNormMLP`` (same names, so ``grad_fn`` names do not change): plan
  each weight, set TE's ``is_fsdp2`` lever (whether the workspace is saved),
  the in-backward clear and the rebuild quantizer on the autograd ctx, and
  run the release after backward. See [Note: workspace lifetime] in
  ``workspace_manager._policy`` for what each plan means.
"""

from __future__ import annotations

import threading

from workspace_manager import CacheAction, RecomputePass, RecomputeScope, Usage

from . import _attribution
from . import _compat as te
from ._call import ACTIVE, ManagedCall, WeightSlot, passes_through, te_recompute_pass
from ._foreign import SeamedName, in_place, refuse_foreign_patches

_INSTALL_LOCK = threading.Lock()
_INSTALLED = False
_SEAMED: tuple[SeamedName, ...] = ()


# -- S1: quantize_weight ------------------------------------------------------
def managed_quantize_weight(*, tensor=None, quantizer=None, workspace=None, update_workspace=True,
                            skip_update_flag=None, fsdp_group=None, workspace_dtype=None, cache=False):
    """TE's ``quantize_weight`` with the cache and usage taken from the plan.

    The binding owns the cache: TE's ``workspace``/``cache`` arguments are
    ignored and no new workspace is returned, so TE never stores one.
    """
    call = ACTIVE.get()
    slot = call.slot_for(tensor) if call is not None else None
    out, new = _quantize_weight(call, slot, tensor=tensor, quantizer=quantizer, workspace=workspace,
                                update_workspace=update_workspace, skip_update_flag=skip_update_flag,
                                fsdp_group=fsdp_group, workspace_dtype=workspace_dtype, cache=cache)
    if _attribution.LEDGER.enabled and not isinstance(tensor, te.QuantizedTensorStorage):
        if slot is None:  # a stock module: seen, not planned
            _attribution.forward_workspace(None, None, None, out, from_cache=bool(cache) or out is workspace,
                                           weight=tensor)
        else:
            _attribution.forward_workspace(call.module, slot.key, slot.plan, out,
                                           from_cache=out is call.cached(slot.key))
    return out, new


managed_quantize_weight._te_wm_seam = True  # lets _compat tell our seam from a foreign patch


def _quantize_weight(call, slot, *, tensor, quantizer, workspace, update_workspace, skip_update_flag, fsdp_group,
                     workspace_dtype, cache):
    if slot is None or slot.is_quantized_param:
        # Quantized parameters are never cached; TE only adds the usages
        # their own quantizer holds. Everything unplanned is stock TE.
        return te.quantize_weight(tensor=tensor, quantizer=quantizer, workspace=workspace,
                                  update_workspace=update_workspace, skip_update_flag=skip_update_flag,
                                  fsdp_group=fsdp_group, workspace_dtype=workspace_dtype, cache=cache)
    want_columnwise = Usage.COLUMNWISE in slot.plan.forward_usage
    quantizer.set_usage(rowwise=True, columnwise=want_columnwise)
    common = dict(tensor=tensor, quantizer=quantizer, skip_update_flag=skip_update_flag,
                  fsdp_group=None, workspace_dtype=workspace_dtype)
    action = slot.plan.cache
    cached = call.cached(slot.key) if action is not CacheAction.BYPASS else None
    usable = cached is not None and _usable(cached, tensor, quantizer, want_columnwise)
    if usable and action in (CacheAction.REUSE, CacheAction.READ_ONLY, CacheAction.FILL):
        # A hit: FILL refreshes in place (new weights), the others read as is.
        out, _ = te.quantize_weight(workspace=cached, update_workspace=action is CacheAction.FILL, cache=False,
                                    **common)
        return out, None
    if action in (CacheAction.FILL, CacheAction.REUSE):
        out, new = te.quantize_weight(workspace=None, update_workspace=True, cache=True, **common)
        call.pending_cache[slot.key] = new
        return out, None
    out, _ = te.quantize_weight(workspace=None, update_workspace=True, cache=False, **common)
    return out, None


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
def _active(kind: str) -> ManagedCall | None:
    call = ACTIVE.get()
    return call if call is not None and call.kind == kind else None


class _Linear(te.LinearFunction):
    """TE's ``_Linear``, with the weight's plan applied."""

    @staticmethod
    def forward(ctx, weight, inp, bias, fwd_args):
        call = _active("linear")
        if call is None or passes_through(
            fp8=fwd_args.fp8, debug=fwd_args.debug, fsdp_group=fwd_args.fsdp_group,
            skip_update=fwd_args.skip_fp8_weight_update, cpu_offloading=fwd_args.cpu_offloading, weights=(weight,),
        ):
            return _observed(ctx, None, te.LinearFunction.forward(ctx, weight, inp, bias, fwd_args))
        slot = call.plan_weight(
            "weight", weight, fwd_args.weight_quantizer, grad=fwd_args.is_grad_enabled,
            input_requires_grad=fwd_args.input_requires_grad, is_first_microbatch=fwd_args.is_first_microbatch,
            backward_override=fwd_args.backward_override, recompute=te_recompute_pass(),
        )
        fwd_args.is_fsdp2 = slot.drops_workspace
        out = te.LinearFunction.forward(ctx, weight, inp, bias, fwd_args)
        if ctx is not None:
            bwd = ctx.backward_objects
            bwd.is_fsdp2 = slot.te_clear
            if slot.no_backward_quantizer:
                bwd.weight_quantizer = None
            ctx._te_wm_record = call.release_record([slot])
        return _observed(ctx, call.module, out)

    @staticmethod
    def backward(ctx, grad_output, grad_workspace):
        return _backward(ctx, te.LinearFunction.backward, grad_output, grad_workspace)


class _LayerNormLinear(te.LNLFunction):
    """TE's ``_LayerNormLinear``, with the weight's plan applied."""

    @staticmethod
    def forward(ctx, inp, ln_weight, ln_bias, weight, weight_workspace, bias, non_tensor_args):
        call, a = _active("lnl"), te.LNL_ARGS
        nta = non_tensor_args
        if call is None or _passes_through_tuple(nta, a, (weight,)):
            out = te.LNLFunction.forward(ctx, inp, ln_weight, ln_bias, weight, weight_workspace, bias, nta)
            return _observed(ctx, None, out)
        slot = call.plan_weight(
            "weight", weight, nta[a["weight_quantizer"]], grad=nta[a["is_grad_enabled"]],
            input_requires_grad=True, is_first_microbatch=nta[a["is_first_microbatch"]],
            backward_override=_recipe_backward_override(), recompute=te_recompute_pass(),
        )
        nta = _replace_at(nta, a["is_fsdp2"], slot.drops_workspace)
        out = te.LNLFunction.forward(ctx, inp, ln_weight, ln_bias, weight, weight_workspace, bias, nta)
        if ctx is not None and nta[a["is_grad_enabled"]]:
            ctx.is_fsdp2 = slot.te_clear
            if slot.no_backward_quantizer:
                ctx.weight_quantizer = None
            ctx._te_wm_record = call.release_record([slot])
        return _observed(ctx, call.module, out)

    @staticmethod
    def backward(ctx, *grad_outputs):
        return _backward(ctx, te.LNLFunction.backward, *grad_outputs)


class _LayerNormMLP(te.LNMLPFunction):
    """TE's ``_LayerNormMLP``; ``_forward`` is overridden because TE calls it
    both for the forward and for its own checkpoint recompute in backward."""

    @staticmethod
    def _forward(ctx, inp, ln_w, ln_b, fc1_w, fc1_ws, fc1_b, fc2_w, fc2_ws, fc2_b, non_tensor_args):
        nta, a = non_tensor_args, te.LNMLP_ARGS
        recompute = bool(nta[a["recompute_for_bwd"]])
        call = getattr(ctx, "_te_wm_call", None) if recompute else _active("lnmlp")
        if call is None or _passes_through_tuple(nta, a, (fc1_w, fc2_w)):
            out = te.LNMLPFunction._forward(ctx, inp, ln_w, ln_b, fc1_w, fc1_ws, fc1_b, fc2_w, fc2_ws, fc2_b, nta)
            return out if recompute else _observed(ctx, None, out)
        slots = _plan_mlp(call, nta, fc1_w, fc2_w)
        nta = _replace_at(nta, a["is_fsdp2"], all(s.drops_workspace for s in slots))
        token = ACTIVE.set(call) if recompute else None  # backward thread: no context variable there
        try:
            out = te.LNMLPFunction._forward(ctx, inp, ln_w, ln_b, fc1_w, fc1_ws, fc1_b, fc2_w, fc2_ws, fc2_b, nta)
        finally:
            if token is not None:
                ACTIVE.reset(token)
        _edit_mlp_ctx(ctx, call, slots, nta, recompute)
        return out if recompute else _observed(ctx, call.module, out)

    @staticmethod
    def backward(ctx, *grad_outputs):
        result = _backward(ctx, te.LNMLPFunction.backward, *grad_outputs)
        ctx._te_wm_call = None
        return result


def _plan_mlp(call: ManagedCall, nta: tuple, fc1_w, fc2_w) -> list[WeightSlot]:
    a = te.LNMLP_ARGS
    grad, own_checkpoint = bool(nta[a["is_grad_enabled"]]), bool(nta[a["checkpoint"]])
    recompute, scope = te_recompute_pass(), RecomputeScope.REGION
    if own_checkpoint and grad:
        # The module's own checkpoint: its first pass saves inputs only, like
        # a reentrant checkpoint's first pass, so it is planned as one; its
        # recompute pass hands what it builds straight to backward.
        recompute = RecomputePass.RECOMPUTE if nta[a["recompute_for_bwd"]] else RecomputePass.FIRST
        grad, scope = recompute is RecomputePass.RECOMPUTE, RecomputeScope.MODULE
    common = dict(grad=grad, input_requires_grad=True, is_first_microbatch=nta[a["is_first_microbatch"]],
                  backward_override=None, recompute=recompute, scope=scope)
    return [
        call.plan_weight("fc1_weight", fc1_w, nta[a["fc1_weight_quantizer"]], **common),
        call.plan_weight("fc2_weight", fc2_w, nta[a["fc2_weight_quantizer"]], **common),
    ]


def _edit_mlp_ctx(ctx, call: ManagedCall, slots: list[WeightSlot], nta: tuple, recompute: bool) -> None:
    a = te.LNMLP_ARGS
    if ctx is None or not nta[a["is_grad_enabled"]]:
        return
    if recompute or not nta[a["checkpoint"]]:
        # TE's ctx block ran: its clear flag is shared by FC1 and FC2, so it
        # is set only when both plans want it; release() covers the rest.
        ctx.is_fsdp2 = all(s.te_clear for s in slots)
        ctx._te_wm_record = call.release_record(slots)
    if not recompute and nta[a["checkpoint"]]:
        ctx._te_wm_call = call  # read again by the module's own recompute in backward


def _passes_through_tuple(nta: tuple, a: dict, weights: tuple) -> bool:
    return passes_through(
        fp8=nta[a["fp8"]], debug=nta[a["debug"]], fsdp_group=nta[a["fsdp_group"]],
        skip_update=nta[a["skip_fp8_weight_update"]], cpu_offloading=nta[a["cpu_offloading"]], weights=weights,
    )


def _replace_at(values: tuple, index: int, value) -> tuple:
    return values[:index] + (value,) + values[index + 1:]


def _recipe_backward_override() -> str | None:
    recipe = te.FP8GlobalStateManager.get_fp8_recipe()
    return getattr(recipe, "backward_override", None)


def _release(ctx) -> None:
    record = getattr(ctx, "_te_wm_record", None)
    ctx._te_wm_record = None
    if record is not None:
        record.release()


def _backward(ctx, te_backward, *grads):
    """TE's backward, then the plan's release; marked on a recording's timeline."""
    _attribution.backward_mark(ctx, "start")
    result = te_backward(ctx, *grads)
    _release(ctx)
    _attribution.backward_mark(ctx, "end")
    return result


def _observed(ctx, module, out):
    """While recording, remember whose backward ``ctx`` is (stock modules
    are named by the recording's forward hooks)."""
    if ctx is not None and _attribution.LEDGER.enabled:
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
    te_integration's import, before install, or over an installed seam (the
    check every managed forward makes is a few identity tests).
    """
    global _INSTALLED, _SEAMED
    if _INSTALLED and in_place(_SEAMED):
        return
    with _INSTALL_LOCK:
        if _INSTALLED and in_place(_SEAMED):
            return
        names = _SEAMED or _seamed_names()
        refuse_foreign_patches(names)
        for seamed in names:
            setattr(seamed.module, seamed.name, seamed.ours)
        _SEAMED, _INSTALLED = names, True
