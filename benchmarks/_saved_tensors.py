"""What one layer keeps for backward, tensor by tensor (``saved_workspace``'s
breakdown of the memory held from forward to backward).

TE 2.20 hands autograd plain tensors: ``prepare_for_saving`` splits each
quantized tensor into its data and scale tensors before
``ctx.save_for_backward``. A saved-tensor pack hook therefore sees every byte
a layer keeps for backward. Each storage is counted once, under the innermost
module running when it was saved; the layer's parameters are left out, as
they are alive anyway. Pure functions below the recorder need no CUDA.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Callable

import torch

#: One saved storage's description: "dtype (shape)", the shape of the first
#: tensor saved on it.
Table = dict[str, dict[str, int]]


def record_saved(layer: torch.nn.Module, run: Callable[[], object]) -> Table:
    """Run ``run`` (a forward and backward through a model holding
    ``layer``); {module name inside ``layer``: {"dtype (shape)": bytes}} of
    what ``layer`` saved for backward."""
    active: list[str] = []
    table: defaultdict[str, Counter] = defaultdict(Counter)
    seen = {p.untyped_storage().data_ptr() for p in layer.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not active:
            return t
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a tensor subclass without storage: listed, not sized
            table[active[-1]][f"{type(t).__name__} {tuple(t.shape)} (not sized)"] += 0
            return t
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            table[active[-1]][f"{str(t.dtype).removeprefix('torch.')} {tuple(t.shape)}"] += storage.nbytes()
        return t

    def enter(name: str):
        def hook(module, args) -> None:
            active.append(name)
        return hook

    def leave(module, args, out) -> None:  # a hook returning a value would replace the output
        active.pop()

    handles = []
    for name, module in layer.named_modules():
        handles += [module.register_forward_pre_hook(enter(name or "(layer)")), module.register_forward_hook(leave)]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run()
    finally:
        for handle in handles:
            handle.remove()
    return {name: dict(entries) for name, entries in table.items()}


# -- pure --------------------------------------------------------------------------
def total(table: Table) -> int:
    return sum(sum(entries.values()) for entries in table.values())


def difference(a: Table, b: Table) -> list[tuple[str, str, int]]:
    """(module, tensor, bytes in ``a`` minus bytes in ``b``) where they differ,
    largest first."""
    out = []
    for module in sorted(set(a) | set(b)):
        left, right = a.get(module, {}), b.get(module, {})
        for key in sorted(set(left) | set(right)):
            delta = left.get(key, 0) - right.get(key, 0)
            if delta:
                out.append((module, key, delta))
    return sorted(out, key=lambda row: -abs(row[2]))


def describe(a_name: str, a: Table, b_name: str, b: Table, limit: int = 12, heading: str = "") -> list[str]:
    """Lines saying how much more ``a`` keeps than ``b`` and where; the
    first starts with ``heading``."""
    mib = 2**20
    lines = [f"{heading}{a_name} keeps {total(a) / mib:.2f} MiB, {b_name} {total(b) / mib:.2f} MiB "
             f"(difference {(total(a) - total(b)) / mib:+.2f} MiB):"]
    rows = difference(a, b)
    lines += [f"  {delta / mib:+8.2f} MiB  {module}: {key}" for module, key, delta in rows[:limit]]
    if len(rows) > limit:
        rest = sum(delta for _, _, delta in rows[limit:])
        lines.append(f"  {rest / mib:+8.2f} MiB  in {len(rows) - limit} more entries")
    return lines
