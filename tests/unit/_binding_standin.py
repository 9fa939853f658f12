"""Load ``te_integration``'s modules on CPU, with a stand-in for TE.

CI has no TE, and ``te_integration/te/`` (``_compat`` and ``_compat_ops``)
is the binding's only TE import. :func:`load_binding` puts a stand-in
``te._compat`` (the attributes a test gives) and ``te._compat_ops`` in
their place and loads the named binding modules from their files, without
the package ``__init__`` (which imports the real modules). Names are paths
under ``te_integration``: ``"runtime._state"``, ``"kinds"`` (every kind's
file, which registers its adapter), ``"kinds.linear"``.
"""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def load_binding(monkeypatch: Any, compat: dict[str, Any], *modules: str) -> dict[str, types.ModuleType]:
    """The binding modules ``modules`` (e.g. ``"runtime._attribution"``),
    imported in that order (with the binding modules they import) against a
    ``te._compat`` holding ``compat``, keyed by the names given.
    ``monkeypatch`` removes them all from ``sys.modules`` after the test."""
    stand_in = types.ModuleType("te_integration.te._compat")
    for name, value in compat.items():
        setattr(stand_in, name, value)
    package = types.ModuleType("te_integration")
    package.__path__ = [str(ROOT / "te_integration")]
    monkeypatch.setitem(sys.modules, "te_integration", package)
    # Every binding module imported from here on (the named ones and what
    # they import) is removed again after the test, and none is reused
    # from an earlier one: each test gets the binding made for its stand-in.
    for name in binding_module_names():
        monkeypatch.setitem(sys.modules, name, None)
        del sys.modules[name]
    monkeypatch.setitem(sys.modules, "te_integration.te._compat", stand_in)
    # te.ops's layer too (``_compat_ops``), from its own stand-in.
    import _fake_te_ops

    ops_stand_in = types.ModuleType("te_integration.te._compat_ops")
    for name, value in _fake_te_ops.compat_ops().items():
        setattr(ops_stand_in, name, value)
    monkeypatch.setitem(sys.modules, "te_integration.te._compat_ops", ops_stand_in)
    loaded = {}
    for name in modules:
        loaded[name] = importlib.import_module(f"te_integration.{name}")
    return loaded


def binding_module_names() -> list[str]:
    """Every module of the package below its root (``te_integration.runtime``,
    ``te_integration.runtime._state``, ...), as ``sys.modules`` names them."""
    names = []
    for path in sorted((ROOT / "te_integration").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        if len(parts) > 1:
            names.append(".".join(parts))
    return names
