"""Hand-written reference table of TransformerEngine 2.20.2's weight-workspace decisions.

This module is an independent, hand-written transcription of what TE 2.20.2's eager
path does with the quantized weight ("workspace") in ``Linear``, ``LayerNormLinear``
and ``LayerNormMLP`` (FC1 and FC2).  It exists to differential-test the project's
policy implementation; it deliberately imports nothing from ``workspace_manager``.

Assumed setting: FP8 enabled (``fp8 == True``), not debug mode
(``is_debug_iter() == False``), no FP8 CUDA-graph capture
(``skip_fp8_weight_update is None``), no FSDP1 (``fsdp_group is None``), no cpu
offloading, no torch.compile (Linear runs ``_linear_eager``), no userbuffers,
``fuse_wgrad_accumulation=False``, weights with ``requires_grad=True``.

Sources:
  * TE 2.20.2 Python source, ``transformer_engine/pytorch/module/{base,linear,
    layernorm_linear,layernorm_mlp}.py`` and ``distributed.py`` /
    ``distributed_weight.py`` (line numbers below refer to those files).

Meaning of the ``recompute`` field:
  * Linear / LayerNormLinear: ``"first"`` is the first forward inside a ``te.checkpoint``
    region (``activation_recompute_forward(activation_recompute=True,
    recompute_phase=False)``); with ``grad_enabled=False`` it is the reentrant variant
    (which runs its first forward under ``torch.no_grad()``, distributed.py:375-381),
    with ``grad_enabled=True`` the non-reentrant variant (distributed.py:802-826).
    ``"recompute"`` is the recompute forward (``recompute_phase=True``, grad enabled,
    distributed.py:444-449).  We assume the region is actually entered, i.e. some
    checkpoint input needs grad (distributed.py:375-379).
  * LayerNormMLP: ``"first"`` / ``"recompute"`` mean the module's OWN selective
    checkpoint (``LayerNormMLP(checkpoint=True)``): ``"first"`` is the outer forward
    (``recompute_for_bwd=False``) and ``"recompute"`` is ``_recompute``'s rerun of
    ``_forward`` at the start of backward (``is_recomputation=True``,
    layernorm_mlp.py:278-281).  ``te.checkpoint`` around a LayerNormMLP is NOT
    transcribed: LayerNormMLP never reads the te.checkpoint flags for the weight, so
    under te.checkpoint it behaves exactly like ``recompute="none"`` with the pass's
    grad mode.

Meaning of the backward fields: they describe the backward of the autograd node this
forward call created (no backward when grad is disabled).  For the non-reentrant
te.checkpoint first pass, TE's modules save exactly as usual (the checkpoint's pack
hooks then drop and recompute those tensors); we transcribe the module-level decision.
For LayerNormMLP's own checkpoint, the ``"first"`` row's backward starts with the
recompute pass, so the re-quantization there is described by the ``"recompute"`` row,
not as a ``backward_rebuild`` of the ``"first"`` row.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product

MODULES = ("Linear", "LayerNormLinear", "LayerNormMLP.fc1", "LayerNormMLP.fc2")
SHARDINGS = ("none", "fsdp2_reshard", "fsdp2_keep", "distributed_weight")
RECOMPUTES = ("none", "first", "recompute")
WEIGHTS = ("high_precision", "quantized_param")
MICROBATCHES = ("none", "first", "later")
BACKWARD_OVERRIDES = ("none", "high_precision", "dequantized")

REBUILD_BOTH = "rowwise+columnwise"


@dataclass(frozen=True)
class TECase:
    """One eager-mode forward (and its backward) of one TE weight."""

    module: str  # "Linear" | "LayerNormLinear" | "LayerNormMLP.fc1" | "LayerNormMLP.fc2"
    sharding: str  # "none" | "fsdp2_reshard" | "fsdp2_keep" | "distributed_weight"
    recompute: str  # "none" | "first" | "recompute"
    grad_enabled: bool
    input_requires_grad: bool  # only Linear reads it
    weight: str  # "high_precision" | "quantized_param"
    microbatch: str  # "none" | "first" | "later"  (is_first_microbatch None/True/False)
    backward_override: str  # "none" | "high_precision" | "dequantized"


@dataclass(frozen=True)
class TEDecision:
    """What TE 2.20.2 does for a TECase."""

    cache: str  # "bypass" | "fill" | "reuse"
    forward_columnwise: bool | None  # None: quantized param, TE takes W._quantizer as is
    workspace_saved: bool
    backward_rebuild: bool
    rebuild_usages: str  # "rowwise+columnwise" or ""
    dgrad_runs: bool
    clear_columnwise_after_backward: bool
    line_refs: str


# ---------------------------------------------------------------------------
# Shared helpers
# ---------------------------------------------------------------------------


def _is_fsdp2(case: TECase) -> bool:
    # base.py:1036-1047: one bool; TE's modules never read reshard_after_forward,
    # so fsdp2_reshard and fsdp2_keep give identical module decisions.
    return case.sharding in ("fsdp2_reshard", "fsdp2_keep")


def _is_dist(case: TECase) -> bool:
    return case.sharding == "distributed_weight"


def _is_qp(case: TECase) -> bool:
    return case.weight == "quantized_param"


def _cache(case: TECase, refs: list[str], prefix: str, lines: str) -> str:
    """Module-level cache_name rule, shared by all three modules.

    cache_name = None if (is_first_microbatch is None or self.is_fsdp2) else <key>
    (linear.py:2443, layernorm_linear.py:1763, layernorm_mlp.py:2379-2384).
    A quantized parameter is returned by quantize_weight before the workspace is
    consulted and new_workspace is None (base.py:835-845), so it is never cached.
    """
    refs.append(f"{prefix}:{lines}")
    refs.append("base.py:835-845")
    if case.microbatch == "none" or _is_fsdp2(case):
        return "bypass"
    if _is_qp(case):
        return "bypass"
    # update_ws = is_first_microbatch is None or is_first_microbatch
    # (linear.py:575, layernorm_linear.py:352, layernorm_mlp.py:505).
    # NOTE: "reuse" is TE's intent; whether the stored workspace is actually reused
    # depends on _is_weight_workspace_valid (base.py:757-789) and on the cache's
    # history (e.g. a rowwise-only workspace cached in a no-grad pass is rebuilt when
    # columnwise is requested).  That state is outside TECase; we report the intent.
    refs.append("base.py:757-789,862-886")
    return "fill" if case.microbatch == "first" else "reuse"


def _finish(cache, fwd_col, saved, rebuild, dgrad, clear, refs) -> TEDecision:
    return TEDecision(
        cache=cache,
        forward_columnwise=fwd_col,
        workspace_saved=saved,
        backward_rebuild=rebuild,
        rebuild_usages=REBUILD_BOTH if rebuild else "",
        dgrad_runs=dgrad,
        clear_columnwise_after_backward=clear,
        line_refs=", ".join(refs),
    )


# ---------------------------------------------------------------------------
# Linear (linear.py)
# ---------------------------------------------------------------------------


def _linear_forward_columnwise(case: TECase, refs: list[str]) -> bool | None:
    if _is_qp(case):
        # linear.py:562 tests the (materialized) weight: QuantizedTensor and not
        # debug -> weight_quantizer = weight._quantizer, no set_usage (:572-573).
        refs.append("linear.py:562,572-573")
        return None
    refs.append("linear.py:562-571")
    # :563  columnwise = is_grad_enabled and input_requires_grad and not is_fsdp2
    col = case.grad_enabled and case.input_requires_grad and not _is_fsdp2(case)
    # :564-565  backward_override is not None -> False
    if case.backward_override != "none":
        col = False
    # :566-570  if still False: recompute first phase forces it True.  This runs
    # AFTER both the FSDP2 and the backward_override terms, so it overrides them.
    if not col:
        col = case.recompute == "first"  # enabled region and not recompute phase
    return col


def _linear_saved(case: TECase, refs: list[str]) -> bool:
    if not case.grad_enabled:
        # _linear_eager calls _Linear.forward(None, ...) (linear.py:1903-1905);
        # the save block is under `if is_grad_enabled:` (:692).
        refs.append("linear.py:692,1903-1905")
        return False
    refs.append("linear.py:739-744,761-771")
    if _is_dist(case):
        # :743-744 wt_save = None.  saved_weight is the DistributedWeight param,
        # assumed not a QuantizedTensor (its shards' format is the implementer's).
        return False
    if _is_fsdp2(case) and not _is_qp(case):
        # :740-741 is_fsdp2 and weightmat is not weight -> wt_save = None
        return False
    # HP non-FSDP2: the workspace (possibly cached) is saved, even if dgrad will not
    # run.  QP (FSDP2 or not): weightmat is weight, so the parameter itself is saved.
    return True


def _linear_rebuild(case: TECase, dgrad: bool, refs: list[str]) -> bool:
    if not dgrad:
        # Everything is inside `if bwd_args.requires_dgrad:` (linear.py:1356).
        return False
    if _is_qp(case):
        # weight_fp8 is the saved QP (or, for a DistributedWeight, the re-gathered
        # tensor, assumed quantized): used as is (:1362-1366 / :1353-1354).
        refs.append("linear.py:1353-1366")
        return False
    if _is_fsdp2(case):
        # weight_fp8 is None -> set_usage(True, True) and quantize saved_weight
        # (:1362-1369).  Not gated on backward_override.
        refs.append("linear.py:1362-1369")
        return True
    if _is_dist(case):
        # weight_fp8 = materialize_weight_for_backward(saved_weight) (:1353-1354);
        # a BF16 result is quantized with set_usage(True, True) only when
        # bwd_args.fp8, which backward_override turns off (:1090-1099, :1370-1379).
        refs.append("linear.py:1090-1099,1353-1354,1370-1379")
        return case.backward_override == "none"
    return False


def _linear(case: TECase) -> TEDecision:
    refs: list[str] = []
    cache = _cache(case, refs, "linear.py", "2443-2446,2518,2565-2568")
    fwd_col = _linear_forward_columnwise(case, refs)
    saved = _linear_saved(case, refs)
    # requires_dgrad = input_requires_grad (linear.py:1036)
    dgrad = case.grad_enabled and case.input_requires_grad
    refs.append("linear.py:1036,1356")
    rebuild = _linear_rebuild(case, dgrad, refs)
    # clear_columnwise_cache only inside the requires_dgrad branch (:1445-1446);
    # weight_fp8 is a QuantizedTensorStorage in every FP8 case here.
    clear = dgrad and _is_fsdp2(case)
    refs.append("linear.py:1445-1446")
    return _finish(cache, fwd_col, saved, rebuild, dgrad, clear, refs)


# ---------------------------------------------------------------------------
# LayerNormLinear (layernorm_linear.py)
# ---------------------------------------------------------------------------


def _lnl_forward_columnwise(case: TECase, refs: list[str]) -> bool | None:
    if _is_qp(case):
        # :335 is_weight_param_quantized = isinstance(weight, QuantizedTensorStorage)
        # (the materialized weight for a DistributedWeight, :327-330); :340-341.
        refs.append("layernorm_linear.py:335,340-341")
        return None
    # :346-349 columnwise = is_grad_enabled and not is_fsdp2 and override is None.
    # No input-requires-grad test and no te.checkpoint forcing.
    refs.append("layernorm_linear.py:346-349")
    return case.grad_enabled and not _is_fsdp2(case) and case.backward_override == "none"


def _lnl_saved(case: TECase, refs: list[str]) -> bool:
    if not case.grad_enabled:
        # _LayerNormLinear.forward with ctx None (:1757-1761); save block under
        # `if is_grad_enabled:` (:468).
        refs.append("layernorm_linear.py:468,1757-1761")
        return False
    refs.append("layernorm_linear.py:518-535")
    if _is_dist(case):
        # :523-524 wt_save = None; origin_weight (the DistributedWeight) is saved and
        # assumed not quantized.
        return False
    if _is_fsdp2(case) and not _is_qp(case):
        return False  # :519-520
    return True


def _layernorm_linear(case: TECase) -> TEDecision:
    refs: list[str] = []
    cache = _cache(case, refs, "layernorm_linear.py", "1763-1766,1803,1820-1823")
    fwd_col = _lnl_forward_columnwise(case, refs)
    saved = _lnl_saved(case, refs)
    # The dgrad GEMM always runs (the norm backward needs it); ctx.requires_dgrad
    # (:538) only decides whether dgrad is returned (:1197).
    dgrad = case.grad_enabled
    refs.append("layernorm_linear.py:538,1197")
    # Rebuild iff the saved slot is None and saved_weight is not quantized
    # (:809-816): FSDP2 + HP.  For a DistributedWeight the slot is refilled by
    # materialize_weight_for_backward (:651-653) and NOT quantized (unlike Linear).
    rebuild = dgrad and _is_fsdp2(case) and not _is_qp(case)
    refs.append("layernorm_linear.py:651-653,809-816")
    # :883-884 getattr(ctx, "is_fsdp2") and weight is storage -> clear, every backward.
    clear = dgrad and _is_fsdp2(case)
    refs.append("layernorm_linear.py:541,883-884")
    return _finish(cache, fwd_col, saved, rebuild, dgrad, clear, refs)


# ---------------------------------------------------------------------------
# LayerNormMLP FC1 / FC2 (layernorm_mlp.py) -- identical rules for both
# ---------------------------------------------------------------------------


def _mlp_lines(case: TECase) -> dict[str, str]:
    fc1 = case.module.endswith("fc1")
    return {
        "usage": "508-514" if fc1 else "516-522",
        "quantize": "524-533" if fc1 else "534-543",
        "rebuild": "1534-1539" if fc1 else "1229-1234",
        "clear": "1578-1579" if fc1 else "1268-1269",
    }


def _mlp_forward(case: TECase, refs: list[str]) -> tuple[str, bool | None]:
    lines = _mlp_lines(case)
    if case.recompute == "recompute":
        # _recompute passes None workspaces (:1023-1035) and cache_weight=False
        # (:343): always a fresh, uncached quantization.
        refs.append("layernorm_mlp.py:343,1023-1035")
        cache = "bypass"
    else:
        # One flag (cache_name_fc1 is not None) is passed for both FC1 and FC2
        # (:2436); own-checkpoint first pass uses the module's flag too.
        cache = _cache(case, refs, "layernorm_mlp.py", "2379-2390,2436,2457-2464")
        refs.append(f"layernorm_mlp.py:{lines['quantize']}")
    if _is_qp(case):
        refs.append(f"layernorm_mlp.py:{lines['usage']}")
        return cache, None
    # :281 is_recomputation = checkpoint and is_grad_enabled and recompute_for_bwd
    # :503 fsdp2_skip_columnwise = is_fsdp2 and not is_recomputation
    is_recomputation = case.recompute == "recompute" and case.grad_enabled
    skip = _is_fsdp2(case) and not is_recomputation
    refs.append(f"layernorm_mlp.py:281,503,{lines['usage']}")
    return cache, case.grad_enabled and not skip


def _mlp_saved(case: TECase, refs: list[str]) -> bool:
    if not case.grad_enabled:
        refs.append("layernorm_mlp.py:740,2372-2377")
        return False
    if case.recompute == "first":
        # save_for_checkpoint (:278): only inp, ln params, fc*_weight (the
        # parameter) and biases are saved (:284-297); a QP parameter is therefore
        # saved, a HP workspace is not.
        refs.append("layernorm_mlp.py:278,284-297")
        return _is_qp(case)
    if case.recompute == "recompute":
        # The recomputed workspaces are returned straight into backward
        # (:922-938); `if not checkpoint:` (:753) skips save_for_backward.
        refs.append("layernorm_mlp.py:753,922-938")
        return False
    # Normal path: fc*_wt_save = None under fsdp2_skip_columnwise when the
    # final weight is not the parameter (:800-806); saved at :807-822.
    refs.append("layernorm_mlp.py:800-822")
    return not (_is_fsdp2(case) and not _is_qp(case))


def _layernorm_mlp(case: TECase) -> TEDecision:
    refs: list[str] = []
    lines = _mlp_lines(case)
    cache, fwd_col = _mlp_forward(case, refs)
    saved = _mlp_saved(case, refs)
    # FC2 dgrad and FC1 dgrad always run in backward; ctx.requires_dgrad (:907)
    # only decides whether the input grad is returned (:1829).
    dgrad = case.grad_enabled
    refs.append("layernorm_mlp.py:907,1829")
    # Slot-based rebuild with set_usage(True, True) only on the normal path with
    # FSDP2 + HP (slot None).  With own checkpoint the slot is the recomputed
    # workspace (non-None), so no rebuild.
    rebuild = dgrad and case.recompute == "none" and _is_fsdp2(case) and not _is_qp(case)
    refs.append(f"layernorm_mlp.py:{lines['rebuild']}")
    # Clear keyed on ctx.is_fsdp2 (:876; set by the recompute pass for checkpoint=True),
    # deliberately not on fsdp2_skip_columnwise -> also after a recompute.
    clear = dgrad and _is_fsdp2(case)
    refs.append(f"layernorm_mlp.py:876,{lines['clear']}")
    return _finish(cache, fwd_col, saved, rebuild, dgrad, clear, refs)


# ---------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------


def te_decision(case: TECase) -> TEDecision:
    """Return TE 2.20.2's decision for ``case`` (which must be in ALL_CASES)."""
    if not is_valid_case(case):
        raise ValueError(f"TE 2.20.2 cannot run this combination: {case}")
    if case.module == "Linear":
        return _linear(case)
    if case.module == "LayerNormLinear":
        return _layernorm_linear(case)
    return _layernorm_mlp(case)


def is_valid_case(case: TECase) -> bool:
    """Whether the combination is one TE can run as described in the module docstring."""
    if case.module not in MODULES or case.sharding not in SHARDINGS:
        return False
    if case.recompute not in RECOMPUTES or case.weight not in WEIGHTS:
        return False
    if case.microbatch not in MICROBATCHES:
        return False
    if case.backward_override not in BACKWARD_OVERRIDES:
        return False
    if case.recompute == "recompute" and not case.grad_enabled:
        return False  # a recompute pass always runs with grad enabled
    if case.module.startswith("LayerNormMLP"):
        if case.sharding == "distributed_weight":
            return False  # LayerNormMLP has no DistributedWeight support
        if case.backward_override != "none":
            return False  # assert at layernorm_mlp.py:253-257
    return True


def _all_cases() -> tuple[TECase, ...]:
    cases = []
    for fields in product(
        MODULES,
        SHARDINGS,
        RECOMPUTES,
        (True, False),
        (True, False),
        WEIGHTS,
        MICROBATCHES,
        BACKWARD_OVERRIDES,
    ):
        case = TECase(*fields)
        if is_valid_case(case):
            cases.append(case)
    return tuple(cases)


ALL_CASES: tuple[TECase, ...] = _all_cases()
