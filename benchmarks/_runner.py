"""The driver every GPU benchmark shares: launch checks, jobs run one by
one with progress and a time budget, errors recorded (one failing
configuration does not hide the others), and rank 0 writing the result
into the benchmark's current result folder (:func:`save`).

A benchmark supplies ``plan(args, dist, world, total_gib) -> list[Job]``
(pure: it only builds the jobs, so the CPU tests call it with
``dist=None``) and ``summarize(samples, args) -> dict`` with any of
``rows``, ``series``, ``timings``, ``tables``, ``bars`` (pure as well).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from . import _harness as h


@dataclass
class Job:
    """One measured configuration: ``run()`` returns its raw figures, which
    are stored with ``meta`` as one sample."""

    label: str
    meta: dict
    run: Callable[[], dict]
    estimate_s: float = 1.0
    spec: Any = field(default=None, repr=False)


def run_jobs(jobs: Sequence[Job], result: dict, progress: h.Progress,
             on_error: Callable[[], None] = lambda: None) -> None:
    """Run ``jobs`` in order into ``result['samples']``. Once the budget has
    passed, the rest are listed under ``skipped``; a job that raises is
    listed under ``errors`` with its traceback."""
    for i, job in enumerate(jobs):
        if progress.over_budget():
            result["skipped"] += [{"what": j.label, "why": f"time budget of {progress.budget_s:.0f} s reached"}
                                  for j in jobs[i:]]
            progress.say(f"time budget reached: skipping {len(jobs) - i} configuration(s)")
            return
        progress.start(job.label, job.estimate_s)
        try:
            sample = job.run()
        except Exception:  # recorded, so one failing configuration does not hide the others
            result["errors"].append({"where": job.label, "traceback": traceback.format_exc()})
            on_error()
            progress.done("FAILED (see errors)")
            continue
        result["samples"].append({**job.meta, **sample})
        progress.done(_short(sample))


def _short(sample: dict) -> str:
    parts = []
    if sample.get("peak_mib") is not None:
        parts.append(f"peak {sample['peak_mib']:.1f} MiB")
    times = sample.get("step_time_s") or []
    if isinstance(times, dict):  # paired timing: one series per model
        parts += [f"{label} {1e3 * h.spread(t)['median']:.2f} ms" for label, t in times.items() if t]
    elif times:
        parts.append(f"median step {1e3 * h.spread(times)['median']:.2f} ms")
    return "(" + ", ".join(parts) + ")" if parts else ""


def save(result: dict, out_dir, tag: str = "") -> list:
    """Write ``result`` into ``out_dir``, replacing what it replaces
    (``_harness.write_result``): its JSON, its Markdown and, where matplotlib
    is installed, its figures (``plot.figures``); the paths written."""
    from . import plot

    json_path, md_path = h.write_result(result, out_dir, tag)
    paths = [json_path, md_path, *plot.figures(result, json_path.stem, json_path.parent)]
    print("wrote " + ", ".join(str(p) for p in paths), flush=True)
    return paths


def apply_summary(result: dict, summary: dict) -> None:
    for key in ("rows", "series", "timings", "tables", "bars"):
        result[key] = list(summary.get(key, []))


def launch_message(name: str, argv: Sequence[str], ranks: int, world: int) -> str:
    args = " ".join(argv)
    found = "it was started without torchrun" if world == 0 else f"it was started with {world} rank(s)"
    return (f"benchmarks.{name} runs FSDP2 on 1 or 2 GPUs (world size = the GPUs present), one process each, "
            f"but {found}. Launch it with:\n"
            f"  torchrun --nproc_per_node=2 -m benchmarks.{name} {args}".rstrip() + "\n"
            "(--nproc_per_node=1 on a machine with one GPU; "
            "it needs TE: pip install -e '.[te,test,bench]'; "
            "`python -m benchmarks.run_all` launches every benchmark)")


def require_launch(name: str, argv: Sequence[str], *, ranks: int = 1) -> None:
    """Exit with a message saying how to launch, unless this process is one
    of >= ``ranks`` torchrun ranks on a CUDA machine with TE importable (one
    rank is FSDP2 at world size 1: a mesh of one GPU)."""
    world = int(os.environ.get("WORLD_SIZE", "0") or 0) if "LOCAL_RANK" in os.environ else 0
    if world < ranks:
        raise SystemExit(launch_message(name, argv, ranks, world))
    import torch

    if not torch.cuda.is_available():
        raise SystemExit(f"benchmarks.{name} needs CUDA GPUs; torch {torch.__version__} sees none here.")
    local = int(os.environ["LOCAL_RANK"])
    if local >= torch.cuda.device_count():
        raise SystemExit(f"benchmarks.{name}: LOCAL_RANK {local} but only {torch.cuda.device_count()} GPU(s); "
                         f"use --nproc_per_node={torch.cuda.device_count()} or fewer")
    try:
        import te_integration  # noqa: F401
    except ImportError as err:
        raise SystemExit(f"benchmarks.{name} needs TransformerEngine 2.20 with te_integration: {err}\n"
                         "Install it with: pip install -e '.[te,test,bench]'") from None


def supported_recipes(names: Sequence[str], result: dict) -> list[str]:
    """The recipes this GPU runs (TE's own checks); the others are skipped with TE's reason."""
    from testbed.recipes import recipe_skip_reason

    kept = []
    for name in names:
        reason = recipe_skip_reason(name)
        if reason is None:
            kept.append(name)
        else:
            result["skipped"].append({"what": name, "why": reason})
    return kept


def gpu_main(name: str, args: argparse.Namespace, argv: Sequence[str] | None,
             plan: Callable[..., list[Job]], summarize: Callable[[list[dict], argparse.Namespace], dict],
             extra_config: dict | None = None) -> int:
    """Check the launch, run the planned jobs on every rank, summarize and
    write on rank 0. Exit status 1 if any configuration failed."""
    require_launch(name, list(sys.argv[1:] if argv is None else argv))
    import torch

    import te_integration
    from testbed.dist import Dist
    from testbed.model import release_memory

    from . import _stack

    t0 = time.perf_counter()
    dist = Dist()
    result = h.new_result(name, h.config_of(args, world_size=dist.world, **(extra_config or {})))
    try:
        # installed now, so that stock and drop-in models run in the same process state whatever the
        # order (stock modules pass through them unchanged, and the quantization counter sees both)
        import te_integration.debug

        te_integration.debug.install_seams()
        args.recipes = supported_recipes(args.recipes, result)
        total_gib = torch.cuda.get_device_properties(dist.local_rank).total_memory / 2**30
        jobs = plan(args, dist, dist.world, total_gib)
        result["config"]["planned"] = [j.label for j in jobs]
        result["config"]["estimated_s"] = round(sum(j.estimate_s for j in jobs), 1)
        progress = h.Progress(sum(j.estimate_s for j in jobs), enabled=dist.is_main and not args.quiet,
                              budget_s=args.time_budget, agree=dist.any_true)
        progress.say(f"benchmarks.{name}: {len(jobs)} configuration(s), about {result['config']['estimated_s']:.0f} s "
                     f"estimated; writing to {args.out}")
        if getattr(args, "prime", True):
            _stack.prime(args.recipes, dist)
        run_jobs(jobs, result, progress, on_error=release_memory)
        apply_summary(result, summarize(result["samples"], args))
    except Exception:
        result["errors"].append({"where": "driver", "traceback": traceback.format_exc()})
    finally:
        result["wall_s"] = round(time.perf_counter() - t0, 1)
        if dist.is_main:
            save(result, args.out, args.tag)
        dist.close()
    return 1 if result["errors"] else 0


def print_plan(plan: Callable[..., list[Job]], args: argparse.Namespace) -> int:
    """``--dry-run``: the configurations ``plan`` would measure at the
    world size torchrun would give (1 without it), with their estimated
    seconds; needs neither CUDA nor TE."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    jobs = plan(args, None, world, 141.0)
    for job in jobs:
        print(f"{job.label}  (about {job.estimate_s:.1f} s)")
    print(f"{len(jobs)} configuration(s), about {sum(j.estimate_s for j in jobs):.0f} s at world size {world}")
    return 0


def add_plan_options(p: argparse.ArgumentParser) -> None:
    """``--time-budget`` and ``--dry-run``, the options of a benchmark that plans jobs."""
    p.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="skip the remaining configurations once this much time has passed (recorded as skipped)")
    p.add_argument("--dry-run", action="store_true", help="print the planned configurations and exit")


def run_main(name: str, args: argparse.Namespace, argv: Sequence[str] | None, plan: Callable[..., list[Job]],
             summarize: Callable[[list[dict], argparse.Namespace], dict], extra_config: dict | None = None) -> int:
    """A planned benchmark's ``main`` after parsing: ``--dry-run`` prints the
    plan; otherwise :func:`gpu_main` runs it and rank 0's result is printed."""
    if args.dry_run:
        return print_plan(plan, args)
    rc = gpu_main(name, args, argv, plan, summarize, extra_config=extra_config)
    h.print_result(name, args.out, args.tag)
    return rc
