"""The optional dependencies of the testing helpers, with an install hint."""

from __future__ import annotations

import importlib.util

from .._hints import install_hint

__all__ = ["require_hypothesis", "TEST_EXTRA_HINT"]

#: How to get everything ``workspace_manager.testing`` can use.
TEST_EXTRA_HINT = install_hint("test")


def require_hypothesis(module: str) -> None:
    """Raise an ImportError that says how to install Hypothesis, which
    ``module`` (a ``workspace_manager.testing`` submodule) needs, if it is
    missing. The kit itself (``check_quantizer``) does not need it."""
    try:
        found = importlib.util.find_spec("hypothesis") is not None
    except (ImportError, ValueError):  # a blocked or half-imported package
        found = False
    if not found:
        raise ImportError(
            f"{module} needs Hypothesis, which is not installed. Install the test extra: {TEST_EXTRA_HINT} "
            "(or pip install hypothesis). check_quantizer and the rest of workspace_manager.testing work "
            "without it.",
            name="hypothesis",
        )
