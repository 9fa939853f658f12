"""Where a drop-in's host time goes, counted: Python-level calls per function
(cProfile's primitive call counts), stock against drop-in, for one step or
one call. Counts do not depend on the host's speed or load, so the table
they give explains a timing miss where a timing alone cannot."""

from __future__ import annotations

import cProfile
import pstats
from collections.abc import Callable

__all__ = ["profile_counts", "added_calls_table"]

#: Folders whose name starts a function's label (the rest of the path is
#: the machine's, not the project's).
_ROOTS = ("te_integration/", "workspace_manager/", "transformer_engine/", "torch/", "benchmarks/")


def _label(file: str, name: str) -> str:
    if file == "~":  # a builtin: cProfile names it in ``name``
        return name
    for root in _ROOTS:
        at = file.find(root)
        if at >= 0:
            return f"{file[at:]}:{name}"
    return f"{file.rsplit('/', 1)[-1]}:{name}"


def profile_counts(fn: Callable[[], object]) -> tuple[dict[str, int], float]:
    """Run ``fn`` once under cProfile: calls per function label, and the
    profiled run's own time in seconds (inflated by profiling; for scale only)."""
    prof = cProfile.Profile()
    prof.runcall(fn)
    counts: dict[str, int] = {}
    own = 0.0
    for (file, _, name), (primitive, _, tottime, _, _) in pstats.Stats(prof).stats.items():
        label = _label(file, name)
        counts[label] = counts.get(label, 0) + primitive
        own += tottime
    return counts, own


def added_calls_table(title: str, stock: dict[str, int], dropin: dict[str, int], top: int = 25) -> dict:
    """A result table (``tables`` entry) of the functions whose call counts
    differ most, drop-in minus stock, with both totals in its note."""
    names = set(stock) | set(dropin)
    deltas = sorted(((dropin.get(n, 0) - stock.get(n, 0), n) for n in names), key=lambda d: (-abs(d[0]), d[1]))
    rows = [[n, str(stock.get(n, 0)), str(dropin.get(n, 0)), f"{d:+d}"] for d, n in deltas[:top] if d]
    total_s, total_d = sum(stock.values()), sum(dropin.values())
    note = (f"Python-level calls (functions and builtins): stock {total_s}, drop-in {total_d}, "
            f"added {total_d - total_s:+d}. Counted with cProfile over the same work; the top {top} differences.")
    return {"title": title, "columns": ["function", "stock", "drop-in", "added"], "rows": rows, "note": note}
