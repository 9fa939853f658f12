"""How many examples a costly drawn test takes, from the Hypothesis profile.

``tests/conftest.py`` loads the profile: ``dev`` by default, ``ci`` under
``CI=true``, ``thorough`` (``HYPOTHESIS_PROFILE=thorough``) for a deep run
before a release. A test that Hypothesis runs once per enumerated case, or
whose every example is a whole training run, takes a share of the profile's
``max_examples`` instead of all of it, so that the deep run deepens it too.
"""

from __future__ import annotations

from hypothesis import settings

__all__ = ["scaled"]


def scaled(share: float, *, at_least: int = 1) -> int:
    """``share`` of the loaded profile's ``max_examples``, and at least ``at_least``."""
    return max(at_least, round(settings.default.max_examples * share))
