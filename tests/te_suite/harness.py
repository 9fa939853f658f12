"""TransformerEngine's own PyTorch tests, stock against the drop-ins.

    python3 -m tests.te_suite --tests-dir DIR --out OUT [--quick | --grouped] [--files PATH ...] [-k EXPR]

``DIR`` is a folder of TE's ``tests/pytorch`` files (TE's, not part of this
repository). Each selected file runs twice, each time in its own pytest
process on a fresh copy of ``DIR``: once on stock TE, once with
``te.Linear``, ``te.LayerNormLinear``, ``te.LayerNormMLP`` and
``te.GroupedLinear`` replaced by ``te_integration``'s drop-ins
(``tests.te_suite.plugin`` swaps them before any test module is imported;
``--swap`` names fewer). The FSDP2 suite runs under torchrun on
the GPUs present (at most 2). The per-test outcomes, read from JUnit XML, are
compared; ``OUT/summary.md`` and ``OUT/comparison.json`` say what differs,
what did not complete, and why tests were skipped.

Exit status: 0 identical, 1 some outcome differs, 2 usage error, 3 no
difference among what ran but something did not complete (timeout, crash,
time budget) or the swap is not proven. Needs CUDA and TE to mean anything;
``--help`` and ``--dry-run`` work without either.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from testbed.dist import SAFE_ENV
from testbed.record import REPO_ROOT, capture_env, jsonable

from .report import (
    Comparison,
    Run,
    RunStatus,
    Variant,
    case_id_of_node,
    comparison_json,
    compare,
    read_runs_junit,
    render_summary,
    write_outcomes,
)
from .selection import FULL, GROUPED, OPS, QUICK, Entry, Launcher, entries_for

__all__ = ["Launcher", "Entry", "FULL", "GROUPED", "OPS", "QUICK", "Plan", "main", "build_parser", "plan_from_args",
           "pytest_command", "collect_run"]

PLUGIN = "tests.te_suite.plugin"
#: The copy's folder name, as in TE's own layout (tests/pytorch).
COPY_NAME = "pytorch"
#: After a per-file timeout: pytest gets SIGINT (it then writes its JUnit
#: file with what finished) and this long to exit before SIGKILL.
GRACE_S = 30.0
#: A file is not started with less time than this left in --max-minutes.
MIN_START_S = 20.0
DEFAULT_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class Plan:
    """What one invocation runs."""

    tests_dir: Path
    entries: tuple[Entry, ...]
    out: Path
    timeout_s: float
    budget_s: float | None
    nproc: int | None  # torchrun ranks; None: the GPUs present, at most 2
    dropins: str
    swap: str | None = None  # names the drop-in variant swaps; None: the plugin's default, all
    #: Run each file's two variants at the same time (correctness suites on
    #: one GPU with room for both; not for timings).
    parallel: bool = False


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python3 -m tests.te_suite", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tests-dir", type=Path, required=True, metavar="DIR",
                   help="folder holding TE's tests/pytorch files (test_sanity.py, ..., fsdp2/)")
    p.add_argument("--out", type=Path, required=True, metavar="OUT",
                   help="folder for summary.md, comparison.json and the logs")
    tables = p.add_mutually_exclusive_group()
    tables.add_argument("--quick", action="store_true",
                        help="the smaller selection (QUICK in tests/te_suite/selection.py)")
    tables.add_argument("--grouped", action="store_true",
                        help="the GroupedLinear tests (GROUPED in tests/te_suite/selection.py): "
                             "test_grouped_linear.py, test_sanity.py -k grouped, and two more files' grouped cases")
    tables.add_argument("--ops", action="store_true",
                        help="TE's fusible-ops files, te.ops's linear ops swapped too (OPS in "
                             "tests/te_suite/selection.py)")
    p.add_argument("--files", nargs="+", metavar="PATH",
                   help="run only these (relative to DIR); a file of the table keeps its -k selection")
    p.add_argument("-k", dest="select", default=None, metavar="EXPR",
                   help="pytest -k expression for every chosen file, instead of the table's")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                   help=f"per file and variant (default {DEFAULT_TIMEOUT_S:.0f})")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="stop starting files after this long; what is left is reported as not run")
    p.add_argument("--nproc", type=int, default=None, help="ranks for the FSDP2 suite (default: GPUs present, max 2)")
    p.add_argument("--dropins", default="te_integration",
                   help="module whose Linear, LayerNormLinear, LayerNormMLP and GroupedLinear replace TE's "
                        "(default te_integration)")
    p.add_argument("--swap", default=None, metavar="NAMES",
                   help="comma-separated names the drop-in runs swap, from Linear, LayerNormLinear, LayerNormMLP, "
                        "GroupedLinear (default: all four)")
    p.add_argument("--parallel", action="store_true",
                   help="run each file's stock and drop-in processes at the same time (pass/fail suites only)")
    p.add_argument("--dry-run", action="store_true", help="print the pytest commands and run nothing")
    return p


def plan_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Plan:
    """The run ``args`` ask for; parser.error (exit 2) if it cannot be done."""
    tests_dir = args.tests_dir.expanduser()
    if not tests_dir.is_dir():
        parser.error(f"--tests-dir {tests_dir}: no such folder. Give the folder that holds TE's "
                     "tests/pytorch files (test_sanity.py, test_numerics.py, ..., fsdp2/).")
    entries = entries_for(args)
    outside = [e.path for e in entries if Path(e.path).is_absolute() or ".." in Path(e.path).parts]
    if outside:
        parser.error(f"--files must be paths inside --tests-dir, relative to it: {', '.join(outside)}")
    missing = [e.path for e in entries if not (tests_dir / e.path).exists()]
    if missing:
        parser.error(f"--tests-dir {tests_dir} lacks {', '.join(missing)}; choose what it has with --files")
    if args.timeout <= 0 or (args.max_minutes is not None and args.max_minutes <= 0):
        parser.error("--timeout and --max-minutes must be positive")
    if args.nproc is not None and args.nproc < 1:
        parser.error(f"--nproc must be >= 1; received {args.nproc}")
    if args.swap is not None:
        from .plugin import SwapError, swap_names

        try:
            swap_names(args.swap)
        except SwapError as err:
            parser.error(str(err))
    budget = args.max_minutes * 60.0 if args.max_minutes is not None else None
    # absolute: each pytest runs from its copy of the tests and writes here
    return Plan(tests_dir.resolve(), entries, args.out.expanduser().resolve(), args.timeout, budget, args.nproc,
                args.dropins, args.swap, args.parallel)


# -- one pytest process ------------------------------------------------------------
def pytest_command(entry: Entry, variant: Variant, run_dir: Path, copy: Path, dropins: str,
                   nproc: int = 1, swap: str | None = None) -> list[str]:
    """The command for ``entry`` under ``variant``, run from ``copy``; ``swap``:
    the names the drop-in variant swaps (None: the plugin's default, all)."""
    launch = [sys.executable]
    if entry.launcher is Launcher.TORCHRUN:
        launch += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd = [*launch, "-m", "pytest", entry.path,
           "-p", PLUGIN, "--te-suite-variant", variant.value, "--te-suite-record", str(run_dir),
           "--te-suite-dropins", dropins, "--junitxml", str(run_dir / "junit.xml"),
           # the copy's own pytest.ini and folder, nothing of this repository's configuration
           "--rootdir", str(copy), "-c", str(copy / "pytest.ini"),
           "-p", "no:cacheprovider", "-p", "no:randomly", "--continue-on-collection-errors",
           "-q", "--tb=short", "-rfE"] + (["--te-suite-ops"] if entry.ops else [])
    if swap is not None:
        cmd += ["--te-suite-swap", swap]
    return cmd + (["-k", entry.select] if entry.select else [])


def child_env() -> dict[str, str]:
    """This environment with the repository importable (``te_integration``,
    the plugin) and no pytest options from outside, so both variants get the same."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "PYTEST_PLUGINS")}
    for key, value in SAFE_ENV.items():
        env.setdefault(key, value)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def _descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid``, from /proc (empty elsewhere).
    torchrun starts its ranks in sessions of their own, out of reach of a
    signal to its process group."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def _kill_all(proc: subprocess.Popen, ranks: list[int]) -> int:
    _signal_group(proc.pid, signal.SIGKILL)
    for pid in ranks:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return proc.wait()


def run_process(cmd: list[str], cwd: Path, log: Path, timeout_s: float) -> tuple[int, float, bool]:
    """Run ``cmd`` in its own process group, output to ``log``; its exit
    status, seconds, and whether it hit ``timeout_s``. Past it, the group
    gets SIGINT (pytest then still writes what finished; torchrun passes it
    on to its ranks) and, :data:`GRACE_S` later, SIGKILL with every descendant."""
    t0 = time.monotonic()
    with open(log, "w") as f:
        f.write(shlex.join(cmd) + "\n\n")
        f.flush()
        proc = subprocess.Popen(cmd, cwd=cwd, env=child_env(), stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            return proc.wait(timeout=timeout_s), time.monotonic() - t0, False
        except subprocess.TimeoutExpired:
            ranks = _descendants(proc.pid)
            _signal_group(proc.pid, signal.SIGINT)
            try:
                return proc.wait(timeout=GRACE_S), time.monotonic() - t0, True
            except subprocess.TimeoutExpired:
                return _kill_all(proc, ranks + _descendants(proc.pid)), time.monotonic() - t0, True
        except BaseException:
            _kill_all(proc, _descendants(proc.pid))
            raise


# -- reading what a process left ---------------------------------------------------------
def _last_line(path: Path) -> str | None:
    try:
        lines = [line for line in path.read_text().splitlines() if line.strip()]
    except OSError:
        return None
    return lines[-1] if lines else None


def _record(run_dir: Path) -> dict | None:
    for name in ("record.json", "record.rank0.json"):
        try:
            return json.loads((run_dir / name).read_text())
        except (OSError, ValueError):
            continue
    return None


def _log_tail(log: Path, lines: int = 3) -> str:
    try:
        text = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return " / ".join(text[-lines:])[-400:]


def _status(entry: Entry, returncode: int, timed_out: bool, junit_files: int, ranks: int) -> RunStatus:
    if timed_out:
        return RunStatus.TIMED_OUT
    if junit_files < ranks or (entry.launcher is Launcher.PYTEST and returncode in (3, 4)) or returncode < 0:
        return RunStatus.CRASHED  # pytest's internal and usage errors, a signal, a rank without results
    return RunStatus.COMPLETED


def collect_run(entry: Entry, variant: Variant, run_dir: Path, returncode: int, seconds: float,
                timed_out: bool, ranks: int = 1) -> Run:
    """The :class:`Run` a finished process left in ``run_dir``."""
    try:
        results, files = read_runs_junit(run_dir)
    except ValueError as err:  # a JUnit file cut short by SIGKILL
        results, files, note = {}, 0, str(err)
    else:
        note = ""
    status = _status(entry, returncode, timed_out, files, ranks)
    interrupted = None
    if status is not RunStatus.COMPLETED:
        interrupted = _last_line(run_dir / "started.txt") or _last_line(run_dir / "started.rank0.txt")
        if interrupted:
            results.pop(case_id_of_node(interrupted), None)
        note = note or f"exit {returncode}: {_log_tail(run_dir / 'pytest.log')}"
    return Run(group=entry.path, variant=variant, status=status, selection=entry.select, results=results,
               seconds=seconds, returncode=returncode, interrupted=interrupted, record=_record(run_dir), note=note)


# -- the run ---------------------------------------------------------------------------
def make_copy(tests_dir: Path, parent: Path) -> Path:
    """A writable copy of ``tests_dir`` at ``parent/pytorch`` with a
    ``pytest.ini`` of its own (empty unless the folder brings one), so that
    no configuration of this repository or above the copy applies."""
    copy = parent / COPY_NAME
    shutil.copytree(tests_dir, copy, ignore=shutil.ignore_patterns("__pycache__", ".pytest_cache"))
    for path in (copy, *copy.rglob("*")):
        path.chmod(path.stat().st_mode | 0o200)  # TE's tests write files next to themselves
    ini = copy / "pytest.ini"
    if not ini.exists():
        ini.write_text("[pytest]\n# Written by tests.te_suite: this copy's tests run with pytest's defaults.\n")
    return copy


def gpus_present() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count()


def _slug(index: int, entry: Entry) -> str:
    return f"{index:02d}-" + entry.path.rstrip("/").replace("/", "_").removesuffix(".py")


@dataclass
class _Clock:
    """--max-minutes: how long a process may still run."""

    budget_s: float | None
    start: float = 0.0

    def __post_init__(self) -> None:
        self.start = time.monotonic()

    def allowance(self, timeout_s: float, share: float) -> float | None:
        """``timeout_s`` cut to ``share`` of what is left (less the grace a
        timeout needs); None if too little is left to start."""
        if self.budget_s is None:
            return timeout_s
        left = self.budget_s - (time.monotonic() - self.start) - GRACE_S
        return min(timeout_s, left * share) if left * share >= MIN_START_S else None


def _not_run(entry: Entry, variant: Variant, why: str) -> Run:
    return Run(group=entry.path, variant=variant, status=RunStatus.NOT_RUN, selection=entry.select, note=why)


def run_entry(plan: Plan, index: int, entry: Entry, copies: dict[Variant, Path], ranks: int,
              clock: _Clock) -> tuple[Run, Run]:
    """Stock, then drop-in: one pytest process each (both at once with ``plan.parallel``)."""
    if plan.parallel:
        with ThreadPoolExecutor(max_workers=2) as pool:
            futures = [pool.submit(_run_variant, plan, index, entry, variant, copies[variant], ranks,
                                   clock.allowance(plan.timeout_s, 1.0)) for variant in (Variant.STOCK, Variant.DROPIN)]
            runs = [future.result() for future in futures]
        for run in runs:
            print(f"[{index + 1}/{len(plan.entries)}] {_progress_line(run)}", flush=True)
        return runs[0], runs[1]
    runs = []
    for variant, share in ((Variant.STOCK, 0.5), (Variant.DROPIN, 1.0)):
        timeout = clock.allowance(plan.timeout_s, share)
        runs.append(_run_variant(plan, index, entry, variant, copies[variant], ranks, timeout))
        print(f"[{index + 1}/{len(plan.entries)}] {_progress_line(runs[-1])}", flush=True)
    return runs[0], runs[1]


def _run_variant(plan: Plan, index: int, entry: Entry, variant: Variant, copy: Path, ranks: int,
                 timeout: float | None) -> Run:
    if entry.launcher is Launcher.TORCHRUN and ranks < 1:
        return _not_run(entry, variant, "no CUDA GPU for torchrun")
    if timeout is None:
        return _not_run(entry, variant, "--max-minutes spent before it could start")
    run_dir = plan.out / "runs" / _slug(index, entry) / variant.value
    shutil.rmtree(run_dir, ignore_errors=True)  # JUnit files of an earlier run must not be read as this one's
    run_dir.mkdir(parents=True)
    cmd = pytest_command(entry, variant, run_dir, copy, plan.dropins, ranks, plan.swap)
    rc, seconds, timed_out = run_process(cmd, copy, run_dir / "pytest.log", timeout)
    return collect_run(entry, variant, run_dir, rc, seconds, timed_out,
                       ranks if entry.launcher is Launcher.TORCHRUN else 1)


def _progress_line(run: Run) -> str:
    counts = Counter(result.outcome.value for result in run.results.values())
    told = ", ".join(f"{n} {name}" for name, n in sorted(counts.items())) or "no results"
    if run.status is RunStatus.NOT_RUN:
        return f"{run.group} {run.variant.value}: not run ({run.note})"
    return f"{run.group} {run.variant.value}: {run.status.value} in {run.seconds:.0f} s ({told})"


def run_plan(plan: Plan) -> Comparison:
    """Run every entry of ``plan`` in both variants and compare."""
    needs_ranks = any(e.launcher is Launcher.TORCHRUN for e in plan.entries)
    ranks = plan.nproc if plan.nproc is not None else (min(gpus_present(), 2) if needs_ranks else 0)
    clock = _Clock(plan.budget_s)
    with tempfile.TemporaryDirectory(prefix="te_suite_") as work:
        copies = {v: make_copy(plan.tests_dir, Path(work) / v.value) for v in Variant}
        pairs = [run_entry(plan, i, entry, copies, ranks, clock) for i, entry in enumerate(plan.entries)]
    return compare(pairs)


# -- output ------------------------------------------------------------------------------
def fingerprint(tests_dir: Path) -> str:
    """Which test files these were, without naming where they lie: count and sha256."""
    digest, count = hashlib.sha256(), 0
    for path in sorted(p for p in tests_dir.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        digest.update(str(path.relative_to(tests_dir)).encode() + b"\0" + path.read_bytes() + b"\0")
        count += 1
    return f"{count} files, sha256 {digest.hexdigest()[:16]}"


def redacted_command(argv: Sequence[str]) -> str:
    """The command line with the values of --tests-dir and --out as DIR and OUT
    (local paths do not belong in a committed summary)."""
    out, names, skip = [], {"--tests-dir": "DIR", "--out": "OUT"}, None
    for arg in argv:
        if skip:
            out.append(skip)
            skip = None
            continue
        key = arg.split("=", 1)[0]
        if key in names and "=" in arg:
            out.append(f"{key}={names[key]}")
        else:
            out.append(arg)
            skip = names.get(arg)
    return "python3 -m tests.te_suite " + shlex.join(out)


def _meta(plan: Plan, argv: Sequence[str], comparison: Comparison) -> dict:
    env = capture_env()
    recorded = [r.record.get("te_version") for pair in comparison.pairs for r in pair if r.record]
    env["te"] = next((v for v in recorded if v), env.get("te"))
    return {"command": redacted_command(argv), "environment": env, "tests_fingerprint": fingerprint(plan.tests_dir),
            "entries": [{"path": e.path, "select": e.select, "launcher": e.launcher.value} for e in plan.entries],
            "timeout_s": plan.timeout_s, "max_minutes": None if plan.budget_s is None else plan.budget_s / 60,
            "dropins": plan.dropins, "swap": plan.swap or "all"}


def write_outputs(plan: Plan, comparison: Comparison, meta: dict) -> str:
    summary = render_summary(comparison, meta)
    (plan.out / "summary.md").write_text(summary)
    (plan.out / "comparison.json").write_text(json.dumps(jsonable(comparison_json(comparison, meta)), indent=1)
                                              + "\n")
    write_outcomes(comparison, plan.out / "outcomes.jsonl")
    return summary


def _dry_run(plan: Plan) -> None:
    copy = Path("<copy>") / COPY_NAME
    ranks = plan.nproc or 2
    for i, entry in enumerate(plan.entries):
        for variant in Variant:
            run_dir = plan.out / "runs" / _slug(i, entry) / variant.value
            print(shlex.join(pytest_command(entry, variant, run_dir, copy, plan.dropins, ranks, plan.swap)))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    plan = plan_from_args(parser, args)
    if args.dry_run:
        _dry_run(plan)
        return 0
    plan.out.mkdir(parents=True, exist_ok=True)
    comparison = run_plan(plan)
    summary = write_outputs(plan, comparison, _meta(plan, argv, comparison))
    print(summary)
    print(f"wrote {plan.out / 'summary.md'} and {plan.out / 'comparison.json'}")
    return comparison.verdict.value


if __name__ == "__main__":
    sys.exit(main())
