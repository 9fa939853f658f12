"""Test-wide settings: Hypothesis profiles, the gpu/distributed tiers, and the
workers of the whole suite.

The whole suite (``python3 -m pytest -q``, no paths given) runs on every
core, with pytest-xdist (the test extra installs it): one worker per core,
so that two cores take about three minutes. A run of some paths, of the GPU
tier (``-m gpu``: one GPU for every test), with ``-n`` given or without
pytest-xdist runs in one process as pytest does by default.

HYPOTHESIS_PROFILE=ci (the default under CI=true) is derandomized, so a CI
run is a regression test; ``dev`` (the default otherwise) draws anew on each
run. Both draw 100 examples per property, so that the README's test command
takes about three minutes on two cores. ``thorough`` draws 30 times as many
(and 120 plans per setting in the drawn-plan tests, ``unit/_examples.py``):
the deep run before a release, ``HYPOTHESIS_PROFILE=thorough python3 -m pytest -q``.
"""

from __future__ import annotations

import os

import pytest
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


def _runs_on_every_core(config: pytest.Config) -> bool:
    """The whole CPU suite, as the README's command runs it, where pytest-xdist is there and no ``-n`` was given."""
    whole = getattr(config, "args_source", None) == pytest.Config.ArgsSource.TESTPATHS
    worker = "PYTEST_XDIST_WORKER" in os.environ  # a worker runs its share: it starts no workers of its own
    return (whole and not worker and config.pluginmanager.hasplugin("xdist")
            and config.getoption("numprocesses", None) is None
            and "gpu" not in (config.getoption("markexpr") or "") and not config.getoption("collectonly"))


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    if _runs_on_every_core(config):
        config.option.numprocesses = "auto"  # pytest-xdist makes it one worker per core, in its own hook after this
