"""The public names: each package's top level exports what its users call,
named submodules the rest; names that moved still resolve for one release,
with a DeprecationWarning naming the new module; docs/api.md lists every
public name under the module that exports it, and no doc names a moved
name at its old place."""

from __future__ import annotations

import ast
import importlib
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import workspace_manager as wm

ROOT = Path(__file__).resolve().parents[2]
API_DOC = ROOT / "docs" / "api.md"
#: The public modules of the TE-free core (importable here).
CORE_MODULES = ("workspace_manager", "workspace_manager.extending", "workspace_manager.attribution",
                "workspace_manager.testing", "workspace_manager.gather")


def _literal(path: Path, name: str):
    """The literal value assigned to ``name`` at the top of ``path`` (its
    list may start with ``*kinds.__all__``, which stands for the kinds' drop-ins)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            if isinstance(node.value, ast.List):
                return [e.value for e in node.value.elts if isinstance(e, ast.Constant)]
            return node.value
    raise AssertionError(f"{path} assigns no {name}")


def _kind_names() -> list[str]:
    """The drop-ins te_integration exports: every kind file's ``__all__``."""
    return [n for path in sorted((ROOT / "te_integration" / "kinds").glob("[!_]*.py"))
            for n in _literal(path, "__all__")]


def _te_moved() -> dict[str, str]:
    """te_integration's moved names -> their module, read from its ``__init__`` (it needs TE to import)."""
    call = _literal(ROOT / "te_integration" / "__init__.py", "_MOVED")
    names, home = call.args
    return dict.fromkeys((e.value for e in names.elts), home.value)


def public_names() -> dict[str, list[str]]:
    """Module -> its ``__all__``, for every public module of both packages."""
    names = {m: list(importlib.import_module(m).__all__) for m in CORE_MODULES}
    names["te_integration"] = _kind_names() + _literal(ROOT / "te_integration" / "__init__.py", "__all__")
    names["te_integration.debug"] = _literal(ROOT / "te_integration" / "debug.py", "__all__")
    return names


def moved() -> dict[str, dict[str, str]]:
    """Old module -> {moved name: its new module}."""
    return {"workspace_manager": dict(wm._MOVED), "te_integration": _te_moved()}


# -- the core ------------------------------------------------------------------
def test_the_top_level_lists_only_what_users_call():
    assert not set(wm.__all__) & set(wm._MOVED)
    assert dir(wm) == sorted([*wm.__all__, "attribution", "extending", "testing"])
    assert all(getattr(wm, name) is not None for name in wm.__all__)
    assert len(wm.__all__) == 46


@pytest.mark.parametrize("name", sorted(wm._MOVED))
def test_a_moved_name_warns_naming_its_new_module_and_is_the_same_object(name):
    home = wm._MOVED[name]
    with pytest.warns(DeprecationWarning) as caught:
        old = getattr(wm, name)
    assert len(caught) == 1 and caught[0].filename == __file__  # the line that used the old name
    assert f"workspace_manager.{name} has moved to {home}.{name}" in str(caught[0].message)
    assert old is getattr(importlib.import_module(home), name)
    assert name in importlib.import_module(home).__all__


def test_from_import_of_a_moved_name_warns_once():
    with pytest.warns(DeprecationWarning, match="workspace_manager.extending") as caught:
        from workspace_manager import default_registry  # noqa: F401
    assert len(caught) == 1
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        wm.no_such_name  # noqa: B018


def test_a_user_modules_import_of_a_moved_name_warns(tmp_path):
    (tmp_path / "user_code.py").write_text("from workspace_manager import install_hint\n")
    code = "import sys, warnings; warnings.simplefilter('error'); sys.path.insert(0, sys.argv[1]); import user_code"
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "DeprecationWarning: workspace_manager.install_hint has moved to " \
        "workspace_manager.extending.install_hint" in result.stderr


