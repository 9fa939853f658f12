"""Reading TE's source for what the seams rely on: lines of code, the
positions of tuples TE unpacks, the fields of its argument dataclasses.
Pure functions of what they are given; ``_compat`` runs them at import."""

from __future__ import annotations

import ast
import inspect
import textwrap

__all__ = ["structure_problems"]


def _where(obj) -> str:
    """``qualname (file)`` of a TE function or class, for messages."""
    module = getattr(obj, "__module__", "") or ""
    return f"{getattr(obj, '__qualname__', obj)} ({module.replace('.', '/')}.py)"


def _source(fn) -> str | None:
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):  # a build without its Python sources
        return None


def _unpacked_names(fn, source_name: str) -> list[str]:
    """Target names of ``(...) = <source_name>`` or ``(...) = <...>.<source_name>(...)``
    in ``fn``'s source."""
    source = _source(fn)
    tree = ast.parse(textwrap.dedent(source)) if source is not None else ast.Module(body=[], type_ignores=[])
    for node in ast.walk(tree):
        if (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Tuple)
                and _is_named(node.value, source_name)):
            return [t.id for t in node.targets[0].elts if isinstance(t, ast.Name)]
    return []


def _is_named(value: ast.expr, name: str) -> bool:
    """Whether ``value`` is ``name``, ``<...>.name`` or a call of either."""
    if isinstance(value, ast.Call):
        value = value.func
    return ((isinstance(value, ast.Name) and value.id == name)
            or (isinstance(value, ast.Attribute) and value.attr == name))


def structure_problems(sentinels: dict, unpacked: tuple, fields: tuple) -> list[str]:
    """One line per way TE's code differs from what the seams rely on:
    ``sentinels`` maps a function to lines its source must contain;
    ``unpacked`` holds ``(function, source name, {name: position})`` for
    tuples a function unpacks; ``fields`` holds ``(dataclass, field names)``."""
    problems = []
    for fn, needles in sentinels.items():
        source = _source(fn)
        if source is None:
            problems.append(f"the source of {_where(fn)} cannot be read")
            continue
        problems += [f"{_where(fn)} no longer contains {n!r}" for n in needles if n not in source]
    for fn, source, table in unpacked:
        names = _unpacked_names(fn, source)
        for name, index in table.items():
            if index >= len(names) or names[index] != name:
                problems.append(f"{_where(fn)}: {source}[{index}] is no longer {name!r}")
    for cls, names in fields:
        present = getattr(cls, "__dataclass_fields__", {})
        problems += [f"{_where(cls)} has no field {name!r}" for name in names if name not in present]
    return problems
