"""What a fresh clone and ``pip install`` give a newcomer: typed packages,
classifiers and links on the package index, a checkout that ``git status``
keeps clean after the README's commands."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("workspace_manager", "te_integration")

tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


@pytest.mark.parametrize("package", PACKAGES)
def test_both_packages_are_typed_and_ship_the_marker(package):
    assert (ROOT / package / "py.typed").is_file(), f"{package}/py.typed is missing (PEP 561)"
    package_data = _project()["tool"]["setuptools"]["package-data"]
    assert "py.typed" in package_data.get(package, []), f"py.typed of {package} is not package data"


def test_the_index_page_has_classifiers_and_links():
    project = _project()["project"]
    classifiers = project["classifiers"]
    assert "Typing :: Typed" in classifiers and "Programming Language :: Python :: 3 :: Only" in classifiers
    assert not any(c.startswith("License ::") for c in classifiers), "PEP 639: the license is the SPDX string"
    urls = project["urls"]
    assert {"Homepage", "Source", "Issues"} <= set(urls)
    assert all(u.startswith("https://github.com/") for u in urls.values()), urls


def test_the_readme_venv_is_ignored():
    lines = (ROOT / ".gitignore").read_text().splitlines()
    assert ".venv/" in lines
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    ignored = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q", ".venv/bin/python"], check=False)
    assert ignored.returncode == 0, "git does not ignore .venv/"
