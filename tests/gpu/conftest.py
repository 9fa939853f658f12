"""GPU tier: needs CUDA and TransformerEngine 2.20; every test skips with a reason otherwise.

Run on a CUDA machine with TE (``pip install -e '.[te,test]'``) with ``pytest -m gpu``
(see docs/te-integration.md).
"""

from __future__ import annotations

import pytest

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
    from transformer_engine.pytorch import quantization as q

    check = {
        "DelayedScaling": q.check_fp8_support,
        "Float8CurrentScaling": q.check_fp8_support,
        "Float8BlockScaling": q.check_fp8_block_scaling_support,
        "MXFP8BlockScaling": q.check_mxfp8_support,
        "NVFP4BlockScaling": q.check_nvfp4_support,
    }[name]
    ok, reason = check()
    return None if ok else f"{name}: {reason}"


def make_recipe(name: str):
    from transformer_engine.common import recipe

    return getattr(recipe, name)()


def pytest_collection_modifyitems(config, items):
    reason = None
    for item in items:
        if "gpu" not in item.keywords:
            continue
        if reason is None:
            reason = _environment_skip() or ""
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))
