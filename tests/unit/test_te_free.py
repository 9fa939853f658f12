"""The core must import and plan with TransformerEngine unavailable."""

from __future__ import annotations

import subprocess
import sys

CODE = r"""
import sys
sys.modules["transformer_engine"] = None  # any import of TE now raises ImportError
import workspace_manager, workspace_manager.__main__, workspace_manager.testing
import workspace_manager.testing.strategies, workspace_manager.testing.lifecycle, workspace_manager.testing.reference
import workspace_manager.gather  # the quantized FSDP2 all-gather: torch only
from workspace_manager import WorkspaceContext, select_policy, RECIPE_PROFILES
for caps in RECIPE_PROFILES.values():
    select_policy(WorkspaceContext(capabilities=caps)).plan(WorkspaceContext(capabilities=caps))
loaded = [m for m in sys.modules if m.startswith("transformer_engine") and sys.modules[m] is not None]
assert not loaded, loaded
print("ok")
"""


def test_core_imports_and_plans_without_transformer_engine():
    result = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
