"""The examples as a newcomer runs them: the CPU one on any machine, the
TE one saying in one line what it needs where TE is missing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: Run as a reader runs them, from the repository root, and with our own
#: deprecations as errors (an example must use the current names).
PYTHON = [sys.executable, "-W", "error::DeprecationWarning"]


def test_the_cpu_example_plans_prints_a_table_and_checks_a_quantizer():
    result = subprocess.run([*PYTHON, "examples/policies_on_cpu.py"], capture_output=True, text=True, timeout=300,
                            cwd=ROOT)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == ("FSDP2WorkspacePolicy: cache=bypass forward=rowwise backward=requantize(columnwise) "
                        "columnwise=requantized release=nothing")
    assert "  why: FSDP2 reshards after forward: no cached copy per layer (TE#2681)" in lines
    assert any(l.startswith("plain: cache=reuse ") for l in lines)
    assert any(l.startswith("lean: cache=bypass ") and "backward=requantize(columnwise)" in l for l in lines)
    assert "== policy: fsdp2 ==" in lines and "legend:" in lines
    assert lines[-1] == "check_quantizer(workspace_manager.testing.reference.Float8PerTensorQuantizer): all 21 checks passed"


#: The TE example's entry point with TransformerEngine hidden, as on a machine without it.
WITHOUT_TE = ("import runpy, sys; sys.modules['transformer_engine'] = None; "
              "runpy.run_module('examples.custom_quantizer', run_name='__main__', alter_sys=True)")


def test_the_te_example_without_te_says_what_it_needs_in_one_line():
    result = subprocess.run([*PYTHON, "-c", WITHOUT_TE], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert (result.returncode, result.stdout) == (1, "")
    (line,) = result.stderr.splitlines()
    assert line.startswith("examples.custom_quantizer needs TransformerEngine 2.20 for PyTorch")
    assert "python3 -m pip install -e '.[te]'" in line


def test_importing_a_name_of_the_te_example_without_te_raises_one_import_error():
    code = ("import sys; sys.modules['transformer_engine'] = None\n"
            "try:\n    from examples.custom_quantizer import make_recipe\n"
            "except ImportError as err:\n"
            "    print(type(err).__name__, err.__cause__ is None and err.__suppress_context__)\n")
    result = subprocess.run([*PYTHON, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.stdout == "ImportError True\n", result.stderr
