"""``testbed.model.QuantizationCounter`` on the CPU stand-in: the figure the
FSDP2 tests and the memory benchmarks compare, stock against drop-in. The
drop-in's seam makes an uncached weight's quantizer call itself instead of
going through TE's ``quantize_weight``, so a counter that watched only
``quantize_weight`` would count the drop-in as quantizing nothing."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from _fake_te import Float8CurrentScalingQuantizer, TELinear, Workspace, load_full_binding

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from testbed.model import QuantizationCounter  # noqa: E402


@pytest.fixture
def ti(monkeypatch):
    return load_full_binding(monkeypatch)


def _counter(ti) -> QuantizationCounter:
    return QuantizationCounter(compat=sys.modules["te_integration.te._compat"],
                               quantizer_base=Float8CurrentScalingQuantizer, quantized=Workspace)


def _counts(ti, module, positions) -> list[int]:
    x = torch.randn(4, 8, requires_grad=True)
    counts = []
    for first in positions:
        with _counter(ti) as counter:
            module(x, is_first_microbatch=first).sum().backward()
        counts.append(counter.count)
    return counts


@pytest.mark.parametrize("positions", [(None, None), (True, False, False, True)])
def test_the_drop_in_and_stock_count_the_same_quantizations(ti, positions):
    managed = ti.modules.convert_model(TELinear(8, 8, seed=1))
    managed_counts = _counts(ti, managed, positions)
    # Stock runs with the seams installed, as in the GPU tests: an unmanaged
    # module's call passes through them to TE's quantize_weight.
    stock_counts = _counts(ti, TELinear(8, 8, seed=1), positions)
    assert managed_counts == stock_counts
    # A fresh or refreshed workspace is one; a cache hit without refresh none.
    assert stock_counts == [1 if first in (None, True) else 0 for first in positions]


def test_a_quantize_override_that_calls_its_base_counts_once_and_calls_without_dtype_not_at_all():
    class Base:
        def quantize(self, tensor, *, dtype=None):
            return ("made", tensor)

    class Override(Base):
        def quantize(self, tensor, *, dtype=None):
            return super().quantize(tensor, dtype=dtype)

    compat = type("Compat", (), {"quantize_weight": staticmethod(lambda **kw: (kw["workspace"], None))})()
    original_quantize = Override.__dict__["quantize"]
    with QuantizationCounter(compat=compat, quantizer_base=Base, quantized=Workspace) as counter:
        assert Override().quantize(torch.ones(1), dtype=None)[0] == "made"
        Override().quantize(torch.ones(1))  # as ``quantizer(tensor)``: an activation or a backward rebuild
        compat.quantize_weight(tensor=torch.ones(1), workspace="ws", update_workspace=False)  # a plain hit
        compat.quantize_weight(tensor=torch.ones(1), workspace="ws", update_workspace=True)  # refreshed
    assert counter.count == 2
    assert Override.__dict__["quantize"] is original_quantize  # restored on exit
