"""The conformance checker's notion of "dgrad read the parameter": the
parameter object itself, or an alias over its own memory (what a
non-reentrant checkpoint hands backward), never a copy."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
from _conformance import Operand  # noqa: E402


class _Storage:
    """A per-tensor FP8 storage as the checker reads it."""

    def __init__(self, data: torch.Tensor, transpose: torch.Tensor) -> None:
        self._data, self._transpose, self._transpose_invalid = data, transpose, False
        self._scale_inv = torch.ones(1)

    def get_usages(self) -> dict:
        return {"rowwise": self._data is not None, "columnwise": self._transpose is not None}


def test_an_alias_over_the_parameters_memory_reads_the_parameter_and_a_copy_does_not():
    parameter = _Storage(torch.ones(4, 4), torch.ones(4, 4))
    alias = _Storage(parameter._data.view(4, 4), parameter._transpose.view(4, 4))  # like detach(): same memory
    copy = _Storage(parameter._data.clone(), parameter._transpose.clone())
    assert Operand.of(parameter, _Storage, parameter).is_parameter
    assert Operand.of(alias, _Storage, parameter).is_parameter
    assert not Operand.of(copy, _Storage, parameter).is_parameter
    assert not Operand.of(alias, _Storage, None).is_parameter
    shares_scale = _Storage(torch.ones(4, 4), torch.ones(4, 4))
    shares_scale._scale_inv = parameter._scale_inv
    assert not Operand.of(shares_scale, _Storage, parameter).is_parameter


def test_a_dequantized_alias_of_the_parameter_counts_as_the_parameter_dequantized():
    """``backward_override="high_precision"`` under a non-reentrant checkpoint:
    backward dequantizes a storage restored over the parameter's tensors."""
    from _conformance import CallRecorder

    class _Dequantizable(_Storage):
        shape = (4, 4)

        def dequantize(self, *args, **kwargs):
            return self._data.float()

    parameter = _Dequantizable(torch.ones(4, 4), torch.ones(4, 4))
    alias = _Dequantizable(parameter._data.view(4, 4), parameter._transpose.view(4, 4))
    copy = _Dequantizable(parameter._data.clone(), parameter._transpose.clone())
    recorder = CallRecorder(files=[], storage_base=_Storage, plans=dict, weights={"weight": (4, 4)},
                            parameter=lambda key: parameter, cache=dict)
    dequantize = recorder._dequantize_wrapper(_Dequantizable.dequantize)
    outs = [dequantize(obj) for obj in (alias, copy)]
    sources = [source for _, source in recorder._dequantized]
    assert [s.is_parameter for s in sources] == [True, False]
    assert all(torch.equal(o, torch.ones(4, 4)) for o in outs)
