"""Where a drop-in's time goes, counted: Python-level calls per function
(cProfile's primitive call counts) and CUDA kernels per name
(torch.profiler), stock against drop-in, for one step or one call. Counts do
not depend on the host's speed or load, so the tables they give explain a
timing miss where a timing alone cannot."""

from __future__ import annotations

import cProfile
import pstats
from collections.abc import Callable

from ._harness import ratio_row

__all__ = ["profile_step", "kernel_profile", "count_kernels", "differences_table", "largest_differences",
           "profile_rows", "profile_tables"]

#: Folders whose name starts a function's label (the rest of the path is
#: the machine's, not the project's).
_ROOTS = ("te_integration/", "workspace_manager/", "transformer_engine/", "torch/", "benchmarks/")
#: Host calls that launch work on the GPU, as torch.profiler names them.
_LAUNCH_PREFIXES = ("cudaLaunch", "cuLaunch")


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
    function label) and ``own_s`` (the summed own time, inflated by
    profiling: for where the time goes, not for how much there is)."""
    prof = cProfile.Profile()
    prof.runcall(fn)
    calls: dict[str, int] = {}
    own = 0.0
    for (file, _, name), (primitive, _, tottime, _, _) in pstats.Stats(prof).stats.items():
        label = _label(file, name)
        calls[label] = calls.get(label, 0) + primitive
        own += tottime
    return {"calls": calls, "own_s": own}


def kernel_profile(fn: Callable[[], object]) -> dict:
    """Run ``fn`` once under torch.profiler and count its GPU work (:func:`count_kernels`)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return count_kernels(prof.events())


def count_kernels(events) -> dict:
    """From a profile's events: ``kernels`` (CUDA kernels, not copies,
    fills or annotated ranges), ``by_kernel`` (count per kernel name),
    ``busy_by`` (summed time per kernel name, ms), ``launch_calls`` (host
    calls that launch GPU work) and ``busy_ms`` (the kernels' summed time).

    A ``record_function`` range (FSDP's ``FSDP::pre_forward``, the
    optimizer's step) is mirrored on the GPU's timeline as an event of the
    same name spanning the kernels inside it: counted, it would add its
    whole span to the busy time. Such events are marked as user annotations,
    and their names are the host ranges' names; either leaves one out."""
    import torch

    events = list(events)
    cuda = torch.autograd.DeviceType.CUDA
    ranges = {e.name for e in events if e.device_type != cuda and getattr(e, "is_user_annotation", False)}
    by_kernel: dict[str, int] = {}
    busy_by: dict[str, float] = {}
    launches = 0
    for event in events:
        if event.device_type == cuda:
            if (event.name.startswith(("Memcpy", "Memset")) or event.name in ranges
                    or getattr(event, "is_user_annotation", False)):
                continue
            by_kernel[event.name] = by_kernel.get(event.name, 0) + 1
            busy_by[event.name] = busy_by.get(event.name, 0.0) + event.time_range.elapsed_us() / 1e3
        elif event.name.startswith(_LAUNCH_PREFIXES):
            launches += 1
    return {"kernels": sum(by_kernel.values()), "by_kernel": by_kernel, "busy_by": busy_by,
            "launch_calls": launches, "busy_ms": sum(busy_by.values())}


def largest_differences(stock: dict, dropin: dict, top: int) -> list[tuple]:
    """``(drop-in minus stock, name)`` for the ``top`` names whose values
    differ most (a name one side lacks counts as 0 there), largest first,
    ties by name."""
    deltas = ((dropin.get(n, 0) - stock.get(n, 0), n) for n in set(stock) | set(dropin))
    return sorted(deltas, key=lambda d: (-abs(d[0]), d[1]))[:top]


def differences_table(title: str, stock: dict, dropin: dict, *, what: str, top: int = 15, digits: int = 0) -> dict:
    """A result table (a ``tables`` entry) of the names whose ``what``
    (calls, kernels, milliseconds) differ most, drop-in minus stock, with
    both totals in its note; ``digits``: decimals of the values."""
    def fmt(value: float, sign: str = "") -> str:
        return f"{value:{sign}.{digits}f}"

    rows = [[n[:90], fmt(stock.get(n, 0)), fmt(dropin.get(n, 0)), fmt(d, "+")]
            for d, n in largest_differences(stock, dropin, top) if d]
    total_s, total_d = sum(stock.values()), sum(dropin.values())
    note = (f"{what} in one profiled step: stock {fmt(total_s)}, drop-in {fmt(total_d)}, added "
            f"{fmt(total_d - total_s, '+')}; the {top} largest differences.")
    return {"title": title, "columns": ["name", "stock", "drop-in", "added"], "rows": rows, "note": note}


def profile_rows(sample: dict) -> list[dict]:
    case, p = sample["case"], sample["profile"]
    st, dr = p["stock"], p["dropin"]
    return [ratio_row(case, "CUDA kernels per step", "", st["kernels"], dr["kernels"], limit=1.0),
            ratio_row(case, "kernel launch calls per step", "", st["launch_calls"], dr["launch_calls"], limit=None),
            ratio_row(case, "GPU busy per step (kernels' summed time)", "ms", st["busy_ms"], dr["busy_ms"],
                        limit=None),
            ratio_row(case, "Python-level calls per step", "", st["python_calls"], dr["python_calls"], limit=None)]


def profile_tables(sample: dict, top: int = 10) -> list[dict]:
    """Where the drop-in's step differs from stock's: the kernels whose
    counts and GPU times differ most, and the functions whose Python-level
    call counts do (a table only where the sample holds its figures)."""
    st, dr, case = sample["profile"]["stock"], sample["profile"]["dropin"], sample["case"]
    tables = [("by_kernel", "kernels per step", "CUDA kernels", 0), ("busy_by", "GPU time per kernel (ms per step)",
                                                                      "GPU busy ms", 2),
              ("calls", "Python-level calls per step", "Python-level calls", 0)]
    return [differences_table(f"{case}: {title}, drop-in against stock", st[key], dr[key], what=what, top=top,
                              digits=digits) for key, title, what, digits in tables if key in st and key in dr]
