"""Drop-in TransformerEngine modules whose weight workspaces follow a policy.

``Linear``, ``LayerNormLinear``, ``LayerNormMLP`` and ``GroupedLinear`` are TE 2.20's classes
with every workspace decision (cache, forward usage, what backward gets,
what is released) taken from ``workspace_manager``'s policies; so are
``OpsBasicLinear`` and ``OpsGroupedLinear``, TE's fusible ops (``te.ops``,
also inside ``te.ops.Linear`` and ``te.ops.Sequential``). The drop-ins
read no quantized copy made from older weights (docs/decisions.md, D12,
which lists the one case not yet right); ``stale_workspaces``,
``check_stale_reads`` and ``release_workspaces`` find, watch for and free
such copies in any TE model, stock modules included. Importing
this package needs TransformerEngine 2.20.x; it raises ImportError naming
the installed and supported versions otherwise. See docs/te-integration.md.

This module exports what a user of the drop-ins calls; ``te_integration.debug``
holds what looking inside a run needs (a module's workspace state, why a
plan is refused, the seams, the TE version).
"""

from .te import _compat  # noqa: F401  (first: an unusable TE raises UnsupportedTEError here)
from .runtime import _te_quantizers  # noqa: F401  (checks TE's quantizer classes)
from . import kinds  # every kind's file registers its adapter (kinds/__init__)
from .runtime._modules import convert_model, last_plans, set_workspace_policy
from .runtime._construction import managed_construction
from .runtime._foreign_patches import ForeignPatchError
from .runtime._attribution import WorkspaceRecording, record_workspaces, workspace_report
from .runtime._model import release_step_caches
from .runtime._stale import StaleCopy, StaleKind, StaleWorkspaceError, release_workspaces, stale_workspaces
from .runtime._gemm_watch import StaleRead, StaleReadWatch, check_stale_reads
from .runtime._budget import BudgetChoice, BudgetEntry, WorkspaceBudget, apply_workspace_budget
from .runtime._gather import GatherChoice, QuantizedGatherSetup, enable_quantized_gather
from .runtime._kind_registry import register_with_explain
from . import debug
from workspace_manager.extending import moved_names

register_with_explain()  # the kinds registered above, named in explain's legend
del register_with_explain
# The drop-in classes, each kind's public names (its file's ``__all__``), in the kinds' order.
globals().update({name: getattr(kinds, name) for name in kinds.__all__})

__all__ = [
    *kinds.__all__,
    # converting a model, and which policy plans its calls
    "convert_model",
    "managed_construction",
    "set_workspace_policy",
    "last_plans",
    # copies made from older weights: found, freed, watched for
    "stale_workspaces",
    "release_workspaces",
    "release_step_caches",
    "StaleCopy",
    "StaleKind",
    "StaleWorkspaceError",
    "check_stale_reads",
    "StaleReadWatch",
    "StaleRead",
    # which quantized copies are alive, and why
    "workspace_report",
    "record_workspaces",
    "WorkspaceRecording",
    # a byte budget of kept copies
    "apply_workspace_budget",
    "WorkspaceBudget",
    "BudgetEntry",
    "BudgetChoice",
    # the quantized FSDP2 all-gather of bf16/fp32 weights (docs/decisions.md, D13)
    "enable_quantized_gather",
    "QuantizedGatherSetup",
    "GatherChoice",
    # another library patched the functions the drop-ins hook
    "ForeignPatchError",
]

#: Names this module exported before ``debug``: they still resolve, for one
#: release, with a DeprecationWarning naming ``te_integration.debug``.
_MOVED = dict.fromkeys([
    "workspace_state", "ModuleWorkspaceState", "Levers", "unsupported_reason", "ops_unsupported_reason",
    "recompute_mismatch_reason", "install_seams", "uninstall_seams", "TE_VERSION", "SUPPORTED_TE",
    "UnsupportedTEError",
], "te_integration.debug")
__getattr__, __dir__ = moved_names(__name__, _MOVED, [*__all__, "debug"])
del moved_names
