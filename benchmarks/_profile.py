"""Where a drop-in's host time goes, counted: Python-level calls per function
(cProfile's primitive call counts), stock against drop-in, for one step or
one call. Counts do not depend on the host's speed or load, so the table
they give explains a timing miss where a timing alone cannot."""

from __future__ import annotations

import cProfile
import pstats
from collections.abc import Callable

__all__ = ["profile_step", "added_calls_table", "own_time_table"]

#: Folders whose name starts a function's label (the rest of the path is
#: the machine's, not the project's).
_ROOTS = ("te_integration/", "workspace_manager/", "transformer_engine/", "torch/", "benchmarks/")


def _label(file: str, name: str) -> str:
    if file == "~":  # a builtin: cProfile names it in ``name``
        return name
    installed = file.rfind("site-packages/")
    if installed >= 0:  # an installed package: its path from the package on
        file = file[installed + len("site-packages/"):]
    for root in _ROOTS:
        at = file.find(root)
        if at >= 0:
            return f"{file[at:]}:{name}"
    return f"{file.rsplit('/', 1)[-1]}:{name}"


def profile_step(fn: Callable[[], object]) -> dict:
    """Run ``fn`` once under cProfile: ``calls`` (primitive calls per
    function label), ``own_by`` (own time per label, in seconds) and
    ``own_s`` (their sum). Times are inflated by profiling: for where the
    time goes, not for how much there is."""
    prof = cProfile.Profile()
    prof.runcall(fn)
    calls: dict[str, int] = {}
    own_by: dict[str, float] = {}
    for (file, _, name), (primitive, _, tottime, _, _) in pstats.Stats(prof).stats.items():
        label = _label(file, name)
        calls[label] = calls.get(label, 0) + primitive
        own_by[label] = own_by.get(label, 0.0) + tottime
    return {"calls": calls, "own_by": own_by, "own_s": sum(own_by.values())}


def largest_differences(stock: dict, dropin: dict, top: int) -> list[tuple]:
    """``(drop-in minus stock, name)`` for the ``top`` names whose values
    differ most (a name one side lacks counts as 0 there), largest first,
    ties by name."""
    deltas = ((dropin.get(n, 0) - stock.get(n, 0), n) for n in set(stock) | set(dropin))
    return sorted(deltas, key=lambda d: (-abs(d[0]), d[1]))[:top]


def added_calls_table(title: str, stock: dict[str, int], dropin: dict[str, int], top: int = 25) -> dict:
    """A result table (``tables`` entry) of the functions whose call counts
    differ most, drop-in minus stock, with both totals in its note."""
    deltas = largest_differences(stock, dropin, top)
    rows = [[n, str(stock.get(n, 0)), str(dropin.get(n, 0)), f"{d:+d}"] for d, n in deltas if d]
    total_s, total_d = sum(stock.values()), sum(dropin.values())
    note = (f"Python-level calls (functions and builtins): stock {total_s}, drop-in {total_d}, "
            f"added {total_d - total_s:+d}. Counted with cProfile over the same work; the top {top} differences.")
    return {"title": title, "columns": ["function", "stock", "drop-in", "added"], "rows": rows, "note": note}


def own_time_table(title: str, stock: dict[str, float], dropin: dict[str, float], top: int = 15) -> dict:
    """A result table of the functions with the most own time in the
    drop-in's profiled step (cProfile's ``tottime``), next to stock's time in
    the same function, and of the functions only the drop-in runs."""
    names = sorted(dropin, key=lambda n: -dropin[n])[:top]
    ours = sorted((n for n in dropin if n not in stock), key=lambda n: -dropin[n])
    rows = [[n, f"{1e3 * stock.get(n, 0.0):.3f}", f"{1e3 * dropin[n]:.3f}"] for n in names]
    rows += [[f"{n} (drop-in only)", "0.000", f"{1e3 * dropin[n]:.3f}"] for n in ours if n not in names]
    total_s, total_d = sum(stock.values()), sum(dropin.values())
    only = sum(dropin[n] for n in ours)
    note = (f"Own time under cProfile (ms, inflated by profiling): stock {1e3 * total_s:.1f}, drop-in "
            f"{1e3 * total_d:.1f}, of which {1e3 * only:.2f} in functions stock does not run. The top {top} by "
            "drop-in own time, then every drop-in-only function.")
    return {"title": title, "columns": ["function", "stock ms", "drop-in ms"], "rows": rows, "note": note}
