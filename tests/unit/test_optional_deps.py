"""Without Hypothesis, the kit still imports and the Hypothesis helpers say how to install it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from workspace_manager.extending import install_hint

#: Runs ``body`` in a fresh interpreter in which ``import hypothesis`` fails.
_WITHOUT_HYPOTHESIS = "import sys; sys.modules['hypothesis'] = None\n"


def _run(body: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _WITHOUT_HYPOTHESIS + body], capture_output=True, text=True)


@pytest.mark.parametrize("module", ["strategies", "lifecycle"])
def test_hypothesis_helpers_name_the_test_extra(module):
    result = _run(f"import workspace_manager.testing.{module}")
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: ")
    assert f"workspace_manager.testing.{module} needs Hypothesis" in last
    assert install_hint("test") in last


def test_the_kit_imports_and_runs_without_hypothesis():
    result = _run(
        "import workspace_manager.testing as t\n"
        "from workspace_manager.testing import reference as r\n"
        "print(t.check_quantizer.__name__, r.Float8PerTensorQuantizer.__name__)\n"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["check_quantizer", "Float8PerTensorQuantizer"]
