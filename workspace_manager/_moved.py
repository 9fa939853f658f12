"""Names that moved to another module: one more release at the old place, with a warning.

A package whose public names moved gives its ``__init__`` the two functions
:func:`moved_names` makes: ``__getattr__`` finds a moved name in its new
module, warns (``DeprecationWarning``, naming the new place, attributed to
the line that used the old one) and returns the very object; ``__dir__``
lists only the current public names. The moved names are not bound in the
package itself, so every use of one goes through ``__getattr__``.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

__all__ = ["moved_names"]


def moved_names(
    package: str, moved: Mapping[str, str], public: Iterable[str], *, quiet_importers: tuple[str, ...] = ()
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``, whose names ``moved`` maps
    to their new modules (``{"default_registry": "workspace_manager.extending"}``)
    and whose current public names are ``public``. Modules whose names start
    with one of ``quiet_importers`` get a moved name without a warning (code
    of the project's own that moves with a later change)."""
    listed = sorted(public)

    def __getattr__(name: str) -> Any:
        home = moved.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home), name)
        # ``from package import name`` asks twice: importlib's hasattr, then
        # the import statement itself, which is the one that warns.
        importer = sys._getframe(1).f_globals.get("__name__", "")
        if not importer.startswith(("importlib.", *quiet_importers)):
            warnings.warn(
                f"{package}.{name} has moved to {home}.{name}; import it from {home} "
                f"(the old name will be removed in the next release)",
                DeprecationWarning, stacklevel=2,
            )
        return value

    def __dir__() -> list[str]:
        return list(listed)

    return __getattr__, __dir__
