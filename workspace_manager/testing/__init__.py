"""Testing helpers shipped with workspace_manager.

- ``workspace_manager.testing.strategies``: Hypothesis strategies (needs hypothesis).
- ``workspace_manager.testing.lifecycle``: the workspace lifecycle state machine (needs hypothesis).
- This module: the reference runtime and fake quantizer, which need nothing extra.
"""

from ._model import FakeQuantizer, FakeWorkspace, ModuleRuntime, RuntimeModelError

__all__ = ["FakeQuantizer", "FakeWorkspace", "ModuleRuntime", "RuntimeModelError"]
