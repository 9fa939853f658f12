"""GPU tier: needs CUDA and TransformerEngine 2.20; every test skips with a reason otherwise.

Run on a CUDA machine with TE (``pip install -e '.[te,test]'``) with ``pytest -m gpu``
(see docs/te-integration.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# testbed/recipes.py holds the recipe table the GPU tests and benchmarks share.
ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

RECIPES = ["DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling", "MXFP8BlockScaling", "NVFP4BlockScaling"]


def _environment_skip() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    try:
        import te_integration  # noqa: F401
    except ImportError as err:
        return f"TransformerEngine 2.20 is not usable here: {err}"
    return None


def recipe_skip_reason(name: str) -> str | None:
    """TE's own support check for the recipe on this GPU (None: supported)."""
    from testbed.recipes import recipe_skip_reason as skip_reason  # imports torch: not at collection

    return skip_reason(name)


def make_recipe(name: str):
    """The TE recipe object for ``name``."""
    from testbed.recipes import make_recipe as recipe_for

    return recipe_for(name)


def pytest_collection_modifyitems(config, items):
    reason = None
    for item in items:
        if "gpu" not in item.keywords:
            continue
        if reason is None:
            reason = _environment_skip() or ""
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))
