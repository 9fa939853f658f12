"""Load ``te_integration``'s modules on CPU, with a stand-in for TE.

CI has no TE, and ``te_integration._compat`` is the binding's only TE import.
:func:`load_binding` puts a stand-in ``_compat`` (the attributes a test
gives) in its place and loads the named binding modules from their files,
without the package ``__init__`` (which imports the real modules).
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def load_binding(monkeypatch: Any, compat: dict[str, Any], *modules: str) -> dict[str, types.ModuleType]:
    """The binding modules ``modules`` (e.g. ``"_attribution"``), loaded in
    that order against a ``_compat`` holding ``compat``. ``monkeypatch``
    removes them all from ``sys.modules`` after the test."""
    stand_in = types.ModuleType("te_integration._compat")
    for name, value in compat.items():
        setattr(stand_in, name, value)
    package = types.ModuleType("te_integration")
    package.__path__ = [str(ROOT / "te_integration")]
    monkeypatch.setitem(sys.modules, "te_integration", package)
    monkeypatch.setitem(sys.modules, "te_integration._compat", stand_in)
    loaded = {}
    for name in modules:
        spec = importlib.util.spec_from_file_location(f"te_integration.{name}", ROOT / f"te_integration/{name}.py")
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, spec.name, module)
        spec.loader.exec_module(module)
        monkeypatch.setattr(package, name, module, raising=False)
        loaded[name] = module
    return loaded
