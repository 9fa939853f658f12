"""``te._compat.split_experts`` against TE's ``split_into_quantized_tensors``.

The grouped quantization of a GroupedLinear call's experts is split into
per-expert storages by ``split_experts``, which builds them without TE's
Python work per expert. Each expert must be what TE's own split gives: the
same class, views of the same bytes at the same addresses and shapes, the
same scales and settings; the one intended difference is that the experts
share one copy of the quantizer where TE copies it for each.

Delayed scaling's experts are not split from a group: each is quantized by
its own quantizer in one multi-tensor call, and is checked against TE's
per-expert ``quantize`` instead. So are current and block scaling's, through
the whole grouped path (``quantize_experts``), edge experts included.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.gpu

EXPERTS, ROWS, COLS = 6, 256, 384

#: The storage fields each per-expert workspace holds, by class name.
_FIELDS = {
    "Float8TensorStorage": ("_data", "_transpose", "_scale_inv"),
    "Float8BlockwiseQTensorStorage": ("_rowwise_data", "_columnwise_data", "_rowwise_scale_inv",
                                      "_columnwise_scale_inv"),
}
_SETTINGS = ("_fp8_dtype", "_dtype", "_transpose_invalid", "_is_2D_scaled")


def _quantizer(recipe: str):
    from conftest import recipe_skip_reason

    reason = recipe_skip_reason(recipe)
    if reason:
        pytest.skip(reason)
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer
    from transformer_engine.pytorch.tensor.float8_tensor import Float8CurrentScalingQuantizer

    if recipe == "Float8CurrentScaling":
        quantizer = Float8CurrentScalingQuantizer(tex.DType.kFloat8E4M3, "cuda")
    else:
        quantizer = Float8BlockQuantizer(tex.DType.kFloat8E4M3, rowwise=True, columnwise=True, block_scaling_dim=2)
    quantizer.internal = True
    return quantizer


def _same_view(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return (a.data_ptr() == b.data_ptr() and tuple(a.shape) == tuple(b.shape) and a.stride() == b.stride()
            and a.dtype == b.dtype)


@pytest.mark.parametrize("recipe", ["Float8CurrentScaling", "Float8BlockScaling"])
@pytest.mark.parametrize("usage", ["rowwise", "columnwise", "both"])
def test_split_experts_gives_what_te_s_split_gives(recipe, usage):
    import torch
    from te_integration.te import _compat as te

    quantizer = _quantizer(recipe)
    quantizer.set_usage(rowwise=usage != "columnwise", columnwise=usage != "rowwise")
    stacked = torch.randn(EXPERTS * ROWS, COLS, device="cuda", dtype=torch.bfloat16)
    stacked[ROWS:2 * ROWS] *= 50  # experts scaled apart, so each has scales of its own
    try:
        grouped = te.tex.group_quantize(stacked, quantizer, EXPERTS, None)
    except NotImplementedError as err:
        pytest.skip(f"TE builds no {usage} data alone for {recipe}: {err}")
    ours = te.split_experts(grouped, quantizer, EXPERTS, (ROWS, COLS))
    theirs = grouped.split_into_quantized_tensors()
    layout = {name: (None if getattr(grouped, name) is None else getattr(grouped, name).numel(),
                     getattr(grouped, name + "_offsets", None)) for name in ("scale_inv", "columnwise_scale_inv")}
    assert ours is not None, f"split_experts declined TE's layout: {layout}"
    assert len(ours) == len(theirs) == EXPERTS
    for mine, te_own in zip(ours, theirs):
        assert type(mine) is type(te_own)
        for name in _FIELDS[type(te_own).__name__]:
            assert _same_view(getattr(mine, name), getattr(te_own, name)), name
        for name in _SETTINGS:
            assert getattr(mine, name, None) == getattr(te_own, name, None), name
        assert type(mine._quantizer) is type(te_own._quantizer)
        assert vars(mine._quantizer) == vars(te_own._quantizer)
    assert len({id(expert._quantizer) for expert in ours}) == 1  # one shared copy ...
    assert all(expert._quantizer is not quantizer for expert in ours)  # ... not the module's own quantizer


def test_split_experts_declines_a_quantizer_that_makes_tensors():
    import torch
    from te_integration.te import _compat as te

    quantizer = _quantizer("Float8CurrentScaling")
    quantizer.internal = False  # TE's split makes Float8Tensor (a torch.Tensor subclass) then
    quantizer.set_usage(rowwise=True, columnwise=False)
    grouped = te.tex.group_quantize(torch.randn(EXPERTS * ROWS, COLS, device="cuda", dtype=torch.bfloat16),
                                    quantizer, EXPERTS, None)
    assert te.split_experts(grouped, quantizer, EXPERTS, (ROWS, COLS)) is None


def _delayed_quantizers(seed: int) -> list:
    import torch
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer

    scales = torch.rand(EXPERTS, generator=torch.Generator().manual_seed(seed)) * 8 + 0.5  # a scale of its own each
    quantizers = [Float8Quantizer(scales[i:i + 1].cuda(), torch.zeros(1, device="cuda"), tex.DType.kFloat8E4M3)
                  for i in range(EXPERTS)]
    for quantizer in quantizers:
        quantizer.internal = True
    return quantizers


@pytest.mark.parametrize("usage", ["rowwise", "columnwise", "both"])
def test_delayed_experts_quantized_at_once_hold_what_each_alone_holds(usage):
    """Delayed scaling's experts, each with its own scale, read from their own
    buffers by one multi-tensor call: every expert's bytes, transpose, scale
    and recorded amax as TE's per-expert ``quantize`` gives them (columnwise
    alone is built with both usages and the rowwise dropped, as the drop-in's
    per-expert rebuild does on Hopper)."""
    import torch
    from conftest import recipe_skip_reason
    from te_integration.runtime._expert_quantize import quantize_experts

    reason = recipe_skip_reason("DelayedScaling")
    if reason:
        pytest.skip(reason)
    rowwise, columnwise = usage != "columnwise", usage != "rowwise"
    weights = [torch.randn(ROWS, COLS, device="cuda", dtype=torch.bfloat16) * (i + 1) for i in range(EXPERTS)]
    ours, alone = _delayed_quantizers(7), _delayed_quantizers(7)
    outs = quantize_experts(SimpleNamespace(alike=None), ours, weights, rowwise, columnwise)
    assert outs is not None, "quantize_experts declined delayed scaling's experts"
    for out, weight, quantizer, mine in zip(outs, weights, alone, ours):
        quantizer.set_usage(rowwise=True, columnwise=True)
        reference = quantizer.quantize(weight)
        reference.update_usage(rowwise_usage=rowwise, columnwise_usage=columnwise)
        assert out.get_usages() == reference.get_usages()
        for name in ("_data", "_transpose", "_scale_inv"):
            got, want = getattr(out, name), getattr(reference, name)
            assert (got is None) == (want is None), name
            if want is not None:
                assert torch.equal(got, want), name
        assert torch.equal(mine.amax, quantizer.amax)  # the amax delayed scaling's history reads


def _reference(quantizer, weight, rowwise: bool, columnwise: bool):
    """TE's per-expert ``quantize``; a format that cannot build columnwise
    data alone (per-tensor FP8 on Hopper) builds both and drops the rowwise."""
    quantizer.set_usage(rowwise=rowwise, columnwise=columnwise)
    try:
        return quantizer.quantize(weight)
    except (NotImplementedError, RuntimeError):
        if rowwise:
            raise
    quantizer.set_usage(rowwise=True, columnwise=True)
    out = quantizer.quantize(weight)
    out.update_usage(rowwise_usage=False, columnwise_usage=True)
    return out


@pytest.mark.parametrize("recipe", ["Float8CurrentScaling", "Float8BlockScaling"])
@pytest.mark.parametrize("usage", ["rowwise", "columnwise", "both"])
def test_grouped_experts_quantized_at_once_hold_what_each_alone_holds(recipe, usage):
    """Current and block scaling's experts through the binding's grouped
    path (concatenated, one ``tex.group_quantize``, ``split_experts``): every
    expert's bytes and scales as TE's per-expert ``quantize`` gives them,
    an all-zero expert and one whose tiny amax makes a huge scale included."""
    import torch
    from te_integration.runtime._expert_quantize import quantize_experts

    rowwise, columnwise = usage != "columnwise", usage != "rowwise"
    weights = [torch.randn(ROWS, COLS, device="cuda", dtype=torch.bfloat16) * (i + 1) for i in range(EXPERTS)]
    weights[1].zero_()
    weights[2].mul_(1e-30)
    ours = [_quantizer(recipe) for _ in range(EXPERTS)]
    outs = quantize_experts(SimpleNamespace(alike=None), ours, weights, rowwise, columnwise)
    assert outs is not None, f"quantize_experts declined {recipe}'s experts"
    for i, (out, weight) in enumerate(zip(outs, weights)):
        reference = _reference(_quantizer(recipe), weight, rowwise, columnwise)
        assert type(out) is type(reference) and out.get_usages() == reference.get_usages(), i
        for name in _FIELDS[type(reference).__name__]:
            got, want = getattr(out, name), getattr(reference, name)
            if name == "_transpose" and getattr(reference, "_transpose_invalid", False):
                continue
            assert (got is None) == (want is None), (i, name)
            if want is not None:
                assert tuple(got.shape) == tuple(want.shape) and torch.equal(_bits(got), _bits(want)), (i, name)


def _bits(tensor):
    """A tensor's bytes, so that an overflowed scale (inf, NaN) compares as its bits do."""
    import torch

    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)
