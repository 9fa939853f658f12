"""``testbed.record``: the commit a result records (the benchmarks and
``tests.te_suite`` both write it), with and without git."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from testbed import record  # noqa: E402


def test_env_capture_without_git_falls_back(monkeypatch, tmp_path):
    monkeypatch.setattr(record, "REPO_ROOT", tmp_path)  # not a git repository
    monkeypatch.setenv("TE_WM_COMMIT", "abc123")
    assert record.git_commit() == {"commit": "abc123", "dirty": None, "source": "TE_WM_COMMIT"}


def test_env_commit_wins_over_git(monkeypatch):
    """A copy of the checkout may hold a stale .git; TE_WM_COMMIT names the real commit."""
    monkeypatch.setenv("TE_WM_COMMIT", "c0ffee")
    assert record.git_commit()["commit"] == "c0ffee"
    monkeypatch.delenv("TE_WM_COMMIT")
    assert record.git_commit()["source"] == "git"
