"""How to install this project's optional parts: one wording for every message that says so.

No package index serves the project; it is installed from a clone of its
repository, so a hint names the command that works there: an editable
install with the extras of ``[project.optional-dependencies]``. Installing
the ``te`` extra also replaces a TransformerEngine of another version with
a supported one, so the same hint serves a missing TE and a wrong one.
"""

from __future__ import annotations

import re

__all__ = ["install_hint"]

#: ``te``, ``test``, ``te,test,bench``: extra names, comma-separated.
_EXTRAS = re.compile(r"[a-z][a-z0-9_-]*(,[a-z][a-z0-9_-]*)*")


def install_hint(extras: str) -> str:
    """The command that installs this project with ``extras`` (e.g. ``"te"``
    or ``"te,test"``), and where to run it: a clone of the repository."""
    if not isinstance(extras, str) or not _EXTRAS.fullmatch(extras):
        raise ValueError(f"extras must be comma-separated extra names such as 'te' or 'te,test'; received {extras!r}")
    return f"`python3 -m pip install -e '.[{extras}]'` in a clone of the te-workspace-manager repository"
