"""``testbed.recipes.supported_recipes``: the recipes a GPU worker runs, and
the reasons it records for the others (CPU: TE's support check stood in)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from testbed import recipes  # noqa: E402


def test_supported_recipes_yields_the_supported_in_order_and_records_the_rest(monkeypatch):
    lacking = {"MXFP8BlockScaling": "MXFP8BlockScaling: needs 10.0", "NVFP4BlockScaling": "NVFP4BlockScaling: no"}
    monkeypatch.setattr(recipes, "recipe_skip_reason", lacking.get)
    unsupported: dict = {}
    names = ["Float8CurrentScaling", "MXFP8BlockScaling", "DelayedScaling", "NVFP4BlockScaling"]
    assert list(recipes.supported_recipes(names, unsupported)) == ["Float8CurrentScaling", "DelayedScaling"]
    assert unsupported == lacking
