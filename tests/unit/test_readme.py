"""The README as a newcomer reads it: what it is and the two commands on the
first screen, every code block runs as written, links where it names an
issue or a decision, and a policy table made of the policies' own summaries.

Python blocks that need no TE run here, each in a fresh interpreter; blocks
that import TE run in the ``gpu`` test at the end, which skips with a reason
where CUDA or TE is missing. The install command is the one CI runs
(``tests/unit/test_readme_ci.py``).
"""

from __future__ import annotations

import functools
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from workspace_manager._summary import POLICY_SUMMARIES

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
FENCE = re.compile(r"^```(\w*)\n(.*?)^```[ \t]*$", re.S | re.M)
#: Imports that make a block need TE and a GPU.
NEEDS_TE = re.compile(r"^\s*(import|from)\s+(transformer_engine|te_integration)\b", re.M)


def _blocks() -> list[tuple[str, str, int]]:
    """(language, code, line number of the opening fence) of each fenced block."""
    return [(m.group(1), m.group(2), README[:m.start()].count("\n") + 1) for m in FENCE.finditer(README)]


def _python(needs_te: bool) -> list[tuple[str, int]]:
    return [(code, line) for lang, code, line in _blocks()
            if lang == "python" and bool(NEEDS_TE.search(code)) == needs_te]


@functools.cache
def _run_python(code: str, line: int) -> str:
    """The block's output (run once per session: the kit's block is read by two tests)."""
    result = subprocess.run([sys.executable, "-W", "error::DeprecationWarning:workspace_manager", "-c", code],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, f"README.md block at line {line} failed:\n{result.stderr}"
    return result.stdout


def test_the_first_screen_says_what_it_is_then_the_two_commands():
    lines = README.splitlines()
    first = next(i for i, l in enumerate(lines) if l.startswith("```bash")) + 1
    assert first < 40, f"the first command is on line {first + 1}"
    intro = "\n".join(lines[1:first]).split("\n## ")[0]
    assert "TransformerEngine" in intro and "workspace" in intro and len(intro.split()) <= 120
    assert lines[first + 1:].index("python3 -m workspace_manager explain") < 10


def test_every_block_is_tagged_and_of_a_kind_that_a_test_runs():
    blocks = _blocks()
    assert {lang for lang, _, _ in blocks} <= {"bash", "python"}, [b[0] for b in blocks]
    bash = [code.strip() for lang, code, _ in blocks if lang == "bash"]
    # the first is the install command (CI runs it); the others are the CLI, run below
    assert bash[0].startswith("python3 -m venv .venv") and all(
        b.startswith("python3 -m workspace_manager ") for b in bash[1:])
    assert _python(needs_te=False) and _python(needs_te=True)


@pytest.mark.parametrize("command", [c.strip() for lang, c, _ in _blocks() if lang == "bash"][1:])
def test_the_cli_blocks_run(command):
    argv = shlex.split(command)
    result = subprocess.run([sys.executable, *argv[1:]], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("== policy: plain ==")


@pytest.mark.parametrize("code,line", _python(needs_te=False), ids=lambda v: str(v) if isinstance(v, int) else "")
def test_the_python_blocks_without_te_run_and_print_what_their_comments_say(code, line):
    out = _run_python(code, line).splitlines()
    # `print(x.summary())  # cache=... ...`: the comment up to " ..." is the start of what it prints
    said = [m.group(1).split(" ...")[0] for m in re.finditer(r"^print\(\w+\.summary\(\)\)\s+# (cache=.*)$", code, re.M)]
    summaries = [l for l in out if l.startswith("cache=")]
    assert len(summaries) == len(said)
    for expected, got in zip(said, summaries):
        assert got.startswith(expected), (expected, got)


def test_the_kit_block_checks_the_reference_quantizer_as_shown():
    (code, line), = [(c, n) for c, n in _python(needs_te=False) if "check_quantizer" in c]
    out = _run_python(code, line)
    assert "check_quantizer(workspace_manager.testing.reference.Float8PerTensorQuantizer): all " in out
    assert "checks passed" in out


def test_the_policy_table_is_the_policies_own_summaries():
    rows = [l for l in README.splitlines() if l.startswith("| `")]
    assert rows == [s.markdown_row() for s in POLICY_SUMMARIES.values()]
    assert max(len(r) for r in rows) <= 330


def test_issue_numbers_and_decision_codes_are_links():
    text = FENCE.sub("", README)
    for match in re.finditer(r"TE#(\d+)", text):
        after = text[match.end():match.end() + 70]
        assert after.startswith(f"](https://github.com/NVIDIA/TransformerEngine/issues/{match.group(1)})") or \
            after.startswith(f"](https://github.com/NVIDIA/TransformerEngine/pull/{match.group(1)})"), after
    anchors = {"-".join(h.lower().split()) for h in re.findall(r"^## (.+)$", (ROOT / "docs/decisions.md").read_text(),
                                                               re.M)}
    codes = list(re.finditer(r"\bD(\d+)\b", text))
    for match in codes:
        link = re.match(r"\]\(docs/decisions\.md#([\w-]+)\)", text[match.end():])
        assert link and link.group(1) in anchors, text[match.start() - 40:match.end() + 60]
    assert codes, "the policy table links the options' decisions"


def test_prose_wraps_and_the_layout_section_stays_near_the_end():
    inside = False
    for number, line in enumerate(README.splitlines(), 1):
        inside ^= line.startswith("```")
        if inside or line.startswith(("|", "```")) or "](" in line or "https://" in line:
            continue
        assert len(line) <= 100, f"README.md line {number}: {len(line)} characters"
    headings = re.findall(r"^## (.+)$", README, re.M)
    assert "Layout" in headings[-2:]


@pytest.mark.gpu
@pytest.mark.parametrize("code,line", _python(needs_te=True), ids=lambda v: str(v) if isinstance(v, int) else "")
def test_the_te_blocks_run_on_a_gpu(code, line):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("CUDA is not available")
    try:
        import te_integration  # noqa: F401
        from transformer_engine.pytorch import quantization
    except ImportError as err:
        pytest.skip(f"TransformerEngine 2.20 is not usable here: {err}")
    supported, reason = quantization.check_fp8_support()
    if not supported:
        pytest.skip(f"FP8 is not supported on this GPU: {reason}")
    out = _run_python(code, line)
    assert "weight" in out
