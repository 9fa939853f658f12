"""``LayerNormMLP``: two weights, one switch, and an own recompute.

TE's ``_LayerNormMLP._forward(ctx, inp, ln_weight, ln_bias, fc1_weight,
fc1_weight_workspace, fc1_bias, fc2_weight, fc2_weight_workspace, fc2_bias,
non_tensor_args)`` runs both for the forward and for the module's own
checkpoint recompute inside backward (``recompute_for_bwd``), so the seam
overrides ``_forward``. FC1 and FC2 are planned separately. Two things
differ from the one-weight kinds:

* TE 2.20.2 saves or drops both workspaces with one ``is_fsdp2`` switch.
  Plans that save differently run with the switch off (both saved), while
  the workspace of the weight backward rebuilds is handed to TE's
  ``prepare_for_saving`` as None (:func:`_forward_split`): TE's own signal to
  quantize that weight again (``if fc1_weight is None`` in backward).
* The module's own recompute runs in backward, outside the module's call:
  its first pass leaves the module on ctx, and the recompute pass pushes a
  record of its own. It hands what it builds straight to backward, where
  ``is_fsdp2`` cannot keep it out (:func:`_rebuild_in_backward`).
"""

from __future__ import annotations

import threading

from workspace_manager import RecomputePass, RecomputeScope

from ..runtime._call import ACTIVE, CallPart, new_record, recompute_pass
from ..runtime._modules import ManagedModule
from ..runtime._kind_registry import Adapter, FunctionSeam, ModuleKind, register
from ..runtime._release import BackwardWork, backward_work
from ..te import _compat as te

__all__ = ["LayerNormMLP"]

KIND = ModuleKind("layernorm_mlp")
_ARGS = te.LNMLP_ARGS
_GATE = tuple(_ARGS.get(name, -1) for name in ("fp8", "debug", "fsdp_group", "skip_fp8_weight_update",
                                               "cpu_offloading"))
_REGION, _MODULE = RecomputeScope.REGION, RecomputeScope.MODULE
#: Held by a call whose FC1 and FC2 save differently while it swaps
#: ``prepare_for_saving``; reentrant, as a lock taken in a forward must not
#: deadlock a nested call on the same thread.
_SPLIT_LOCK = threading.RLock()


def _begin(ctx, args: tuple):
    nta = args[9]
    recompute = bool(nta[_ARGS["recompute_for_bwd"]])
    if recompute:  # the module's own recompute, in backward: the module its first pass left on ctx
        work = getattr(ctx, "_te_wm_backward", None)
        module, record = (work.module if work is not None else None), None
    else:
        record = ACTIVE.record
        module = record.module if record is not None and record.kind is KIND else None
    fp8, debug, group, skip, offload = _GATE
    # TE's LayerNormMLP has no distributed-weight path; such weights stay TE's.
    if (module is None or not nta[fp8] or nta[debug] or nta[group] is not None or nta[skip] is not None
            or nta[offload] or te.graph_flags._IS_GRAPH_CAPTURING
            or getattr(args[3], "is_distributed_weight", False) or getattr(args[6], "is_distributed_weight", False)):
        return None
    if record is None:  # pushed only once planned, so a refused plan leaves the stack as it was
        record = new_record(module, module._wm_state, None, ACTIVE.record, pushed_by_seam=True)
    grad, recompute, scope = _passes(nta)
    state, first, fc1_weight, fc2_weight = record.state, nta[_ARGS["is_first_microbatch"]], args[3], args[6]
    fc1 = state.levers(module, record.sharding, key="fc1_weight", weight=fc1_weight,
                       quantizer=nta[_ARGS["fc1_weight_quantizer"]], grad=grad, input_requires_grad=True,
                       is_first_microbatch=first, backward_override=None, recompute=recompute, scope=scope)
    fc2 = state.levers(module, record.sharding, key="fc2_weight", weight=fc2_weight,
                       quantizer=nta[_ARGS["fc2_weight_quantizer"]], grad=grad, input_requires_grad=True,
                       is_first_microbatch=first, backward_override=None, recompute=recompute, scope=scope)
    weights = record.weights = (fc1_weight, fc1, fc2_weight, fc2)
    fc1_saves_none, fc2_saves_none = weights[1].saves_no_workspace, weights[3].saves_no_workspace
    if fc1_saves_none is not fc2_saves_none:
        record.part = SplitCall()
    if record.pushed_by_seam:
        ACTIVE.record = record
    if record.part is not None or (record.pushed_by_seam and (fc1_saves_none or fc2_saves_none)):
        record.run = _run  # a split call, or an own recompute handing backward a rebuild
    switch = _ARGS["is_fsdp2"]
    nta = nta[:switch] + (fc1_saves_none and fc2_saves_none,) + nta[switch + 1:]
    return record, args[:9] + (nta,)


class SplitCall(CallPart):
    """A LayerNormMLP call with FC1 and FC2 planned to save differently
    (:attr:`CallRecord.part`): the workspaces of the weight backward
    rebuilds, which the ``quantize_weight`` seam collects here and
    :func:`_forward_split` hands to TE's saving helper as None."""

    __slots__ = ("dropped",)

    def __init__(self) -> None:
        self.dropped = []


