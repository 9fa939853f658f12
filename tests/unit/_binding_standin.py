"""Load ``te_integration``'s modules on CPU, with a stand-in for TE.

CI has no TE, and ``te_integration._compat`` is the binding's only TE import.
:func:`load_binding` puts a stand-in ``_compat`` (the attributes a test
gives) in its place and loads the named binding modules from their files,
without the package ``__init__`` (which imports the real modules).
"""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def load_binding(monkeypatch: Any, compat: dict[str, Any], *modules: str) -> dict[str, types.ModuleType]:
    """The binding modules ``modules`` (e.g. ``"_attribution"``), imported in
    that order (with the binding modules they import) against a ``_compat``
    holding ``compat``. ``monkeypatch`` removes them all from ``sys.modules``
    after the test."""
    stand_in = types.ModuleType("te_integration._compat")
    for name, value in compat.items():
        setattr(stand_in, name, value)
    package = types.ModuleType("te_integration")
    package.__path__ = [str(ROOT / "te_integration")]
    monkeypatch.setitem(sys.modules, "te_integration", package)
    # Every binding module imported from here on (the named ones and what
    # they import) is removed again after the test, and none is reused
    # from an earlier one: each test gets the binding made for its stand-in.
    for path in sorted((ROOT / "te_integration").glob("_*.py")):
        monkeypatch.setitem(sys.modules, f"te_integration.{path.stem}", None)
        del sys.modules[f"te_integration.{path.stem}"]
    monkeypatch.setitem(sys.modules, "te_integration._compat", stand_in)
    # te.ops's layer too (``_compat_ops``), from its own stand-in.
    import _fake_te_ops

    ops_stand_in = types.ModuleType("te_integration._compat_ops")
    for name, value in _fake_te_ops.compat_ops().items():
        setattr(ops_stand_in, name, value)
    monkeypatch.setitem(sys.modules, "te_integration._compat_ops", ops_stand_in)
    loaded = {}
    for name in modules:
        module = importlib.import_module(f"te_integration.{name}")
        monkeypatch.setattr(package, name, module, raising=False)
        loaded[name] = module
    return loaded
