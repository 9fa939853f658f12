"""The comparison half of ``tests.te_suite``: per-test outcomes from
JUnit XML, stock against drop-in, and the summary. Pure Python (no torch,
no TE); ``tests/te_suite/test_te_suite.py`` covers it on synthetic files.
"""

from __future__ import annotations

import enum
import json
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "Outcome", "CaseResult", "case_id", "case_id_of_node", "RunStatus", "Variant", "Run", "Difference",
    "Comparison", "Verdict",
    "parse_junit", "merge_ranks", "read_runs_junit", "compare", "reasons", "render_summary", "comparison_json",
    "write_outcomes",
]

#: What pytest's JUnit writer puts in ``<skipped message=...>`` for a
#: non-strict xfail test that passed.
XPASS_MESSAGE = "xfail-marked test passes unexpectedly"
#: Examples kept per skip reason in comparison.json and summary.md.
EXAMPLES = 20


class Outcome(str, enum.Enum):
    PASSED = "passed"
    FAILED = "failed"
    ERROR = "error"
    SKIPPED = "skipped"
    XFAILED = "xfailed"
    XPASSED = "xpassed"


#: When one test has several outcomes (ranks of a torchrun, or a repeated
#: id), the first of these wins: a failure anywhere is a failure.
_PRECEDENCE = (Outcome.FAILED, Outcome.ERROR, Outcome.XPASSED, Outcome.PASSED, Outcome.XFAILED, Outcome.SKIPPED)


class Variant(str, enum.Enum):
    STOCK = "stock"
    DROPIN = "dropin"


class RunStatus(str, enum.Enum):
    COMPLETED = "completed"
    TIMED_OUT = "timed out"
    CRASHED = "crashed"
    NOT_RUN = "not run"


class Verdict(enum.Enum):
    """The answer, and the exit status of ``tests.te_suite``."""

    IDENTICAL = 0  # every test ran in both variants with the same outcome
    DIFFERENT = 1  # some test's outcome differs, or it ran in one variant only
    INCOMPLETE = 3  # no difference among what ran, but not everything ran, or the swap is unproven


@dataclass(frozen=True)
class CaseResult:
    outcome: Outcome
    message: str = ""  # skip or xfail reason, or the failure's first line
    seconds: float = 0.0


def _first(outcomes: Iterable[CaseResult]) -> CaseResult:
    return min(outcomes, key=lambda r: _PRECEDENCE.index(r.outcome))


def _case_result(case: ET.Element) -> CaseResult:
    children = {child.tag: child for child in case if child.tag in ("failure", "error", "skipped")}
    seconds = float(case.get("time") or 0.0)
    for tag, outcome in (("failure", Outcome.FAILED), ("error", Outcome.ERROR)):
        if tag in children:
            return CaseResult(outcome, (children[tag].get("message") or "").strip(), seconds)
    skipped = children.get("skipped")
    if skipped is None:
        return CaseResult(Outcome.PASSED, "", seconds)
    message = (skipped.get("message") or "").strip()
    if skipped.get("type") == "pytest.xfail":
        return CaseResult(Outcome.XFAILED, message, seconds)
    if message == XPASS_MESSAGE:
        return CaseResult(Outcome.XPASSED, message, seconds)
    return CaseResult(Outcome.SKIPPED, message, seconds)


def case_id(case: ET.Element) -> str:
    """``classname::name``, e.g. ``test_numerics::test_linear_accuracy[...]``."""
    classname, name = case.get("classname") or "", case.get("name") or ""
    return f"{classname}::{name}" if classname else name


def case_id_of_node(nodeid: str) -> str:
    """The :func:`case_id` pytest's JUnit writer gives the test ``nodeid``
    (``dir/test_x.py::Class::test_y[p]`` -> ``dir.test_x.Class::test_y[p]``)."""
    path, bracket, params = nodeid.partition("[")
    names = path.split("::")
    names[0] = names[0].replace("/", ".").removesuffix(".py")
    names[-1] += bracket + params
    return "::".join(filter(None, (".".join(names[:-1]), names[-1])))


def parse_junit(path: Path) -> dict[str, CaseResult]:
    """Test id -> result for every ``<testcase>`` in a pytest JUnit file
    (``<testsuites>`` or a bare ``<testsuite>`` root). ValueError if the
    file is not JUnit XML."""
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as err:
        raise ValueError(f"{path} is not valid XML: {err}") from err
    if root.tag not in ("testsuites", "testsuite"):
        raise ValueError(f"{path} is not JUnit XML (its root is <{root.tag}>)")
    grouped: dict[str, list[CaseResult]] = defaultdict(list)
    for case in root.iter("testcase"):
        if case.get("name"):  # an interrupted run can leave an empty <testcase/>
            grouped[case_id(case)].append(_case_result(case))
    return {tid: _first(results) for tid, results in grouped.items()}


