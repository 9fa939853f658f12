"""The README's two commands are the ones CI runs and the ones that work."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _readme_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    return [b.strip() for b in blocks]


def test_ci_runs_the_readme_test_command():
    test_command = _readme_commands()[0]
    assert "pytest" in test_command
    ci_lines = [l.strip() for l in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test_command in ci_lines


def test_readme_main_job_is_the_explain_cli():
    assert _readme_commands()[1] == "python3 -m workspace_manager explain"
