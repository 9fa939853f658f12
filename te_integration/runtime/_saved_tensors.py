"""What TE's autograd ctx saves of a workspace whose backward reads only
its columnwise data (docs/decisions.md, D11).

TE saves a fresh workspace whole, rowwise and columnwise data, although
dgrad reads only the columnwise data. The rowwise tensors are found when
the workspace is made (:func:`rowwise_parts`, called by the
``quantize_weight`` seam: TE's ``prepare_for_saving`` empties the storage
before its forward returns) and left out of what the ctx saves once TE's
forward returned (:func:`save_columnwise_only`).
"""

from __future__ import annotations

from ..te import _compat as te

__all__ = ["PER_TENSOR_LAYOUTS", "rowwise_parts", "save_columnwise_only"]

#: Storage classes seen with the per-tensor layout (``_data``, ``_transpose``,
#: ``_transpose_invalid``); the seam reads those inline.
PER_TENSOR_LAYOUTS: set[type] = set()


def rowwise_parts(workspace) -> list:
    """The tensors only rowwise reads of ``workspace`` need, where its
    columnwise data exists apart from them (TE 2.20.2's storages: FP8
    ``_data`` next to a valid ``_transpose``; block/MX/NVFP4
    ``_rowwise_data`` and ``_rowwise_scale_inv`` next to ``_columnwise_data``;
    a grouped weight's ``rowwise_data`` next to its ``columnwise_data``).
    Per-tensor FP8's ``_scale_inv`` serves both, so it stays."""
    transpose = getattr(workspace, "_transpose", None)
    if transpose is not None and not getattr(workspace, "_transpose_invalid", False):
        data = getattr(workspace, "_data", None)
        if data is not None and isinstance(workspace, te.QuantizedTensorStorage):  # a TE class: one layout
            PER_TENSOR_LAYOUTS.add(type(workspace))
        return [data] if data is not None else []
    if getattr(workspace, "_columnwise_data", None) is not None:
        return [t for t in (getattr(workspace, "_rowwise_data", None), getattr(workspace, "_rowwise_scale_inv", None))
                if t is not None]
    if isinstance(workspace, te.GroupedTensorStorage) and workspace.columnwise_data is not None:
        # A grouped weight: its rowwise scales serve columnwise reads only
        # where the columnwise data has none of its own.
        parts = [workspace.rowwise_data]
        if workspace.columnwise_scale_inv is not None:
            parts.append(workspace.scale_inv)
        return [t for t in parts if t is not None]
    return []


def save_columnwise_only(ctx, parts: list) -> None:
    """Leave ``parts`` (see :func:`rowwise_parts`) out of what ``ctx`` saves
    for backward. TE's storages were split into their tensors by
    ``prepare_for_saving`` and handed to ``ctx.save_for_backward``, which
    keeps them in torch's ``ctx.to_save`` until the forward returns; a None
    in a rowwise slot restores as a storage without rowwise data, as
    ``update_usage(rowwise_usage=False)`` would leave it. The memory is freed
    when this forward returns; the GEMM that read it was queued first on the
    same stream."""
    saved = getattr(ctx, "to_save", None)
    if not saved:
        return
    if len(parts) == 1:  # per-tensor FP8: its data only (list comprehensions are inlined: no calls)
        part = parts[0]
        ctx.to_save = tuple([None if t is part else t for t in saved])
        return
    # Several parts (block formats, GroupedLinear's experts): TE saves them
    # in the order they were made, so one walk finds them, with no call per
    # tensor; parts found out of that order are looked up by identity.
    result, found, count = list(saved), 0, len(parts)
    for i in range(len(result)):
        if found < count and result[i] is parts[found]:
            result[i] = None
            found += 1
    if found < count:
        drop = {id(t) for t in parts}
        result = [None if t is not None and id(t) in drop else t for t in result]
    ctx.to_save = tuple(result)
