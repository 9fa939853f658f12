"""How the whole suite runs: on every core with pytest-xdist (tests/conftest.py),
and ending with failures and errors only, not a line per skipped GPU test."""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _addopts() -> list[str]:
    text = (ROOT / "pyproject.toml").read_text()
    return shlex.split(re.search(r'^addopts = "(.*)"$', text, re.M).group(1))


def test_the_summary_lists_failures_and_errors_but_no_skips():
    reports = [o[2:] for o in _addopts() if o.startswith("-r")]
    assert reports == ["fE"]  # -ra listed 43 skipped GPU tests, one per line; -rs still does
    assert "pytest-xdist>=3" in (ROOT / "pyproject.toml").read_text()


def _suite_conftest():
    """tests/conftest.py under a name of its own (tests/unit/conftest.py is ``conftest`` here)."""
    spec = importlib.util.spec_from_file_location("_suite_conftest", ROOT / "tests" / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _config(*, source=pytest.Config.ArgsSource.TESTPATHS, xdist=True, numprocesses=None, markexpr="",
            collectonly=False):
    options = {"numprocesses": numprocesses, "markexpr": markexpr, "collectonly": collectonly}
    return SimpleNamespace(args_source=source, pluginmanager=SimpleNamespace(hasplugin=lambda name: xdist),
                           getoption=lambda name, default=None: options.get(name, default),
                           option=SimpleNamespace(numprocesses=numprocesses))


def test_only_the_whole_cpu_suite_runs_on_every_core(monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    suite = _suite_conftest()
    assert suite._runs_on_every_core(_config())
    for config in (_config(source=pytest.Config.ArgsSource.ARGS),  # some paths: one process
                   _config(xdist=False), _config(numprocesses=0), _config(numprocesses=4),
                   _config(markexpr="gpu"), _config(collectonly=True)):
        assert not suite._runs_on_every_core(config)
    config = _config()
    suite.pytest_cmdline_main(config)
    assert config.option.numprocesses == "auto"
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")  # a worker starts none of its own
    assert not suite._runs_on_every_core(_config())
