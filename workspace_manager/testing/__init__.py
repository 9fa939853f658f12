"""Testing helpers shipped with workspace_manager: the kit quantizer authors run.

- :func:`check_quantizer`: checks a quantizer (through the small
  :class:`QuantizerUnderTest` protocol) against its capability claims, every
  policy invariant, and the workspace lifecycle on its real bytes. Returns a
  :class:`QuantizerReport`; arguments it cannot use raise
  :class:`KitArgumentError`. See ``docs/extending.md``.
- ``workspace_manager.testing.reference``: a per-tensor FP8 reference
  quantizer in plain PyTorch that passes the kit.
- ``workspace_manager.testing.invariants``: the policy invariants, as plain
  functions.
- ``workspace_manager.testing.strategies``: Hypothesis strategies (needs hypothesis).
- ``workspace_manager.testing.lifecycle``: the workspace lifecycle state machine (needs hypothesis).
- This module: the kit, the reference runtime and the fake quantizer, which
  need nothing beyond the package.
"""

from .._errors import KitArgumentError
from ._adapter import QuantizerAdapter, QuantizerRuntime
from ._kit import DEFAULT_SHAPES, check_quantizer
from ._model import FakeQuantizer, FakeWorkspace, Freshness, ModuleRuntime, RuntimeModelError, WeightWrite
from ._protocol import QuantizerUnderTest
from ._report import CheckResult, CheckStatus, QuantizerCheckError, QuantizerReport
from ._session import LifecycleSession

__all__ = [
    # the kit
    "check_quantizer",
    "DEFAULT_SHAPES",
    "QuantizerUnderTest",
    "QuantizerReport",
    "CheckResult",
    "CheckStatus",
    "QuantizerCheckError",
    "KitArgumentError",
    # the reference runtime
    "FakeQuantizer",
    "FakeWorkspace",
    "ModuleRuntime",
    "RuntimeModelError",
    "Freshness",
    "WeightWrite",
    "QuantizerAdapter",
    "QuantizerRuntime",
    "LifecycleSession",
]
