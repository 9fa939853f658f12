"""Without Hypothesis, the kit still imports and the Hypothesis helpers say how to install it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from workspace_manager.extending import install_hint

#: In one fresh interpreter in which ``import hypothesis`` fails: each
#: Hypothesis helper's import (None, or its error), then the kit's names.
_WITHOUT_HYPOTHESIS = """
import importlib, json, sys
sys.modules["hypothesis"] = None
found = {}
for module in ("strategies", "lifecycle"):
    try:
        importlib.import_module(f"workspace_manager.testing.{module}")
        found[module] = None
    except ImportError as err:
        found[module] = f"{type(err).__name__}: {err}"
import workspace_manager.testing as t
from workspace_manager.testing import reference as r
found["kit"] = [t.check_quantizer.__name__, r.Float8PerTensorQuantizer.__name__]
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def without_hypothesis() -> dict:
    result = subprocess.run([sys.executable, "-c", _WITHOUT_HYPOTHESIS], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.parametrize("module", ["strategies", "lifecycle"])
def test_hypothesis_helpers_name_the_test_extra(without_hypothesis, module):
    error = without_hypothesis[module]
    assert error is not None and error.startswith("ImportError: ")
    assert f"workspace_manager.testing.{module} needs Hypothesis" in error
    assert install_hint("test") in error


def test_the_kit_imports_and_runs_without_hypothesis(without_hypothesis):
    assert without_hypothesis["kit"] == ["check_quantizer", "Float8PerTensorQuantizer"]
