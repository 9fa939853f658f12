"""The GEMM watch: :func:`check_stale_reads` raises (or counts) where one of
TE's GEMMs would read a stale FP8 transpose.

While the block runs, the GEMM functions of the module kinds' TE files
(``GEMM_SITES`` in ``_compat`` and ``_compat_ops``) are replaced by a wrapper
that compares, for each FP8 operand the GEMM reads columnwise, its
transpose with the transpose of its current data (``_stale.transpose_matches``);
TE's functions are put back when the block ends.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from workspace_manager.extending import fsdp2_gathered_parameters

from ..te import _compat as te
from ..te import _compat_ops as te_ops
from ._argument_checks import expect_module
from ._stale import StaleWorkspaceError, transpose_matches

__all__ = ["StaleRead", "StaleReadWatch", "check_stale_reads", "gemm_sites"]


@dataclass(frozen=True)
class StaleRead:
    """A GEMM operand whose transpose, about to be read, was stale."""

    #: The TE file's GEMM (``linear.general_gemm``...).
    site: str
    #: ``A`` or ``B``, and the index within a grouped GEMM's list.
    operand: str
    #: Where the tensor is in the watched model (``layers.0.weight``), or "".
    where: str
    #: The GEMM's layout, the operand's shape, and which GEMM of the watch it was (from 0).
    layout: str = ""
    shape: tuple = ()
    index: int = 0

    def __str__(self) -> str:
        return f"{self.site} #{self.index} {self.layout} {self.operand} {list(self.shape)} {self.where or '?'}"


#: Positions of ``layout`` in the two GEMM functions' signatures (TE 2.20.2).
_LAYOUT_POSITION = {"general_gemm": 9, "general_grouped_gemm": 5}


@dataclass
class StaleReadWatch:
    """What :func:`check_stale_reads` saw: ``reads`` (every stale read,
    with ``action="count"``), and how many operand transposes it compared."""

    action: str
    model: torch.nn.Module | None = None
    reads: list[StaleRead] = field(default_factory=list)
    compared: int = 0
    gemms: int = 0

    def inspect(self, site: str, name: str, args: tuple, kwargs: dict) -> None:
        position = _LAYOUT_POSITION[name]
        layout = kwargs.get("layout", args[position] if len(args) > position else "TN")
        self.gemms += 1
        for label, index, read_columnwise in (("A", 0, layout[0] == "N"), ("B", 1, layout[1] == "T")):
            operand = kwargs.get(label, args[index] if len(args) > index else None)
            if not read_columnwise or operand is None:
                continue
            tensors = operand if isinstance(operand, (list, tuple)) else [operand]
            for i, tensor in enumerate(tensors):
                self._check(site, label if len(tensors) == 1 else f"{label}[{i}]", tensor, layout)

    def _check(self, site: str, label: str, tensor: Any, layout: str) -> None:
        matches = transpose_matches(tensor)
        if matches is None:
            return
        self.compared += 1
        if matches:
            return
        read = StaleRead(site, label, self._where(tensor), layout, tuple(tensor.shape), self.gemms - 1)
        if self.action == "raise":
            raise StaleWorkspaceError(
                f"{site} was about to read a stale FP8 transpose as operand {label}"
                f"{' (' + read.where + ')' if read.where else ''}: it is flagged valid but is not the transpose "
                "of the tensor's current data (written in place since, e.g. by TE's FusedAdam, or refilled by "
                "an FSDP2 all-gather). The drop-in modules never read one (docs/decisions.md, D12); for stock "
                "modules call the tensor's _reset_caches() after each optimizer step.")
        self.reads.append(read)

    def _where(self, tensor: Any) -> str:
        if self.model is None:
            return ""
        for name, param in self.model.named_parameters():
            if param is tensor or getattr(param, "_local_tensor", None) is tensor:
                return name
        for owner, name, gathered in fsdp2_gathered_parameters(self.model):
            if gathered is tensor:
                path = next((p for p, m in self.model.named_modules() if m is owner), "")
                return f"{path}.{name}" if path else name
        return ""


def gemm_sites() -> list[tuple[Any, str, str]]:
    """``(TE module file, function name, label)`` of every GEMM call site
    of the module kinds the binding knows (TE's and te.ops's files)."""
    sites = list(getattr(te, "GEMM_SITES", ())) + list(getattr(te_ops, "GEMM_SITES", ()))
    return [(module, name, f"{module.__name__.rsplit('.', 1)[-1]}.{name}") for module, name in sites]


def check_stale_reads(model: torch.nn.Module | None = None, *, action: str = "raise"
                      ) -> contextlib.AbstractContextManager[StaleReadWatch]:
    """Watch every GEMM of TE's Linear, LayerNormLinear, LayerNormMLP,
    GroupedLinear and te.ops linear ops while the block runs: an FP8 operand
    whose transpose the GEMM reads (dgrad on Hopper) is compared with the
    transpose of its current data. ``action="raise"`` raises
    :class:`StaleWorkspaceError` at the first stale one; ``"count"`` lists
    them in the returned watch's ``reads``. ``model`` (optional) names the
    tensors in messages. Opt-in: it costs a compare per such operand."""
    if model is not None:
        expect_module("check_stale_reads", "model", model)
    if action not in ("raise", "count"):
        raise ValueError(f"check_stale_reads: action must be 'raise' or 'count'; received {action!r}.")
    return _watching(StaleReadWatch(action, model))


_ACTIVE_WATCH: list[StaleReadWatch] = []


@contextlib.contextmanager
def _watching(watch: StaleReadWatch) -> Iterator[StaleReadWatch]:
    if _ACTIVE_WATCH:
        raise RuntimeError("check_stale_reads is already active; watches do not nest")
    swapped = []
    for module, name, label in gemm_sites():
        original = getattr(module, name)
        setattr(module, name, _watched(original, label, name, watch))
        swapped.append((module, name, original))
    _ACTIVE_WATCH.append(watch)
    try:
        yield watch
    finally:
        _ACTIVE_WATCH.clear()
        for module, name, original in reversed(swapped):
            setattr(module, name, original)


def _watched(original: Any, label: str, name: str, watch: StaleReadWatch) -> Any:
    def gemm(*args: Any, **kwargs: Any) -> Any:
        watch.inspect(label, name, args, kwargs)
        return original(*args, **kwargs)

    gemm.__wrapped__ = original
    return gemm
