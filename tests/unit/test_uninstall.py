"""``uninstall_seams`` on the CPU stand-in TE: a stock module then runs
TE's code untouched (the same Python calls as before any install), and the
next drop-in call installs the seams again, with the same numbers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _call_count import count_calls
from _fake_te import TELinear, load_full_binding
from _fake_te import __file__ as _fake_te_file


@pytest.fixture
def ti(monkeypatch):
    return load_full_binding(monkeypatch)


#: The binding's own folder, and the stand-in TE's file.
BINDING_DIR = str(Path(__file__).resolve().parents[2] / "te_integration")
FAKE_TE = str(Path(_fake_te_file).resolve())


def _python_calls(fn, repeat: int = 5) -> tuple[float, float]:
    """Python-level calls per run of ``fn`` (a count, not a time) made in
    te_integration's files and in the stand-in TE's: (binding, TE). Other
    frames (torch, a garbage collection's callbacks) are not counted."""
    calls = count_calls(fn, repeat)
    binding = sum(n for (path, _), n in calls.items() if path.startswith(BINDING_DIR))
    return binding, sum(n for (path, _), n in calls.items() if path == FAKE_TE)


def test_a_stock_module_runs_tes_code_untouched_after_uninstall(ti):
    x = torch.randn(4, 8, requires_grad=True)
    stock = TELinear(8, 8, seed=1)
    managed = ti.modules.convert_model(TELinear(8, 8, seed=1))

    def stock_call():
        stock(x).sum().backward()

    binding, te_calls = _python_calls(stock_call)
    assert binding == 0 and te_calls > 0  # before any install: TE's code alone
    out = managed(x)  # the first drop-in call installs the seams
    assert ti.install.INSTALLED
    assert _python_calls(stock_call)[0] > 0  # installed seams: stock calls pass through them
    ti.install.uninstall()  # te_integration.debug.uninstall_seams
    assert not ti.install.INSTALLED
    assert _python_calls(stock_call) == (0, te_calls)
    again = managed(x)  # the next drop-in call installs them again
    assert ti.install.INSTALLED and torch.equal(out, again)
