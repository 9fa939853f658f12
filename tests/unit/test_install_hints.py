"""Every install hint is one command that works from a clone: ``install_hint``.

The project is installed from source, so a hint names the editable install
with extras that ``pyproject.toml`` declares, and no message names the
distribution as if a package index served it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from workspace_manager.extending import install_hint

ROOT = Path(__file__).resolve().parents[2]
tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
#: The installed code whose messages a user reads.
SOURCES = ("workspace_manager", "te_integration", "examples", "benchmarks", "testbed")


def _extras() -> set[str]:
    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])


@pytest.mark.parametrize("extras", ["te", "test", "te,test", "te,test,bench"])
def test_the_hint_installs_declared_extras_from_a_clone(extras):
    hint = install_hint(extras)
    assert f"python3 -m pip install -e '.[{extras}]'" in hint and "clone" in hint
    named = re.search(r"\.\[([^\]]+)\]", hint).group(1).split(",")
    assert set(named) <= _extras(), f"{hint} names an extra pyproject.toml does not declare"


@pytest.mark.parametrize("extras", ["", "te,", "te test", "'te'", None])
def test_a_malformed_extra_list_is_refused(extras):
    with pytest.raises(ValueError, match="comma-separated extra names"):
        install_hint(extras)


#: ``pip install 'te-workspace-manager[te]'`` finds nothing: no index serves it.
_INDEX_HINT = re.compile(r"pip install\W+te[-_]workspace[-_]manager")


def index_hints(root: Path, packages: tuple[str, ...]) -> list[str]:
    """``file:line`` of each line under ``root``'s ``packages`` that tells to
    install the distribution from a package index."""
    return [f"{path.relative_to(root)}:{n}" for package in packages for path in sorted((root / package).rglob("*.py"))
            for n, line in enumerate(path.read_text().splitlines(), 1) if _INDEX_HINT.search(line)]


def test_no_message_names_the_distribution_as_an_index_package():
    assert all((ROOT / package).is_dir() for package in SOURCES)
    assert index_hints(ROOT, SOURCES) == []


def test_the_scan_finds_a_hint_that_names_the_distribution(tmp_path):
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    bad = "x = 1\nraise ImportError(\"pip install 'te-workspace-manager[te]'\")\n"
    (tmp_path / "pkg" / "sub" / "m.py").write_text(bad)
    (tmp_path / "pkg" / "ok.py").write_text(f"hint = {install_hint('te')!r}\n")
    assert index_hints(tmp_path, ("pkg",)) == ["pkg/sub/m.py:2"]