def merge_ranks(per_rank: Sequence[Mapping[str, CaseResult]]) -> dict[str, CaseResult]:
    """One outcome per test over the ranks of a torchrun: any failing rank fails it."""
    grouped: dict[str, list[CaseResult]] = defaultdict(list)
    for results in per_rank:
        for tid, result in results.items():
            grouped[tid].append(result)
    return {tid: _first(results) for tid, results in grouped.items()}


def read_runs_junit(folder: Path) -> tuple[dict[str, CaseResult], int]:
    """The merged results of every ``junit*.xml`` in ``folder`` and how many files there were."""
    files = sorted(folder.glob("junit*.xml"))
    return merge_ranks([parse_junit(f) for f in files]), len(files)


@dataclass(frozen=True)
class Run:
    """One pytest process (its ranks merged) of one variant over one group of test files."""

    group: str
    variant: Variant
    status: RunStatus
    selection: str = ""  # the -k expression; empty: every test of the group
    results: Mapping[str, CaseResult] = field(default_factory=dict)
    seconds: float = 0.0
    returncode: int | None = None
    #: The test that was running when a run that did not complete stopped;
    #: its outcome, if any, is not trusted and is left out of ``results``.
    interrupted: str | None = None
    #: What the plugin wrote (rank 0's record), None if it wrote nothing.
    record: Mapping[str, Any] | None = None
    note: str = ""


@dataclass(frozen=True)
class Difference:
    group: str
    test: str
    stock: CaseResult | None  # None: the test did not run in that variant
    dropin: CaseResult | None


@dataclass(frozen=True)
class Comparison:
    pairs: tuple[tuple[Run, Run], ...]
    differences: tuple[Difference, ...]
    #: Tests that ran in one variant while the other's run did not complete.
    unmatched: tuple[Difference, ...]
    problems: tuple[str, ...]

    @property
    def verdict(self) -> Verdict:
        if self.differences:
            return Verdict.DIFFERENT
        if self.problems or self.unmatched:
            return Verdict.INCOMPLETE
        return Verdict.IDENTICAL

    def totals(self, variant: Variant) -> dict[str, int]:
        counts: Counter = Counter()
        for pair in self.pairs:
            run = pair[0] if variant is Variant.STOCK else pair[1]
            counts.update(r.outcome.value for r in run.results.values())
        return {o.value: counts.get(o.value, 0) for o in Outcome}


def _swap_problem(run: Run) -> str | None:
    """Why the drop-in run does not prove the drop-ins ran, or None."""
    record = run.record
    if record is None:
        return f"{run.group}: the drop-in run left no record of the swap"
    if record.get("error"):
        return f"{run.group}: the swap failed: {record['error']}"
    if not record.get("rebound"):
        return f"{run.group}: the drop-in run's record shows no name rebound"
    missing = sorted(set(record.get("swap") or []) - {r["name"] for r in record["rebound"]})
    if missing:
        return f"{run.group}: the drop-in run's record shows {', '.join(missing)} not rebound"
    return None


def _pair_problems(stock: Run, dropin: Run) -> list[str]:
    problems = [f"{run.group} ({run.variant.value}): {run.status.value}"
                + (f", stopped in {run.interrupted}" if run.interrupted else "")
                + (f" ({run.note})" if run.note else "")
                for run in (stock, dropin) if run.status is not RunStatus.COMPLETED]
    if dropin.status is not RunStatus.NOT_RUN and (why := _swap_problem(dropin)):
        problems.append(why)
    return problems


def compare(pairs: Sequence[tuple[Run, Run]]) -> Comparison:
    """Stock against drop-in, pair by pair (each pair: the same tests)."""
    differences, unmatched, problems = [], [], []
    for stock, dropin in pairs:
        problems += _pair_problems(stock, dropin)
        for tid in sorted(set(stock.results) | set(dropin.results)):
            s, d = stock.results.get(tid), dropin.results.get(tid)
            if s is not None and d is not None:
                if s.outcome is not d.outcome:
                    differences.append(Difference(stock.group, tid, s, d))
                continue
            missing_in = dropin if d is None else stock
            target = differences if missing_in.status is RunStatus.COMPLETED else unmatched
            target.append(Difference(stock.group, tid, s, d))
    if not any(run.results for pair in pairs for run in pair):
        problems.append("no test ran in either variant")
    return Comparison(tuple(pairs), tuple(differences), tuple(unmatched), tuple(problems))


