"""A TE build missing a piece the binding relies on is refused at import,
with UnsupportedTEError naming the piece and its file, never a raw
AttributeError. Runs against a stand-in TE on disk (``_te_standin_tree``),
in a fresh interpreter per case so that no stand-in leaks into this one."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _te_standin_tree import remove, write_te_tree

ROOT = Path(__file__).resolve().parents[2]

# Loads _compat alone (the package __init__ would import the whole binding,
# which the stand-in does not carry); prints the seams on success.
_LOAD_COMPAT = textwrap.dedent(
    f"""
    import json, sys, types
    package = types.ModuleType("te_integration")
    package.__path__ = [{str(ROOT / "te_integration")!r}]
    sys.modules["te_integration"] = package
    try:
        import te_integration.te._compat as compat
    except Exception as err:
        print(type(err).__name__, err)
        sys.exit(3)
    print(json.dumps([[s.module, s.attr, s.file] for s in compat.SEAMS]))
    """
)


def _run(root: Path, code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": f"{root}:{ROOT}", "PATH": "/usr/bin:/bin"})


@pytest.fixture(scope="module")
def seams(tmp_path_factory) -> list[list[str]]:
    """The seams of a complete stand-in, which loads (the control for every
    refusal below: what fails there is the piece the test took away)."""
    root = write_te_tree(tmp_path_factory.mktemp("complete"))
    result = _run(root, _LOAD_COMPAT)
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout)


def test_every_seam_missing_is_refused_with_its_name_and_file(seams, tmp_path):
    checked = 0
    for i, (module, attr, file) in enumerate(seams):
        if module == "transformer_engine.pytorch" and not attr:
            continue  # no PyTorch extension at all: test_te_import_guard covers it
        root = write_te_tree(tmp_path / str(i))
        remove(root, module, attr)
        result = _run(root, _LOAD_COMPAT)
        case = f"{module}:{attr}: {result.stdout}{result.stderr}"
        assert result.returncode == 3 and result.stdout.startswith("UnsupportedTEError"), case
        # A whole file missing may already break TE's own import, which
        # names the module only by its last part.
        assert (attr or module.rsplit(".", 1)[-1]) in result.stdout, case
        if attr:
            assert f"`{attr}` in {file}" in result.stdout and "2.20" in result.stdout, case
        checked += 1
    assert checked >= 40  # the table was read, not skipped


def test_the_issue_example_a_linear_without_linear_eager(tmp_path):
    """A 2.20.x build whose linear.py has no ``_linear_eager``, imported as
    users do (``import te_integration``)."""
    root = write_te_tree(tmp_path)
    remove(root, "transformer_engine.pytorch.module.linear", "_linear_eager")
    code = "import te_integration\n"
    result = _run(root, code)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("te_integration.te._compat.UnsupportedTEError"), result.stderr
    assert "`_linear_eager` in transformer_engine/pytorch/module/linear.py" in last
    assert "transformer_engine[pytorch]>=2.20,<2.21" in last and "report" in last
    assert "AttributeError" not in result.stderr


@pytest.mark.parametrize(
    "file, old, new, expected",
    [
        ("module/layernorm_mlp.py", "fsdp2_skip_columnwise = is_fsdp2 and not is_recomputation",
         "fsdp2_skip_columnwise = False", "_LayerNormMLP._forward (transformer_engine/pytorch/module/"
         "layernorm_mlp.py) no longer contains"),
        ("module/layernorm_linear.py", "(_unused0, is_first_microbatch,", "(_unused0, first_microbatch,",
         "non_tensor_args[1] is no longer 'is_first_microbatch'"),
        ("module/linear.py", "'backward_override', ", "", "has no field 'backward_override'"),
        ("module/base.py", "out = quantizer.quantize(tensor, dtype=workspace_dtype)",
         "out = quantizer.quantize(tensor)", "quantize_weight (transformer_engine/pytorch/module/base.py) no "
         "longer contains"),
    ],
    ids=["code_line", "tuple_position", "dataclass_field", "quantize_weight_line"],
)
def test_a_changed_shape_is_refused_naming_the_change(tmp_path, file, old, new, expected):
    root = write_te_tree(tmp_path)
    path = root / "transformer_engine/pytorch" / file
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))
    result = _run(root, _LOAD_COMPAT)
    assert result.returncode == 3 and result.stdout.startswith("UnsupportedTEError"), result.stdout + result.stderr
    assert expected in result.stdout
