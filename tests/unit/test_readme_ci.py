"""The README's two commands are the ones CI runs and the ones that work."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: How the README's test command makes its environment; CI makes its own in a temp dir.
README_VENV = "python3 -m venv .venv && . .venv/bin/activate && "


def _readme_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    return [b.strip() for b in blocks]


def _ci_lines() -> list[str]:
    return [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]


def test_readme_test_command_makes_a_venv_then_installs_and_tests():
    command = _readme_commands()[0]
    assert command.startswith(README_VENV), command
    steps = [shlex.split(step) for step in command[len(README_VENV):].split("&&")]
    assert steps[0] == ["python3", "-m", "pip", "install", "torch==2.13.0"]
    assert ["python3", "-m", "pip", "install", "-e", ".[test]"] in steps
    assert steps[-1] == ["python3", "-m", "pytest", "-q"]


def test_ci_runs_the_readme_test_command_in_a_fresh_venv():
    test_command = _readme_commands()[0][len(README_VENV):]
    lines = _ci_lines()
    assert test_command in lines, "the README's test command is not a line of .ci/run"
    venv = [i for i, line in enumerate(lines) if line.startswith("python3 -m venv ") and "bin/activate" in line]
    assert venv and venv[0] < lines.index(test_command), "CI must create and activate a venv before the command"
    made = lines[venv[0]].split()[3]
    assert "mktemp -d" in "\n".join(lines[:venv[0]]) and made.startswith('"$venv_dir'), made


def test_ci_takes_torch_from_the_package_registry_only():
    # CI reaches only the package registries: no extra index, no URL
    text = (ROOT / ".ci" / "run").read_text()
    assert "--index-url" not in text and "--extra-index-url" not in text and "https://" not in text


def test_readme_says_how_to_get_the_cpu_build_elsewhere():
    readme = (ROOT / "README.md").read_text()
    assert "--index-url https://download.pytorch.org/whl/cpu" in readme


def test_readme_main_job_is_the_explain_cli():
    assert _readme_commands()[1] == "python3 -m workspace_manager explain"
    assert "workspace-manager" in (ROOT / "README.md").read_text()