# -- the binding, against a stand-in TE on disk ---------------------------------
def test_te_integration_exports_its_users_names_and_moved_names_still_resolve(tmp_path):
    """``import te_integration`` warns about nothing (it imports no moved core
    name at its old place); each name moved to ``debug`` warns and is
    the same object; ``dir`` lists the public names."""
    from _te_standin_ops_tree import write_te_ops_tree
    from _te_standin_tree import QUANTIZER_STUBS, write_te_tree

    root = write_te_ops_tree(write_te_tree(tmp_path))
    code = textwrap.dedent("""
        import json, warnings
        warnings.simplefilter("error")
        import te_integration as ti
        out = {"all": ti.__all__, "dir": dir(ti), "moved": {}}
        for name, home in ti._MOVED.items():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                value = getattr(ti, name)
            new = sys.modules[home]
            out["moved"][name] = [[str(w.message) for w in caught], value is getattr(new, name), name in new.__all__]
        print(json.dumps(out))
    """)
    code = code.replace("import te_integration as ti", QUANTIZER_STUBS + "import te_integration as ti", 1)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={"PYTHONPATH": f"{root}:{ROOT}", "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert sorted(out["all"]) == sorted(public_names()["te_integration"]) and not set(out["all"]) & set(_te_moved())
    assert out["dir"] == sorted([*out["all"], "debug"])
    assert set(out["moved"]) == set(_te_moved()) and len(out["moved"]) == 11
    for name, (messages, same, listed) in out["moved"].items():
        assert messages == [f"te_integration.{name} has moved to te_integration.debug.{name}; import it from "
                            "te_integration.debug (the old name will be removed in the next release)"], name
        assert same and listed, name


# -- the docs --------------------------------------------------------------------
def documented_names(text: str) -> dict[str, list[str]]:
    """docs/api.md's names per module: the backticked names at the start of
    each bullet (``- `a`, `b`: ...``, ``...; `c`: ...``) under ``## module``."""
    out: dict[str, list[str]] = {}
    for section in re.split(r"^## ", text, flags=re.M)[1:]:
        module, _, body = section.partition("\n")
        names = out.setdefault(module.strip(), [])
        for bullet in re.split(r"\n(?=- )", body):
            if not bullet.startswith("- "):
                continue
            for part in " ".join(bullet.split()).split("; "):
                head, colon, _ = part.removeprefix("- ").partition(": ")
                names += re.findall(r"`(\w+)`", head) if colon else []
    return out


def test_the_api_page_finds_names_as_written():
    text = ("# T\n\n## mod\n\nIntro `not_a_name`.\n\n- `a`, `b`: two; `c`: one\n  `d` inside a line; then `g`\n"
            "- `e`: x\n\n## other\n- `f`: y\n")
    assert documented_names(text) == {"mod": ["a", "b", "c", "e"], "other": ["f"]}


def test_every_public_name_is_on_the_api_page_under_its_module():
    documented = documented_names(API_DOC.read_text())
    public = public_names()
    assert list(documented) == list(public)
    for module, names in public.items():
        assert sorted(documented[module]) == sorted(names), (
            module, sorted(set(names) - set(documented[module])), sorted(set(documented[module]) - set(names)))


def old_places(text: str, moves: dict[str, dict[str, str]]) -> list[str]:
    """Where ``text`` names a moved name at its old module: ``module.name``,
    ``ti.name`` / ``wm.name``, or ``from module import ..., name``."""
    aliases = {"workspace_manager": "workspace_manager", "wm": "workspace_manager", "te_integration": "te_integration",
               "ti": "te_integration"}
    found = []
    for alias, module in aliases.items():
        for m in re.finditer(rf"(?<![\w.]){alias}\.(\w+)", text):
            if m.group(1) in moves[module]:
                found.append(m.group(0))
    for m in re.finditer(r"from (workspace_manager|te_integration) import \(?([\w\s,]+)\)?", text):
        found += [f"from {m.group(1)} import {n}" for n in re.findall(r"\w+", m.group(2)) if n in moves[m.group(1)]]
    return found


def test_an_old_place_in_a_doc_is_found():
    moves = {"workspace_manager": {"PROFILES": "x"}, "te_integration": {"workspace_state": "y"}}
    text = ("`workspace_manager.PROFILES`, `ti.workspace_state(m)`, `te_integration.debug.workspace_state`\n"
            "from workspace_manager import (Usage,\n    PROFILES)\nfrom workspace_manager.extending import PROFILES\n")
    assert old_places(text, moves) == ["workspace_manager.PROFILES", "ti.workspace_state",
                                       "from workspace_manager import PROFILES"]


@pytest.mark.parametrize("path", [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))], ids=lambda p: p.name)
def test_the_docs_name_moved_names_at_their_new_places(path):
    assert old_places(path.read_text(), moved()) == []


def test_the_package_code_uses_no_moved_name_at_its_old_place():
    """Every ``.py`` file of the project, read as text: imports and attribute
    uses alike, code in strings too."""
    skip = (ROOT / "benchmarks" / "results",)
    moves = moved()
    found = {}
    for folder in ("workspace_manager", "te_integration", "tests", "testbed", "examples", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == Path(__file__) or any(path.is_relative_to(s) for s in skip):
                continue
            if hits := old_places(path.read_text(), moves):
                found[path.relative_to(ROOT).as_posix()] = hits
    assert found == {}

