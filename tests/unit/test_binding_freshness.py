"""No weight copy outlives its source (docs/decisions.md, D12), on the CPU stand-in.

The stand-in's quantized weights follow TE's per-tensor FP8 layout (rowwise
``_data``, a derived ``_transpose`` with its validity flag), and its dgrad
GEMM reads the transpose, as Hopper's does. Each test writes a weight the
way a real run does (an FP8 optimizer kernel that rewrites ``_data`` alone,
an in-place write, a move) and checks that the drop-in reads copies of the
current weight while stock TE, on the same stand-in, reads the old one:
the stock half shows each test can fail.
"""

from __future__ import annotations

import importlib
import sys

import pytest
import torch
from _fake_te import Float8CurrentScalingQuantizer, QuantizedTensorStorage, TELinear, _round, load_full_binding

from workspace_manager.extending import fsdp2_gathered_parameters


@pytest.fixture
def ti(monkeypatch):
    binding = load_full_binding(monkeypatch)
    binding.stale = importlib.import_module("te_integration.runtime._stale")
    binding.watch = importlib.import_module("te_integration.runtime._gemm_watch")
    binding.freshness = sys.modules["te_integration.runtime._freshness"]
    compat = sys.modules["te_integration.te._compat"]
    monkeypatch.setattr(compat, "GEMM_SITES", ((binding.files["linear"], "general_gemm"),), raising=False)
    return binding


def _quantized_weight(weight: torch.Tensor):
    """A quantized parameter as ``quantized_model_init`` makes it: both usages,
    saved whole for backward (a QuantizedTensor, not an internal storage)."""
    qp = Float8CurrentScalingQuantizer().quantize(weight)
    qp.internal = False
    return qp


def _with_weight(module, weight):
    """``module`` with ``weight`` registered as its parameter ``weight``, as
    TE registers a quantized parameter (the stand-in's quantized weight is
    no torch.Tensor, so it goes into ``_parameters`` directly)."""
    del module.weight
    module._parameters["weight"] = weight
    return module


def _fp8_optimizer_write(qp, new_weight: torch.Tensor) -> None:
    """What TE's FusedAdam does to a DelayedScaling FP8 parameter: rewrite
    the rowwise data in place, leave the transpose flagged valid."""
    qp._data.copy_(_round(new_weight))


class SilentFP8Writer(torch.optim.Optimizer):
    """A stand-in of TE's FusedAdam over DelayedScaling FP8 parameters: a
    ``torch.optim`` optimizer whose step rewrites each parameter's rowwise
    data in place through the raw buffer (``writes``: parameter -> new
    weight, consumed by the step) and leaves its transpose flagged valid.
    Its param groups hold the stand-in's quantized weights, which are no
    torch.Tensor, so they are put there after torch's own checks."""

    def __init__(self, params) -> None:
        super().__init__([torch.zeros(1, requires_grad=True)], {})
        self.param_groups[0]["params"] = list(params)
        self.writes: dict[int, torch.Tensor] = {}

    @torch.no_grad()
    def step(self, closure=None):
        for param in self.param_groups[0]["params"]:
            new = self.writes.pop(id(param), None)
            if new is not None:
                _fp8_optimizer_write(param, new)


def _input_grad(module) -> torch.Tensor:
    x = torch.ones(4, 8, requires_grad=True)
    module(x).sum().backward()
    return x.grad


def test_after_an_optimizer_step_dgrad_reads_the_current_weights_transpose(ti):
    w0, w1 = torch.randn(8, 8, generator=torch.Generator().manual_seed(1)), torch.randn(8, 8)
    managed = _with_weight(ti.modules.convert_model(TELinear(8, 8)), _quantized_weight(w0))
    stock = _with_weight(TELinear(8, 8), _quantized_weight(w0))
    optimizer = SilentFP8Writer([managed.weight, stock.weight])
    for module in (managed, stock):
        _input_grad(module)  # step 1 derives the transpose
        optimizer.writes[id(module.weight)] = w1
    assert ti.state.state_of(managed).holds_quantized
    optimizer.step()
    current, old = torch.ones(4, 8) @ _round(w1), torch.ones(4, 8) @ _round(w0)
    assert torch.equal(_input_grad(managed), current)
    assert torch.equal(_input_grad(stock), old)  # stock TE's stale read, on the same stand-in