def _passes(nta: tuple) -> tuple:
    """(grad, recompute pass, recompute scope) the call's weights are planned with."""
    grad, own_checkpoint = bool(nta[_ARGS["is_grad_enabled"]]), bool(nta[_ARGS["checkpoint"]])
    recompute = recompute_pass() if te.recompute_flags._IN_ACTIVATION_RECOMPUTE_REGION else RecomputePass.NONE
    scope = _REGION
    if own_checkpoint and grad:
        # The module's own checkpoint: its first pass saves inputs only, like
        # a reentrant checkpoint's first pass, so it is planned as one; its
        # recompute pass hands what it builds straight to backward.
        recompute = RecomputePass.RECOMPUTE if nta[_ARGS["recompute_for_bwd"]] else RecomputePass.FIRST
        grad, scope = recompute is RecomputePass.RECOMPUTE, _MODULE
    return grad, recompute, scope


def _run(record, te_method, ctx, args: tuple):
    out = te_method(ctx, *args) if record.part is None else _forward_split(record, te_method, ctx, args)
    weights = record.weights
    if record.pushed_by_seam and (weights[1].saves_no_workspace or weights[3].saves_no_workspace):
        return _rebuild_in_backward(out, weights)
    return out


def _forward_split(record, te_method, ctx, args: tuple):
    """TE's ``_forward`` for FC1 and FC2 planned to save differently: run
    with TE's switch off while the workspaces of the weight backward
    rebuilds (collected in the call's :class:`SplitCall` by the ``quantize_weight``
    seam) are handed to ``prepare_for_saving`` as None. The name is swapped
    in ``layernorm_mlp.py``'s globals for this call only. Another module's
    call on another thread meanwhile passes through the swap unchanged (it
    replaces only this call's workspaces); another such split call waits
    for this one, so that neither puts TE's name back under the other."""
    dropped = record.part.dropped
    with _SPLIT_LOCK:
        original = te.lnmlp_module.prepare_for_saving

        def prepare_for_saving(*tensors):
            return original(*[None if any(t is d for d in dropped) else t for t in tensors])

        te.lnmlp_module.prepare_for_saving = prepare_for_saving
        try:
            return te_method(ctx, *args)
        finally:
            te.lnmlp_module.prepare_for_saving = original


def _rebuild_in_backward(recomputed: tuple, weights: tuple) -> tuple:
    """The module's own recompute pass hands the workspaces it built straight
    to backward: TE skips the FSDP2 path there (``fsdp2_skip_columnwise`` is
    off while recomputing), so ``is_fsdp2`` cannot keep them out. For a
    weight whose plan requantizes in backward, its place in what the pass
    returns becomes None, which is TE's own signal to quantize the weight
    again with ``ctx``'s quantizer (``if fc1_weight is None`` in
    ``_LayerNormMLP.backward``), the one :func:`_edit_ctx` set."""
    out = list(recomputed)
    for name, weight, levers in (("fc1_weight", weights[0], weights[1]), ("fc2_weight", weights[2], weights[3])):
        i = te.LNMLP_RECOMPUTED[name]
        if levers.saves_no_workspace and out[i] is not weight:  # as TE: a quantized parameter is its own workspace
            out[i] = None
    return tuple(out)


def _edit_ctx(ctx, record, args: tuple) -> None:
    nta = args[9]
    if not nta[_ARGS["is_grad_enabled"]]:
        ctx._te_wm_backward = None
        return
    recompute, own_checkpoint = nta[_ARGS["recompute_for_bwd"]], nta[_ARGS["checkpoint"]]
    if own_checkpoint and not recompute:
        # The first pass saved inputs only; the recompute pass in backward plans again.
        ctx._te_wm_backward = BackwardWork(record.module)
        return
    weights = record.weights
    # TE's ctx block ran: its clear flag is shared by FC1 and FC2, so it is
    # set only when both plans want it; the release covers the rest.
    ctx.is_fsdp2 = weights[1].clears_in_backward and weights[3].clears_in_backward
    ctx._te_wm_backward = backward_work(record.module, weights) if weights[1].releases or weights[3].releases \
        else None
    state = record.state
    for levers, name in ((weights[1], "fc1_weight_quantizer"), (weights[3], "fc2_weight_quantizer")):
        if levers.dgrad_reads_high_precision or levers.rebuild_usage is not None:
            setattr(ctx, name, state.backward_quantizer(levers, getattr(ctx, name, None)))


class LayerNormMLP(ManagedModule, te.TELayerNormMLP):
    """``te.LayerNormMLP`` whose FC1 and FC2 workspaces follow a :class:`WorkspacePolicy`
    (planned separately)."""

    _wm_kind = KIND


ADAPTER = Adapter(
    kind=KIND, te_class=te.TELayerNormMLP, drop_in=LayerNormMLP, order=30, weight_keys=("fc1_weight", "fc2_weight"),
    construction=((te.transformer_module, "LayerNormMLP"),), part=SplitCall,
    function=FunctionSeam(function=te.LNMLPFunction, name="_LayerNormMLP", method="_forward", file=te.lnmlp_module,
                          begin=_begin, edit_ctx=_edit_ctx),
)
register(ADAPTER)
