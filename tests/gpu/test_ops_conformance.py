"""Conformance of the te.ops drop-ins on one GPU: the real tensors of every
call match its plan (issue 28).

For each sm_90 recipe, each BasicLinear form of ``_ops_cases``, bf16 and
quantized_model_init weights, and both sharding plans, the GEMMs of TE's
``BasicLinear`` are watched (``OpsWatch``): what the forward GEMM reads
(a high-precision weight's forward usage: rowwise only under the FSDP2
plan, both otherwise), and what dgrad reads (the forward's own storage,
holding columnwise data only, where the plan saves the workspace; a
storage rebuilt in backward with columnwise data only where it requantizes;
the quantized parameter itself). The memory a call holds from forward to
backward is compared with stock's: lower by the columnwise copy of each
weight under the FSDP2 plan, equal otherwise, from the second step on (each
step's tensors are dropped before the next forward, so its marks see no
memory of the step before freed). GroupedLinear's memory and
plans are checked the same way (its GEMMs are grouped kernels).
"""

from __future__ import annotations

import gc

import pytest

from _ops_cases import OpsCase, OpsWatch, build, case_or_skip, drop_in_ops, every_case, run, stock_or_skip

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning",
                                                        "ignore::FutureWarning")]

RECIPES_SM90 = ["Float8CurrentScaling", "Float8BlockScaling", "DelayedScaling"]


def _held(case: OpsCase, recipe, managed: bool) -> tuple[list, object]:
    """Bytes allocated after each forward over before it, and the model."""
    import torch

    model = build(case, recipe, managed)
    held = []
    before = {}

    def between(step, out):
        torch.cuda.synchronize()
        held.append(torch.cuda.memory_allocated() - before["bytes"])
        gc.enable()

    def run_with_marks():
        original = model.forward

        def forward(*args):
            # No garbage collection between the marks: it would free what
            # earlier steps left in reference cycles at a moment of its choosing.
            gc.collect()
            gc.disable()
            torch.cuda.synchronize()
            before["bytes"] = torch.cuda.memory_allocated()
            return original(*args)

        model.forward = forward
        return run(model, case, recipe, between=between)

    try:
        run_with_marks()
    finally:
        gc.enable()
    return held, model


def _grouped_tensor_path(recipe) -> bool:
    """Whether TE runs GroupedLinear's grouped-tensor path here (its own check)."""
    import torch
    from transformer_engine.pytorch.ops.basic.grouped_linear import is_op_fuser_grouped_tensor_path_supported

    return is_op_fuser_grouped_tensor_path_supported(recipe, torch.bfloat16)


def _weights(model) -> list:
    return [p for op in drop_in_ops(model) for name, p in op.named_parameters(recurse=False) if "weight" in name]


@every_case(RECIPES_SM90)
def test_te_ops_calls_match_their_plans(recipe_name, quantized_init, form, sharding):
    from workspace_manager import BackwardSource, Sharding, Usage

    import te_integration as ti

    case, recipe = case_or_skip(recipe_name, quantized_init, form, sharding)
    stock_held, _ = stock_or_skip(lambda: _held(case, recipe, managed=False))
    with OpsWatch().watching() as watch:
        managed_held, model = _held(case, recipe, managed=True)
    requantized = sharding == "fsdp2" and not quantized_init
    for op in drop_in_ops(model):
        plans = ti.last_plans(op)
        assert plans, f"{case.label}: {type(op).__name__} has no plan"
        for key, (context, plan) in plans.items():
            assert context.sharding is (Sharding.FSDP2_RESHARD if sharding == "fsdp2" else Sharding.NONE)
            want = (BackwardSource.SAVED_PARAMETER if quantized_init else
                    BackwardSource.REQUANTIZE if requantized else BackwardSource.SAVED_WORKSPACE)
            assert plan.backward_source is want, f"{case.label} {key}: {plan.summary()}"
    weight_bytes = sum(w.numel() for w in _weights(model))
    # Stock's saved copies a plan drops: the columnwise data under FSDP2 plans;
    # the rowwise data too where TE's grouped-tensor path saves both (D11).
    copies = (1 if requantized else 0) + (1 if form == "grouped" and _grouped_tensor_path(recipe) else 0)
    if quantized_init:
        copies = 0
    # Step 0 is left out: the first calls of a process allocate once for good
    # (cuBLAS workspaces, TE's scratch buffers), in whichever model runs first.
    saved = [s - m for s, m in zip(stock_held[1:], managed_held[1:])]
    low, high = copies * weight_bytes, copies * (1.1 * weight_bytes + 4096)
    assert all(low <= d <= high for d in saved), (case.label, saved, weight_bytes, copies)
    if form == "grouped":
        return
    if quantized_init:
        assert watch.dgrad and all(seen for seen, _ in watch.dgrad), case.label  # the parameter itself
        return
    forward_usage = Usage.ROWWISE if requantized else Usage.BOTH
    assert all(u == forward_usage for _, u in watch.forward), (case.label, watch.forward)
    assert watch.dgrad and all(u == Usage.COLUMNWISE for _, u in watch.dgrad), (case.label, watch.dgrad)
    rebuilt = [not seen for seen, _ in watch.dgrad]
    assert all(rebuilt) if requantized else not any(rebuilt), (case.label, watch.dgrad)