def test_a_weight_that_keeps_no_version_counter_is_read_as_version_0(ti):
    """Inference tensors (made under ``torch.inference_mode``, as TE's own
    inference-loop test makes its weights) refuse to report a version:
    the stamps read 0 there instead of failing the call."""
    with torch.inference_mode():
        made = torch.ones(2)
    assert ti.freshness.version_of(made) == 0 and ti.freshness.version_of(torch.ones(2).add_(1)) == 1
    w = torch.randn(8, 8, generator=torch.Generator().manual_seed(2))
    managed = _with_weight(ti.modules.convert_model(TELinear(8, 8)), _quantized_weight(w))
    stock = _with_weight(TELinear(8, 8), _quantized_weight(w))
    for module in (managed, stock):
        module.weight.__class__ = _NoVersion
    assert torch.equal(_input_grad(managed), _input_grad(stock))


class _NoVersion(type(Float8CurrentScalingQuantizer().quantize(torch.zeros(1, 1)))):
    """The stand-in's quantized weight, reading its version as an inference tensor does."""

    @property
    def _version(self) -> int:
        raise RuntimeError("Inference tensors do not track version counter.")


class QParam(torch.nn.Parameter, QuantizedTensorStorage):
    """A quantized parameter registered as a parameter (as TE's are), with
    the per-tensor FP8 layout; for the paths that walk a module's parameters."""

    def update_usage(self, rowwise_usage=None, columnwise_usage=None) -> None:
        if columnwise_usage and (self._transpose is None or self._transpose_invalid):
            self._transpose, self._transpose_invalid = self._data.t().contiguous(), False


def _registered_quantized_param() -> QParam:
    param = QParam(torch.zeros(8, 8))
    param._data, param._transpose, param._transpose_invalid = torch.ones(8, 8), torch.ones(8, 8), False
    return param


def test_a_step_makes_a_drop_ins_parameter_transposes_again_from_the_new_data(ti):
    managed = ti.modules.convert_model(TELinear(8, 8))
    param = managed.weight = _registered_quantized_param()
    ti.state.state_of(managed).holds_quantized = True  # what its first planned call of a quantized parameter does
    _fp8_optimizer_write(param, torch.randn(8, 8))
    torch.optim.SGD([param], lr=0.1).step()
    # Current, valid, and the plan's usages kept (rowwise and columnwise).
    assert not param._transpose_invalid and torch.equal(param._transpose, param._data.t())


def test_a_step_remakes_only_the_transposes_of_the_modules_whose_parameters_it_holds(ti):
    stepped, other = (ti.modules.convert_model(TELinear(8, 8)) for _ in range(2))
    for module in (stepped, other):
        module.weight = _registered_quantized_param()
        module.weight._transpose = module.weight._data.t().contiguous()  # current
        ti.state.state_of(module).holds_quantized = True
    kept = other.weight._transpose
    optimizer = torch.optim.SGD([stepped.weight], lr=0.1)
    for _ in range(2):  # the second step finds the optimizer's parameters remembered
        _fp8_optimizer_write(stepped.weight, torch.randn(8, 8))
        optimizer.step()
        assert torch.equal(stepped.weight._transpose, stepped.weight._data.t())
        assert other.weight._transpose is kept and not other.weight._transpose_invalid
    optimizer.add_param_group({"params": [other.weight]})  # now it holds both
    optimizer.step()
    assert other.weight._transpose is not kept


def test_a_later_microbatch_after_an_in_place_write_refreshes_the_cached_workspace(ti):
    managed, stock = ti.modules.convert_model(TELinear(8, 8, seed=3)), TELinear(8, 8, seed=3)
    x = torch.randn(4, 8)
    for module in (managed, stock):
        module(x, is_first_microbatch=True)
        with torch.no_grad():
            module.weight.add_(1.0)  # moves the version counter
    expected = x @ _round(managed.weight).t()
    assert torch.equal(managed(x, is_first_microbatch=False), expected)
    assert not torch.equal(stock(x, is_first_microbatch=False), expected)


def test_a_later_microbatch_after_an_optimizer_step_refreshes_the_cached_workspace(ti):
    managed, stock = ti.modules.convert_model(TELinear(8, 8, seed=4)), TELinear(8, 8, seed=4)
    x = torch.randn(4, 8)
    for module in (managed, stock):
        module(x, is_first_microbatch=True)
        module.weight.data.add_(1.0)  # ``.data``: no version change; only the step says so
    torch.optim.SGD([managed.weight, stock.weight], lr=0.1).step()  # no gradients: the step writes nothing itself
    expected = x @ _round(managed.weight).t()
    assert torch.equal(managed(x, is_first_microbatch=False), expected)
    assert not torch.equal(stock(x, is_first_microbatch=False), expected)


