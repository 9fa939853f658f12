"""Every Python block of docs/extending.md runs, and prints what the doc shows.

The blocks run in order in one namespace, in a fresh interpreter (they
register quantizers with the default registry), as the module the doc tells
the reader to save them as (``my_fp8/quantizers.py``), so that the class
names in the outputs are the reader's. A ``text`` block right after a
Python block is that block's expected output, where ``...`` matches
anything (doctest's ELLIPSIS).
"""

from __future__ import annotations

import doctest
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "extending.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```[ \t]*$", re.S | re.M)

RUNNER = r"""
import contextlib, io, json, sys, traceback, warnings
warnings.simplefilter("error")
for category in (DeprecationWarning, FutureWarning, UserWarning):
    warnings.filterwarnings("ignore", category=category, module="torch.*")
blocks = json.load(sys.stdin)
namespace = {"__name__": sys.argv[1]}
outputs = []
for index, code in enumerate(blocks):
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer):
            exec(compile(code, f"docs/extending.md block {index}", "exec"), namespace)
    except BaseException:
        outputs.append({"output": buffer.getvalue(), "error": traceback.format_exc()})
        break
    outputs.append({"output": buffer.getvalue(), "error": None})
print(json.dumps(outputs))
"""


def doc_module() -> str:
    """The module the doc has the reader save its Python blocks as."""
    paths = re.findall(r"save them, in order, as\s+`(\w+)/(\w+)\.py`", DOC.read_text())
    assert len(paths) == 1, f"docs/extending.md must say once which file the blocks make: {paths}"
    return ".".join(paths[0])


def doc_blocks() -> list[tuple[str, str, str | None]]:
    """(language, code, expected output or None) for each fenced block; a
    text block right after a python block is its output, not a block of its own."""
    text = DOC.read_text()
    found = [(m.group(1), m.group(2), m.start(), m.end()) for m in FENCE.finditer(text)]
    blocks: list[tuple[str, str, str | None]] = []
    for i, (lang, code, _start, end) in enumerate(found):
        if lang == "text" and blocks and blocks[-1][0] == "python" and blocks[-1][2] is None and i > 0:
            if text[found[i - 1][3]:_start].strip() == "":
                blocks[-1] = (blocks[-1][0], blocks[-1][1], code)
                continue
        blocks.append((lang, code, None))
    return blocks


@pytest.fixture(scope="module")
def executed():
    python = [(code, expected) for lang, code, expected in doc_blocks() if lang == "python"]
    result = subprocess.run(
        [sys.executable, "-c", RUNNER, doc_module()], input=json.dumps([c for c, _ in python]),
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    return python, json.loads(result.stdout.splitlines()[-1])


def test_the_doc_has_python_blocks_and_every_block_is_tagged():
    blocks = doc_blocks()
    assert sum(lang == "python" for lang, _, _ in blocks) >= 10
    assert all(lang in {"python", "text", "toml", "bash"} for lang, _, _ in blocks), {b[0] for b in blocks}


def test_every_python_block_runs_and_prints_what_the_doc_shows(executed):
    python, outputs = executed
    checker = doctest.OutputChecker()
    for index, ((code, expected), got) in enumerate(zip(python, outputs)):
        assert got["error"] is None, f"python block {index} failed:\n{code}\n{got['error']}"
        if expected is not None:
            assert checker.check_output(expected, got["output"], doctest.ELLIPSIS), (
                f"python block {index} printed:\n{got['output']}\nbut the doc shows:\n{expected}"
            )
    assert len(outputs) == len(python)


def test_the_documented_plugin_error_is_the_one_raised(monkeypatch):
    """The QuantizerPluginError sample (a text block on its own) matches the real message."""
    from types import SimpleNamespace

    import workspace_manager._quantizer_registry as registry_module
    from workspace_manager import QuantizerPluginError
    from workspace_manager.extending import ENTRY_POINT_GROUP, QuantizerRegistry

    sample = next(code for lang, code, expected in doc_blocks() if lang == "text" and "plugin(s)" in code)

    class EntryPoint(SimpleNamespace):
        def load(self):
            raise ModuleNotFoundError("No module named 'my_fp8.workspace'")

    ep = EntryPoint(name="my_fp8", value="my_fp8.workspace:register",
                    dist=SimpleNamespace(name="my-fp8", version="0.3.0"))
    monkeypatch.setattr(registry_module, "discover_entry_points", lambda group: [ep])
    with pytest.raises(QuantizerPluginError) as info:
        QuantizerRegistry(entry_point_group=ENTRY_POINT_GROUP).lookup(object)
    assert str(info.value) == sample.strip()


def test_the_outputs_name_only_the_module_the_reader_made():
    """A class of the doc's package in an output lives in the module the
    reader saved (not one the test made up, as it once did)."""
    module = doc_module()
    package = module.split(".")[0]
    outputs = " ".join(expected for lang, _, expected in doc_blocks() if lang == "python" and expected)
    named = set(re.findall(rf"\b{package}((?:\.\w+)+)\.[A-Z]\w*", outputs))
    assert named == {module.removeprefix(package)}, named
