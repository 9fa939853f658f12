"""Test-wide settings: Hypothesis profiles and the gpu/distributed tiers.

HYPOTHESIS_PROFILE=ci (the default under CI=true) is derandomized, so a CI
run is a regression test; ``dev`` (the default otherwise) draws anew on each
run. Both draw 100 examples per property, so that the README's test command
takes about two minutes on two cores. ``thorough`` draws 30 times as many
(and 120 plans per setting in the drawn-plan tests, ``unit/_examples.py``):
the deep run before a release, ``HYPOTHESIS_PROFILE=thorough python3 -m pytest -q``.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile("ci", derandomize=True, max_examples=100, deadline=None, print_blob=True)
settings.register_profile("dev", max_examples=100, deadline=None)
settings.register_profile(
    "thorough",
    max_examples=3000,
    stateful_step_count=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
_default = "ci" if os.environ.get("CI") else "dev"
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", _default))