def test_within_a_step_a_later_microbatch_reuses_the_cache(ti):
    managed = ti.modules.convert_model(TELinear(8, 8))
    x = torch.randn(4, 8)
    managed(x, is_first_microbatch=True)
    entry = managed._fp8_workspaces["weight"]
    refreshes = entry.refreshes
    managed(x, is_first_microbatch=False)
    assert managed._fp8_workspaces["weight"] is entry and entry.refreshes == refreshes


def test_moving_a_drop_in_releases_its_copies_and_a_move_to_the_same_place_does_not(ti):
    managed = ti.modules.convert_model(TELinear(8, 8))
    managed(torch.randn(4, 8), is_first_microbatch=True)
    managed.cpu()  # already there: nothing moved
    assert "weight" in managed._fp8_workspaces
    managed.to(torch.float64)
    assert managed._fp8_workspaces == {}


def test_loading_a_state_dict_releases_the_copies_of_the_replaced_weights(ti):
    managed = ti.modules.convert_model(TELinear(8, 8))
    managed(torch.randn(4, 8), is_first_microbatch=True)
    managed.load_state_dict({"weight": torch.randn(8, 8)})
    assert managed._fp8_workspaces == {}


def test_release_workspaces_frees_drop_in_and_stock_copies_and_counts_their_bytes(ti):
    model = torch.nn.Sequential(ti.modules.convert_model(TELinear(8, 8)), TELinear(8, 8), TELinear(8, 8))
    model[2].weight = _registered_quantized_param()
    x = torch.randn(4, 8)
    model[0](x, is_first_microbatch=True)
    model[1](x, is_first_microbatch=True)
    # Each cache entry holds 8 x 8 rowwise and 8 x 8 columnwise float32 values and a scale;
    # the quantized weight's transpose is 8 x 8.
    expected = 2 * (2 * 8 * 8 * 4 + 4) + 8 * 8 * 4
    assert ti.stale.release_workspaces(model) == expected
    assert model[0]._fp8_workspaces == {} and model[1]._fp8_workspaces == {}
    assert model[2].weight._transpose is None and model[2].weight._data is not None
    assert ti.stale.release_workspaces(model) == 0


def test_release_workspaces_makes_the_next_microbatch_quantize_again(ti):
    managed = ti.modules.convert_model(TELinear(8, 8))
    x = torch.randn(4, 8)
    managed(x, is_first_microbatch=True)
    ti.stale.release_workspaces(managed)
    managed.weight.data.add_(1.0)
    assert torch.equal(managed(x, is_first_microbatch=False), x @ _round(managed.weight).t())


def test_stale_workspaces_finds_stocks_stale_transpose_and_none_in_the_drop_in(ti):
    model = torch.nn.ModuleDict({"managed": ti.modules.convert_model(TELinear(8, 8)), "stock": TELinear(8, 8)})
    for module in model.values():
        module.weight = _registered_quantized_param()
        module.weight._transpose = module.weight._data.t().clone()  # derived in step 1
        assert ti.stale.stale_workspaces(module) == []
        _fp8_optimizer_write(module.weight, torch.randn(8, 8))
    ti.state.state_of(model["managed"]).holds_quantized = True  # as its first planned call of a quantized parameter does
    torch.optim.SGD(model.parameters(), lr=0.1).step()  # the optimizer that wrote them
    found = ti.stale.stale_workspaces(model)
    assert [(s.module, s.weight, s.kind) for s in found] == [("stock", "weight", ti.stale.StaleKind.TRANSPOSE_MISMATCH)]
    assert found[0].nbytes == 8 * 8 * 4 and "stock.weight" in str(found[0])


def test_stale_workspaces_finds_a_drop_ins_cache_entry_made_before_the_weight_changed(ti):
    managed = ti.modules.convert_model(TELinear(8, 8))
    managed(torch.randn(4, 8), is_first_microbatch=True)
    assert ti.stale.stale_workspaces(managed) == []
    with torch.no_grad():
        managed.weight.add_(1.0)
    (found,) = ti.stale.stale_workspaces(managed)
    assert found.kind is ti.stale.StaleKind.CACHE_OLDER_THAN_WEIGHT and found.weight == "weight"