# -- skips, xfails and failures by reason -------------------------------------------------
#: Outcomes grouped by reason: a failure's reason is the first line of its message.
_GROUPED = (Outcome.SKIPPED, Outcome.XFAILED, Outcome.FAILED, Outcome.ERROR)
#: A failure's reason is cut here (messages may carry values that differ per test).
REASON_CHARS = 200


def reasons(comparison: Comparison) -> list[dict[str, Any]]:
    """Skipped, xfailed, failed and errored tests grouped by (kind,
    reason): counts per variant and up to :data:`EXAMPLES` test ids, most
    frequent first. A failure shared by both variants is TE's own on the
    machine; this says what it was."""
    table: dict[tuple[str, str], dict[str, Any]] = {}
    for pair in comparison.pairs:
        for run in pair:
            for tid, result in sorted(run.results.items()):
                if result.outcome not in _GROUPED:
                    continue
                reason = result.message
                if result.outcome in (Outcome.FAILED, Outcome.ERROR):
                    reason = reason.splitlines()[0][:REASON_CHARS] if reason else ""
                key = (result.outcome.value, reason)
                row = table.setdefault(key, {"kind": key[0], "reason": key[1], "stock": 0, "dropin": 0,
                                             "examples": []})
                row[run.variant.value] += 1
                if len(row["examples"]) < EXAMPLES and tid not in row["examples"]:
                    row["examples"].append(tid)
    return sorted(table.values(), key=lambda r: (-(r["stock"] + r["dropin"]), r["kind"], r["reason"]))


# -- output ---------------------------------------------------------------------------
_MEANING = (
    "**Identical** means: every selected test ran under both variants, in separate pytest processes "
    "on the same machine, and ended with the same outcome (passed, failed, error, skipped, xfailed or "
    "xpassed); no test ran under one variant only; and the drop-in run's record shows every name it "
    "swaps (TE's `Linear`, `LayerNormLinear`, `LayerNormMLP` and `GroupedLinear` unless `--swap` names "
    "fewer) rebound to the drop-ins before any test module was imported, "
    "and no collected test module holding a stock class. A failure that stock shares is not a "
    "difference: it is TE's own result on this machine.")
_OUTCOME_COLUMNS = tuple(o.value for o in Outcome)


def _counts(results: Mapping[str, CaseResult]) -> str:
    counts = Counter(r.outcome.value for r in results.values())
    return " / ".join(str(counts.get(name, 0)) for name in _OUTCOME_COLUMNS)


def _status_text(run: Run) -> str:
    text = run.status.value if run.status is not RunStatus.COMPLETED else f"{run.seconds:.0f} s"
    if run.status in (RunStatus.TIMED_OUT, RunStatus.CRASHED):
        text += f" after {run.seconds:.0f} s"
    return text


def _result_text(result: CaseResult | None) -> str:
    if result is None:
        return "(not run)"
    return result.outcome.value + (f": {result.message[:160]}" if result.message else "")


