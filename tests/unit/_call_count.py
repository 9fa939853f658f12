"""Python-level calls of a piece of code, counted with ``sys.setprofile``:
exact on any machine, where a time would depend on it."""

from __future__ import annotations

import gc
import sys
from collections import Counter
from collections.abc import Callable


def count_calls(fn: Callable[[], object], repeat: int = 4) -> Counter:
    """Calls per run of ``fn`` (after two runs unprofiled), keyed by
    (file, function name); builtins are keyed ("builtin", name). The
    collector is off while counting: a collection's callbacks would add
    calls that are not ``fn``'s."""
    fn()
    fn()
    seen: Counter = Counter()

    def profile(frame, event, arg):
        if event == "call":
            seen[(frame.f_code.co_filename, frame.f_code.co_name)] += 1
        elif event == "c_call":
            seen[("builtin", getattr(arg, "__qualname__", repr(arg)))] += 1

    gc.collect()
    gc.disable()
    sys.setprofile(profile)
    try:
        for _ in range(repeat):
            fn()
    finally:
        sys.setprofile(None)
        gc.enable()
    return Counter({key: n / repeat for key, n in seen.items()})
