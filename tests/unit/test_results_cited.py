"""The documentation cites benchmark results where they are: each
benchmark's one current result, ``benchmarks/results/<benchmark>/``, which
its next run replaces (git history keeps the older runs).

- No link or path names a run by its date or round, and every one resolves
  to a file or folder in the tree; a figure kept from an older run is cited
  by commit (``<commit>:benchmarks/results/...``, read with ``git show``),
  which this check leaves alone.
- ``benchmarks/results/README.md`` lists every current result, and each is
  a benchmark of ``benchmarks/`` or the GPU test tier (``gpu_tests``,
  ``te_suite``).
- The figures of a table row that links a result, in the README and in the
  results index, come from the result files it links: each measured figure
  (a decimal, or a number with a unit) is found there to the digits
  written.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
#: Current results that are tests, not benchmarks.
TEST_TIERS = ("gpu_tests", "te_suite")
#: A run named by its date or its round.
DATED = re.compile(r"\d{4}-\d{2}-\d{2}|^round\d|^bench-|^gpu-tests-|^sharded-params-")
LINK = re.compile(r"\]\(([^)\s]+)\)")
#: A path into the results written out; one preceded by ``<commit>:`` is read from git history.
PATH = re.compile(r"(?<![\w/.:-])(benchmarks/results(?:/[\w.#-]*)*)")
FIGURE = re.compile(r"(?<![\w.])((?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?)(?:\s*(MiB|GiB|KiB|ms|us|µs|ns)\b|\s*(%))?")
NUMBER = re.compile(r"\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def citing_files(root: Path = ROOT) -> list[Path]:
    """The repository's text that may cite results: its Markdown (of the
    results, only the READMEs: a result's own summary cites nothing) and its
    Python sources, this test's examples left out."""
    results = root / "benchmarks" / "results"
    docs = [root / "README.md", *sorted((root / "docs").glob("*.md")), *sorted((root / "benchmarks").rglob("*.md")),
            *sorted((root / "tests").rglob("*.md"))]
    docs = [p for p in docs if p.is_file() and (not p.is_relative_to(results) or p.name == "README.md")]
    code = [p for folder in ("benchmarks", "tests", "testbed", "te_integration", "workspace_manager", "examples")
            for p in sorted((root / folder).rglob("*.py")) if p != Path(__file__).resolve()]
    return docs + code


def cited(path: Path, root: Path = ROOT) -> list[tuple[str, Path]]:
    """(as written, resolved) for each citation of a result in ``path``:
    Markdown links that resolve under the results, and written-out paths."""
    text = path.read_text()
    found = []
    if path.suffix == ".md":
        for target in LINK.findall(text):
            if "://" in target or target.startswith("#"):
                continue
            resolved = (path.parent / target.split("#")[0]).resolve()
            if resolved.is_relative_to((root / "benchmarks" / "results").resolve()):
                found.append((target, resolved))
    for written in PATH.findall(text):
        found.append((written, root / written.split("#")[0].rstrip(".")))
    seen: set[Path] = set()  # a Markdown link written as a path is found both ways
    return [(w, p) for w, p in found if not (p.resolve() in seen or seen.add(p.resolve()))]


def bad_citations(root: Path = ROOT) -> list[str]:
    results = (root / "benchmarks" / "results").resolve()
    bad = []
    for path in citing_files(root):
        for written, resolved in cited(path, root):
            parts = resolved.resolve().relative_to(results).parts if resolved.resolve().is_relative_to(results) else ()
            where = f"{path.relative_to(root)}: {written}"
            if any(DATED.search(part) for part in parts):
                bad.append(f"{where} (a dated run: cite the current result)")
            elif not resolved.exists():
                bad.append(f"{where} (not in the tree)")
            elif "#" in written and resolved.suffix == ".md" and written.split("#")[1] not in anchors(resolved):
                bad.append(f"{where} (no such section)")
    return bad


def anchors(page: Path) -> set[str]:
    """The anchors of a Markdown page's headings, as GitHub makes them."""
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.+)$", page.read_text(), re.M)}


def test_no_document_cites_a_dated_run_or_a_result_that_is_not_there():
    assert (RESULTS / "README.md").is_file()
    assert bad_citations() == []