def _table(columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    def cell(value: Any) -> str:
        return str(value).replace("|", "\\|").replace("\n", " ")

    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns),
            *["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]]


def _swap_lines(comparison: Comparison) -> list[str]:
    records = [(pair[1].group, pair[1].record) for pair in comparison.pairs if pair[1].record]
    if not records:
        return ["No drop-in run left a record of the swap."]
    rebound = next((r["rebound"] for _, r in records if r.get("rebound")), [])
    lines = [f"The drop-in runs rebound {len(rebound)} names before collection:", ""]
    lines += _table(("name", "was", "is"), ((f"{r['module']}.{r['name']}", r["before"], r["after"]) for r in rebound))
    lines += ["", "Per group: test modules holding each drop-in after collection, and drop-ins the tests built:", ""]
    rows = []
    for group, record in records:
        modules = record.get("test_modules") or {}
        built = record.get("constructed") or {}
        rows.append((group, modules.get("checked", "-"), _named(modules.get("bound", {})), _named(built)))
    return lines + _table(("group", "test modules", "bound", "constructed"), rows)


def _named(counts: Mapping[str, int]) -> str:
    return ", ".join(f"{name} {n}" for name, n in sorted(counts.items())) or "none"


def _runs_table(comparison: Comparison) -> list[str]:
    rows = [(stock.group, f"`{stock.selection}`" if stock.selection else "all", _status_text(stock),
             _counts(stock.results), _status_text(dropin), _counts(dropin.results),
             sum(1 for d in comparison.differences if d.group == stock.group))
            for stock, dropin in comparison.pairs]
    return _table(("group", "-k", "stock", "stock p/f/e/s/xf/xp", "drop-in", "drop-in p/f/e/s/xf/xp",
                   "differences"), rows)


def _difference_lines(title: str, items: Sequence[Difference]) -> list[str]:
    if not items:
        return []
    rows = ((d.group, d.test, _result_text(d.stock), _result_text(d.dropin)) for d in items)
    return ["", f"## {title} ({len(items)})", "", *_table(("group", "test", "stock", "drop-in"), rows)]


def _reason_lines(comparison: Comparison) -> list[str]:
    rows = reasons(comparison)
    if not rows:
        return []
    lines = ["", "## Skipped, xfailed and failed, by reason", "",
             "Counts per variant; the first example of each (comparison.json lists up to "
             f"{EXAMPLES}).", ""]
    return lines + _table(("kind", "reason", "stock", "drop-in", "example"),
                          ((r["kind"], r["reason"] or "(none given)", r["stock"], r["dropin"], r["examples"][0])
                           for r in rows))


def render_summary(comparison: Comparison, meta: Mapping[str, Any]) -> str:
    """summary.md: verdict, environment, swap, per-group counts, every
    difference, what did not complete, and skips grouped by reason."""
    verdict = comparison.verdict
    stock, dropin = comparison.totals(Variant.STOCK), comparison.totals(Variant.DROPIN)
    env = meta.get("environment", {})
    lines = [
        "# TE's own module tests: stock against the drop-ins", "",
        f"**Verdict: {verdict.name}**. Tests whose outcome differs: {len(comparison.differences)}; "
        f"run in one variant while the other's run did not complete: {len(comparison.unmatched)}; "
        f"runs not complete or swaps not proven: {len(comparison.problems)}.", "",
        f"- command: `{meta.get('command', '')}`",
        f"- TransformerEngine {env.get('te') or '?'}, torch {env.get('torch') or '?'}, "
        f"GPUs: {', '.join(env.get('gpus') or []) or 'none'}, commit {env.get('commit', '?')}",
        f"- test files: {meta.get('tests_fingerprint', '?')}", "",
        _MEANING, "",
        "## Totals", "",
        *_table(("variant", *_OUTCOME_COLUMNS), [("stock", *stock.values()), ("drop-in", *dropin.values())]),
        "", "## Per group", "", *_runs_table(comparison),
    ]
    lines += _difference_lines("Differences", comparison.differences)
    if comparison.problems:
        lines += ["", "## Not complete", "", *[f"- {p}" for p in comparison.problems]]
    lines += _difference_lines("Run in one variant only (the other did not complete)", comparison.unmatched)
    lines += ["", "## The swap", "", *_swap_lines(comparison)]
    lines += _reason_lines(comparison)
    return "\n".join(lines) + "\n"


def _run_json(run: Run) -> dict[str, Any]:
    return {"group": run.group, "variant": run.variant.value, "selection": run.selection,
            "status": run.status.value, "seconds": round(run.seconds, 1), "returncode": run.returncode,
            "interrupted": run.interrupted, "note": run.note, "record": run.record,
            "counts": dict(Counter(r.outcome.value for r in run.results.values())),
            "test_seconds": round(sum(r.seconds for r in run.results.values()), 1)}


def _difference_json(d: Difference) -> dict[str, Any]:
    def side(result: CaseResult | None) -> dict[str, Any] | None:
        return None if result is None else {"outcome": result.outcome.value, "message": result.message}

    return {"group": d.group, "test": d.test, "stock": side(d.stock), "dropin": side(d.dropin)}


def comparison_json(comparison: Comparison, meta: Mapping[str, Any]) -> dict[str, Any]:
    """comparison.json: everything in the summary, with up to
    :data:`EXAMPLES` test ids per skip reason."""
    return {
        "schema": "te-wm-te-suite/1", **meta,
        "verdict": comparison.verdict.name, "exit_status": comparison.verdict.value,
        "totals": {"stock": comparison.totals(Variant.STOCK), "dropin": comparison.totals(Variant.DROPIN)},
        "runs": [_run_json(run) for pair in comparison.pairs for run in pair],
        "differences": [_difference_json(d) for d in comparison.differences],
        "unmatched": [_difference_json(d) for d in comparison.unmatched],
        "problems": list(comparison.problems),
        "skip_reasons": reasons(comparison),
    }


def write_outcomes(comparison: Comparison, path: Path) -> None:
    """Every test's outcome in both variants, one JSON object a line (large; not for committing)."""
    with open(path, "w") as f:
        for stock, dropin in comparison.pairs:
            for tid in sorted(set(stock.results) | set(dropin.results)):
                s, d = stock.results.get(tid), dropin.results.get(tid)
                f.write(json.dumps({"group": stock.group, "test": tid,
                                    "stock": s.outcome.value if s else None,
                                    "dropin": d.outcome.value if d else None}) + "\n")
