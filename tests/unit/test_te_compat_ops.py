"""A TE build missing a te.ops piece the binding relies on, or whose
te.ops code lines changed, is refused at import with UnsupportedTEError
naming the piece and its file (the te.ops layer, ``_compat_ops``; the
modules' layer is ``test_te_compat_seams``). A fresh interpreter per case."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _te_standin_ops_tree import write_te_ops_tree
from _te_standin_tree import remove, source_file
from test_te_compat_seams import _LOAD_COMPAT

ROOT = Path(__file__).resolve().parents[2]

# The modules' layer's loader (test_te_compat_seams), loading the te.ops layer instead.
_LOAD = _LOAD_COMPAT.replace("import te_integration.te._compat as compat",
                             "import te_integration.te._compat_ops as compat")
assert _LOAD != _LOAD_COMPAT


def _run(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _LOAD], capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": f"{root}:{ROOT}", "PATH": "/usr/bin:/bin"})


@pytest.fixture(scope="module")
def seams(tmp_path_factory) -> list[list[str]]:
    """The control: a complete stand-in loads."""
    result = _run(write_te_ops_tree(tmp_path_factory.mktemp("complete")))
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout)


def test_every_ops_piece_missing_is_refused_with_its_name_and_file(seams, tmp_path):
    checked = 0
    for i, (module, attr, file) in enumerate(seams):
        if not attr:
            continue  # a whole te.ops file missing breaks TE's own import first
        root = write_te_ops_tree(tmp_path / str(i))
        remove(root, module, attr)
        result = _run(root)
        case = f"{module}:{attr}: {result.stdout}{result.stderr}"
        assert result.returncode == 3 and result.stdout.startswith("UnsupportedTEError"), case
        assert f"`{attr}` in {file}" in result.stdout and "2.20" in result.stdout, case
        checked += 1
    assert checked >= 20


@pytest.mark.parametrize("module, line", [
    ("transformer_engine.pytorch.ops.basic.basic_linear", "columnwise=input_requires_grad and backward_override is None"),
    ("transformer_engine.pytorch.ops.fuser", "func_ctx.basic_op_ctxs = basic_op_ctxs"),
    ("transformer_engine.pytorch.ops.basic.grouped_linear", "saved.extend(ws)"),
])
def test_a_changed_ops_code_line_is_refused_naming_it(tmp_path, module, line):
    root = write_te_ops_tree(tmp_path)
    path = source_file(root, module)
    path.write_text(path.read_text().replace(line, "changed"))
    result = _run(root)
    assert result.returncode == 3 and result.stdout.startswith("UnsupportedTEError"), result.stdout + result.stderr
    assert repr(line) in result.stdout and "te.ops" in result.stdout
