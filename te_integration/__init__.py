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
"""

from .te._compat import SUPPORTED as SUPPORTED_TE
from .te._compat import VERSION as TE_VERSION
from .te._compat import UnsupportedTEError
from .runtime import _register  # noqa: F401  (checks TE's quantizer classes)
from . import kinds  # every kind's file registers its adapter (kinds/__init__)
from .runtime._modules import convert_model, last_plans, set_workspace_policy, workspace_state
from .runtime._construction import managed_construction
from .runtime._levers import Levers
from .runtime._state import ModuleWorkspaceState
from .runtime._foreign_patches import ForeignPatchError
from .runtime._attribution import WorkspaceRecording, record_workspaces, workspace_report
from .runtime._model import release_step_caches
from .runtime._stale import StaleCopy, StaleKind, StaleWorkspaceError, release_workspaces, stale_workspaces
from .runtime._gemm_watch import StaleRead, StaleReadWatch, check_stale_reads
from .runtime._budget import BudgetChoice, BudgetEntry, WorkspaceBudget, apply_workspace_budget
from .runtime._plan_support import recompute_mismatch_reason, unsupported_reason
from .runtime._plan_support_ops import ops_unsupported_reason
from .runtime._install import install as install_seams
from .runtime._install import uninstall as uninstall_seams
from .runtime._registry import register_with_explain

register_with_explain()  # the kinds registered above, named in explain's legend
# The drop-in classes, each kind's public names (its file's ``__all__``), in the kinds' order.
globals().update({name: getattr(kinds, name) for name in kinds.__all__})

__all__ = [
    *kinds.__all__,
    "convert_model",
    "managed_construction",
    "set_workspace_policy",
    "last_plans",
    "workspace_state",
    "ModuleWorkspaceState",
    "Levers",
    "release_step_caches",
    "release_workspaces",
    "stale_workspaces",
    "check_stale_reads",
    "StaleCopy",
    "StaleKind",
    "StaleRead",
    "StaleReadWatch",
    "StaleWorkspaceError",
    "apply_workspace_budget",
    "unsupported_reason",
    "ops_unsupported_reason",
    "install_seams",
    "uninstall_seams",
    "recompute_mismatch_reason",
    "WorkspaceBudget",
    "BudgetEntry",
    "BudgetChoice",
    "workspace_report",
    "record_workspaces",
    "WorkspaceRecording",
    "UnsupportedTEError",
    "ForeignPatchError",
    "TE_VERSION",
    "SUPPORTED_TE",
]
