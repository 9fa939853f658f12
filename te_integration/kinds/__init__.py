"""One module per kind: each file here makes its kind's ``ModuleKind``,
defines its drop-in class(es) and registers its one ``Adapter``
(``runtime/_kind_registry``).

Importing this package imports every module in it (``pkgutil``), so a new
kind's file registers by existing. A kind file's ``__all__`` names its
public drop-in classes, and only those: they become this package's
``__all__``, in the kinds' order (``Adapter.order``), and te_integration
exports them under the same names.
"""

from __future__ import annotations

import importlib
import pkgutil

from ..runtime._kind_registry import adapters



def _import_kinds() -> list[str]:
    """Import every kind's file; bind and return their public drop-in names."""
    modules = [importlib.import_module(f"{__name__}.{info.name}") for info in pkgutil.iter_modules(__path__)]
    position = {adapter.drop_in.__module__: i for i, adapter in enumerate(adapters())}
    names = []
    for module in sorted(modules, key=lambda module: position.get(module.__name__, len(position))):
        for name in module.__all__:
            globals()[name] = getattr(module, name)
            names.append(name)
    return names


__all__ = _import_kinds()
