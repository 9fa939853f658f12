"""Importing te_integration without a supported TE fails with a message that helps."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from workspace_manager.extending import install_hint

ROOT = Path(__file__).resolve().parents[2]


def _import_with(path_entries: list[str]) -> subprocess.CompletedProcess:
    code = textwrap.dedent(
        """
        import sys
        try:
            import te_integration
        except ImportError as err:
            print(type(err).__name__, err)
            sys.exit(3)
        """
    )
    env_path = ":".join(path_entries + [str(ROOT)])
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"})


def test_without_te_the_error_says_how_to_install(tmp_path):
    blocker = tmp_path / "transformer_engine.py"
    blocker.write_text("raise ImportError('No module named transformer_engine (blocked by the test)')\n")
    result = _import_with([str(tmp_path)])
    assert result.returncode == 3, result.stderr
    assert "UnsupportedTEError" in result.stdout and install_hint("te") in result.stdout


def test_another_te_version_names_installed_and_supported(tmp_path):
    pkg = tmp_path / "transformer_engine"
    (pkg / "pytorch").mkdir(parents=True)
    (pkg / "__init__.py").write_text("__version__ = '2.19.1'\n")
    (pkg / "pytorch" / "__init__.py").write_text("")
    result = _import_with([str(tmp_path)])
    assert result.returncode == 3, result.stderr
    assert "2.19.1" in result.stdout and ">=2.20,<2.21" in result.stdout
    assert install_hint("te") in result.stdout  # the te extra pins a supported TE
    assert issubclass_importerror(result.stdout)


def issubclass_importerror(stdout: str) -> bool:
    # UnsupportedTEError subclasses ImportError: the except clause above caught it.
    return stdout.startswith("UnsupportedTEError")