def test_a_citation_of_a_dated_run_or_a_missing_file_is_found(tmp_path):
    (tmp_path / "benchmarks" / "results" / "step_time").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results" / "step_time" / "step_time.md").write_text("x")
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(
        "[ok](benchmarks/results/step_time/step_time.md) [old](benchmarks/results/round7-2026-12-01/README.md)\n"
        "`abc1234:benchmarks/results/round2-2026-12-01/README.md` (from git history: not checked)\n")
    (tmp_path / "docs" / "a.md").write_text("see `benchmarks/results/step_time/gone.md`.\n")
    (tmp_path / "benchmarks" / "results" / "README.md").write_text(
        "# Results\n\n## Step time\n\n[here](step_time/step_time.md), [x](soak/), [a](#step-time), [b](README.md#gone)\n")
    assert bad_citations(tmp_path) == [
        "README.md: benchmarks/results/round7-2026-12-01/README.md (a dated run: cite the current result)",
        "docs/a.md: benchmarks/results/step_time/gone.md (not in the tree)",
        "benchmarks/results/README.md: soak/ (not in the tree)",
        "benchmarks/results/README.md: README.md#gone (no such section)",
    ]


def test_the_index_lists_every_current_result_and_each_is_a_benchmark_or_a_test_tier():
    index = (RESULTS / "README.md").read_text()
    linked = {Path(target).parts[0] for target in LINK.findall(index) if "://" not in target}
    folders = {p.name for p in RESULTS.iterdir() if p.is_dir()}
    assert folders and folders <= linked, sorted(folders - linked)
    unknown = [f for f in folders if f not in TEST_TIERS and not (ROOT / "benchmarks" / f"{f}.py").is_file()]
    assert unknown == []


# -- figures ---------------------------------------------------------------------------------------

def figures(row: str) -> list[str]:
    """The measured figures of a table row as written: decimals and numbers
    with a unit, outside code spans and link targets (``1.0366``, ``192 MiB``,
    ``12,860 MiB``, ``1.3%``; not ``4 microbatches`` or
    ``TransformerLayer(4096, 16384)``)."""
    text = LINK.sub("]", re.sub(r"`[^`]*`", "", row))
    return [number + (f" {unit}" if unit else percent) for number, unit, percent in FIGURE.findall(text)
            if "." in number or unit or percent]


def found_in(figure: str, numbers: list[float]) -> bool:
    """Whether one of ``numbers`` rounds to ``figure`` at the digits it is written with."""
    number = figure.split()[0].rstrip("%").replace(",", "")
    value, digits = float(number), len(number.partition(".")[2])
    return any(abs(round(n, digits) - value) < 10 ** -(digits + 3) for n in numbers)


def unsupported_figures(page: Path, root: Path = ROOT) -> list[str]:
    """``figure (row's first cell)`` for each figure of a row of ``page``
    that links results but is not in the files it links."""
    missing = []
    for row in page.read_text().splitlines():
        if not row.startswith("|"):
            continue
        files = [p for _, p in cited_in_row(page, row, root)]
        if not files:
            continue
        numbers = [float(n) for f in files for n in NUMBER.findall(f.read_text(errors="replace"))]
        name = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", row.split("|")[1]).strip()
        missing += [f"{fig} ({name})" for fig in figures(row) if not found_in(fig, numbers)]
    return missing


def cited_in_row(page: Path, row: str, root: Path) -> list[tuple[str, Path]]:
    """The result files a row links: a linked folder stands for its Markdown and text files."""
    results = (root / "benchmarks" / "results").resolve()
    out = []
    for target in LINK.findall(row):
        path = (page.parent / target.split("#")[0]).resolve()
        if path.is_relative_to(results) and path.exists():
            out += [(target, p) for p in ([path] if path.is_file() else sorted(path.rglob("*.md")))]
    return out


def test_the_readme_and_the_index_state_only_figures_their_linked_results_hold():
    for page in (ROOT / "README.md", RESULTS / "README.md"):
        assert unsupported_figures(page) == [], page.relative_to(ROOT)
    # Not vacuous: the index's rows link results and state figures.
    rows = [r for r in (RESULTS / "README.md").read_text().splitlines() if r.startswith("|") and figures(r)]
    assert len(rows) > 10 and all(cited_in_row(RESULTS / "README.md", r, ROOT) for r in rows[:5])


def test_a_figure_the_linked_result_does_not_hold_is_found(tmp_path):
    folder = tmp_path / "benchmarks" / "results" / "moe_step"
    folder.mkdir(parents=True)
    (folder / "moe_step.md").write_text("| a | 1.0366 | 1.431e+04 | 550.9 | 6 weights, 1.31% |\n")
    page = tmp_path / "README.md"
    page.write_text("| what | figures |\n|---|---|\n"
                    "| [moe](benchmarks/results/moe_step/moe_step.md) | 1.037 and 1.0366, 14,310 MiB, 551 MiB, 1.3% "
                    "on `TransformerLayer(4096, 16384)` x 4 microbatches |\n"
                    "| [moe](benchmarks/results/moe_step/moe_step.md) | 1.04 but 1.0367, 14,300 MiB, 1.4% |\n"
                    "| no link | 9.99 |\n")
    assert unsupported_figures(page, tmp_path) == ["1.0367 (moe)", "14,300 MiB (moe)", "1.4% (moe)"]
