"""``uninstall_seams`` on the CPU stand-in TE: a stock module then runs
TE's code untouched (the same Python calls as before any install), and the
next drop-in call installs the seams again, with the same numbers."""

from __future__ import annotations

import sys

import pytest
import torch
from _fake_te import TELinear, load_full_binding


@pytest.fixture
def ti(monkeypatch):
    return load_full_binding(monkeypatch)


def _python_calls(fn, repeat: int = 5) -> float:
    """Python-level calls per run of ``fn`` (a count, not a time)."""
    fn()
    calls = [0]

    def profile(frame, event, arg):
        if event == "call":
            calls[0] += 1

    sys.setprofile(profile)
    try:
        for _ in range(repeat):
            fn()
    finally:
        sys.setprofile(None)
    return calls[0] / repeat


def test_a_stock_module_runs_tes_code_untouched_after_uninstall(ti):
    x = torch.randn(4, 8, requires_grad=True)
    stock = TELinear(8, 8, seed=1)
    managed = ti.modules.convert_model(TELinear(8, 8, seed=1))

    def stock_call():
        stock(x).sum().backward()

    pristine = _python_calls(stock_call)
    out = managed(x)  # the first drop-in call installs the seams
    assert ti.seams.INSTALLED
    through_seams = _python_calls(stock_call)
    assert through_seams > pristine  # installed seams: stock calls pass through them
    ti.seams.uninstall()  # te_integration.uninstall_seams
    assert not ti.seams.INSTALLED
    assert _python_calls(stock_call) == pristine
    again = managed(x)  # the next drop-in call installs them again
    assert ti.seams.INSTALLED and torch.equal(out, again)