def test_check_stale_reads_raises_at_stocks_dgrad_and_counts_none_for_the_drop_in(ti):
    w0, w1 = torch.randn(8, 8), torch.randn(8, 8)
    managed = _with_weight(ti.modules.convert_model(TELinear(8, 8)), _quantized_weight(w0))
    stock = _with_weight(TELinear(8, 8), _quantized_weight(w0))
    optimizer = SilentFP8Writer([managed.weight, stock.weight])
    for module in (managed, stock):
        _input_grad(module)
        optimizer.writes[id(module.weight)] = w1
    optimizer.step()
    with ti.watch.check_stale_reads(action="count") as watch:
        _input_grad(managed)
    assert watch.reads == [] and watch.compared == 1
    with pytest.raises(ti.stale.StaleWorkspaceError, match="linear.general_gemm .*operand A"):
        with ti.watch.check_stale_reads(stock):
            _input_grad(stock)
    assert ti.files["linear"].general_gemm.__name__ == "general_gemm"  # the watch put TE's GEMM back


def test_check_stale_reads_refuses_bad_arguments(ti):
    with pytest.raises(ValueError, match="action must be 'raise' or 'count'"):
        ti.watch.check_stale_reads(action="warn")
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        ti.watch.check_stale_reads("model")
    with pytest.raises(TypeError, match="release_workspaces: model must be a torch.nn.Module"):
        ti.stale.release_workspaces(None)


class _PerTensorFP8:
    """Per-tensor FP8's layout: rowwise bytes and a derived transpose with its flag."""

    def __init__(self, data: torch.Tensor, transpose: torch.Tensor) -> None:
        self._data, self._transpose, self._transpose_invalid = data, transpose, False


def test_a_transpose_is_compared_as_the_kernels_read_it_not_through_its_view(ti):
    # TE's as_strided on a Float8Tensor (FSDP2's first all-gather) views the
    # contiguous transpose buffer with the data's strides swapped; the GEMM
    # reads the buffer from its pointer, so the copy is current.
    data = torch.arange(24, dtype=torch.uint8).reshape(4, 6)
    buffer = data.t().contiguous()
    view = buffer.as_strided((6, 4), (1, 6))
    assert not torch.equal(view, data.t())  # read through its strides it looks stale
    assert ti.stale.transpose_matches(_PerTensorFP8(data, view)) is True
    assert ti.stale.transpose_matches(_PerTensorFP8(data, buffer)) is True
    buffer[0, 0] += 1  # the buffer itself holds something else: stale either way
    assert ti.stale.transpose_matches(_PerTensorFP8(data, view)) is False
    assert torch.equal(ti.stale.as_kernels_read(view), buffer.reshape(-1))
    with pytest.raises(ValueError, match="has only 2 in its storage"):  # a broadcast view near the end
        ti.stale.as_kernels_read(buffer.reshape(-1).as_strided((2, 2), (0, 1), 22))


class _FP8Copy:
    """A per-tensor FP8 copy with real E4M3 bytes, as TE's storage holds them."""

    _fp8_dtype = "DType.kFloat8E4M3"

    def __init__(self, weight: torch.Tensor, scale: float) -> None:
        self._scale_inv = torch.tensor(1.0 / scale)
        self._data = (weight * scale).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
        self.shape = weight.shape

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        return self._data.view(torch.float8_e4m3fn).to(dtype) * self._scale_inv


def test_the_value_check_accepts_rounding_and_saturation_and_finds_a_changed_weight(ti):
    weight = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    copy = _FP8Copy(weight, scale=448 / weight.abs().max().item())
    assert not ti.stale.disagrees_with(copy, weight)
    saturating = _FP8Copy(weight, scale=2 * 448 / weight.abs().max().item())  # the largest values clamp
    assert not ti.stale.disagrees_with(saturating, weight)
    moved = weight.clone()
    moved[3, 5] += 0.5
    assert ti.stale.disagrees_with(copy, moved)


def test_fsdp2_gathered_parameters_of_an_unsharded_model_are_none_and_a_non_module_is_refused():
    assert fsdp2_gathered_parameters(torch.nn.Linear(2, 2)) == []
    with pytest.raises(TypeError, match="must be a torch.nn.Module"):
        fsdp2_gathered_parameters("model")
