"""Every benchmark in one command, within a time budget.

    python -m benchmarks.run_all [--quick] [--out DIR] [--budget SECONDS] [--archive FILE.tar.gz]

Runs ``policy_overhead`` (CPU), then ``step_time``, ``fsdp2_memory``,
``microbatch``, ``recompute`` and ``moe_memory``, each through
``torchrun --nproc_per_node=2``.
Each benchmark gets a share of what is left of ``--budget`` (passed as its
``--time-budget``: configurations that no longer fit are recorded as
skipped) and is killed 120 s after its share. Each writes its result where
it does alone, ``benchmarks/results/<name>/``, replacing the one there
(``--out DIR``: ``DIR/<name>/`` instead); its output goes to the terminal.
``--archive`` packs what the run wrote into one file, easy to move off the
GPU machine.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from testbed.dist import SAFE_ENV
from testbed.record import REPO_ROOT

from . import _harness as h

#: name -> (share of the budget, runs under torchrun). The shares are each
#: benchmark's measured full runtime on 2x H200 (d7db962: 14, 220, 249, 240 and
#: 160 s), so a budget that fits the sum runs everything. moe_memory's share is an
#: estimate from its plan (about 300 s at full size).
BENCHMARKS = {
    "policy_overhead": (0.015, False),
    "step_time": (0.21, True),
    "fsdp2_memory": (0.23, True),
    "microbatch": (0.22, True),
    "recompute": (0.15, True),
    "moe_memory": (0.28, True),
}
STARTUP_S = 30.0  # python, torch, TE and NCCL start-up, outside a benchmark's own budget
GRACE_S = 120.0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run_all", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="every benchmark's --quick (about 4 minutes in all)")
    p.add_argument("--out", type=Path, default=None,
                   help="write each result into DIR/<name>/ (default: its current result, benchmarks/results/<name>/)")
    p.add_argument("--only", type=h.csv_choices(tuple(BENCHMARKS)), default=list(BENCHMARKS),
                   help=f"comma-separated subset of {', '.join(BENCHMARKS)}")
    p.add_argument("--budget", type=float, default=None,
                   help="total seconds for all benchmarks (default 540, --quick 220)")
    p.add_argument("--nproc", type=h.positive_int, default=2, help="ranks per FSDP2 benchmark (default 2)")
    p.add_argument("--archive", type=Path, default=None, help="pack every result written as a .tar.gz here")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("extra", nargs="*", help="after --: options passed to every GPU benchmark")
    return p


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(name: str, args: argparse.Namespace, budget_s: float) -> list[str]:
    """The command line of one benchmark."""
    cmd = [sys.executable]
    torchrun = BENCHMARKS[name][1]
    if torchrun:
        cmd += ["-m", "torch.distributed.run", f"--nproc_per_node={args.nproc}", f"--master_port={_free_port()}"]
    cmd += ["-m", f"benchmarks.{name}", "--out", str(out_dir(name, args))]
    if args.quick:
        cmd.append("--quick")
    if torchrun:
        cmd += ["--time-budget", f"{max(budget_s, 10.0):.0f}", *args.extra]
    return cmd


def out_dir(name: str, args: argparse.Namespace) -> Path:
    """Where benchmark ``name`` writes: its current result, or ``--out``'s subfolder."""
    return h.RESULTS / name if args.out is None else args.out / name


def child_env() -> dict:
    env = dict(os.environ)
    for key, value in SAFE_ENV.items():
        env.setdefault(key, value)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_one(cmd: list[str], timeout_s: float) -> tuple[int, float]:
    """Run ``cmd`` in its own process group, its output echoed to the
    terminal; its exit status (124 if the group was killed at
    ``timeout_s``: torchrun and its ranks) and duration."""
    t0 = time.perf_counter()
    killed = threading.Event()
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env(),
                          cwd=REPO_ROOT, start_new_session=True) as proc:

        def kill() -> None:
            killed.set()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)

        watchdog = threading.Timer(timeout_s, kill)
        watchdog.start()
        try:
            for line in proc.stdout:
                sys.stdout.write(line)
                sys.stdout.flush()
            rc = proc.wait()
        except BaseException:
            kill()
            raise
        finally:
            watchdog.cancel()
    if killed.is_set():
        print(f"killed after {timeout_s:.0f} s", flush=True)
        return 124, time.perf_counter() - t0
    return rc, time.perf_counter() - t0


def share(name: str, remaining: Sequence[str], left_s: float) -> float:
    weights = {n: BENCHMARKS[n][0] for n in remaining}
    return left_s * weights[name] / sum(weights.values())


def summary(outcomes: list[dict]) -> str:
    """One line per benchmark run: its exit status, its time and its result's targets."""
    rows = []
    for o in outcomes:
        path = o["out"] / f"{h.result_stem(o['name'], 'quick' if o['quick'] else '')}.json"
        counts = h.summary_counts(h.load_result(path)["rows"]) if path.is_file() else None
        rows.append([o["name"], o["rc"], f"{o['seconds']:.0f}",
                     f"{counts['met']} of {counts['targets']} met" if counts else "no result", str(o["out"])])
    return "\n".join(h.markdown_table(["benchmark", "exit", "seconds", "targets", "result"], rows))


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    budget = args.budget if args.budget is not None else (220.0 if args.quick else 540.0)
    t0, outcomes = time.perf_counter(), []
    names = [n for n in BENCHMARKS if n in args.only]
    for i, name in enumerate(names):
        left = budget - (time.perf_counter() - t0)
        mine = share(name, names[i:], left)
        cmd = command(name, args, mine - (STARTUP_S if BENCHMARKS[name][1] else 0.0))
        print(f"== {name}: {mine:.0f} s of {left:.0f} s left ==\n$ {shlex.join(cmd)}", flush=True)
        if args.dry_run:
            continue
        rc, seconds = run_one(cmd, mine + GRACE_S)
        outcomes.append({"name": name, "rc": rc, "seconds": seconds, "quick": args.quick, "out": out_dir(name, args)})
    if args.dry_run:
        return 0
    print(summary(outcomes), flush=True)
    if args.archive is not None:
        with tarfile.open(args.archive, "w:gz") as tar:
            for o in outcomes:
                tar.add(o["out"], arcname=o["name"])
        print(f"wrote {args.archive}", flush=True)
    return 0 if all(o["rc"] == 0 for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
