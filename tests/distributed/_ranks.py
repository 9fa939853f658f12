"""The worker side of a torchrun test: every rank's rows to one JSON report."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path


def report(path: Path, part: dict) -> int:
    """Gather each rank's ``part`` (its ``rows``, each with ``passed``) to
    rank 0, which writes them to ``path``; tear the group down; return the
    exit status: 1 when any rank has a failed row."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    gathered: list = [None] * world
    dist.all_gather_object(gathered, part)
    failed = sum(not row["passed"] for rank_part in gathered for row in rank_part["rows"])
    if dist.get_rank() == 0:
        result = {"torch": torch.__version__, "world_size": world, "ranks": gathered, "failed": failed}
        Path(path).write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    return 1 if failed else 0


def rows_of(cases: list[Callable[[], list[dict]]], failed: Callable[[str], dict]) -> list[dict]:
    """The rows of every case, in order; a case that raises gives the row
    ``failed(error)`` instead, with its traceback on stderr."""
    import traceback

    rows: list[dict] = []
    for case in cases:
        try:
            rows.extend(case())
        except Exception as exc:  # noqa: BLE001 - reported as a failed row
            traceback.print_exc()
            rows.append(failed(f"{type(exc).__name__}: {exc}"))
    return rows


def run(main: Callable[[], int]) -> None:
    """Run ``main`` and leave with its status, without the interpreter's
    teardown: there, gloo's threads sometimes race and abort a rank
    ("terminate called without an active exception", seen 2 in 23 CPU runs),
    which fails a run whose every row passed."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
