"""What te_integration's own tests, benchmarks and bug reports look into.

``te_integration`` exports what a user of the drop-ins calls. This module
re-exports the rest of what is worth naming, for looking inside a run:

- a managed module's workspace state (:func:`workspace_state`,
  :class:`ModuleWorkspaceState`), the state of the model it belongs to
  (``workspace_state(module).model``, a :class:`ModelWorkspaceState`: its
  drop-ins and the cache entries marked for release at its next step) and
  the TE levers a plan sets (:class:`Levers`);
- why a plan is refused for a call (:func:`unsupported_reason`,
  :func:`ops_unsupported_reason`, :func:`recompute_mismatch_reason`);
- the seams on TE's functions (:func:`install_seams`, :func:`uninstall_seams`:
  ``managed_construction`` and the first drop-in install them);
- the TransformerEngine found and the one supported (``TE_VERSION``,
  ``SUPPORTED_TE``) and the error an unusable one raises at
  ``import te_integration`` (:class:`UnsupportedTEError`, an ImportError).

Re-exports only; importing it needs TE as ``te_integration`` does.
"""

from .te._compat import SUPPORTED as SUPPORTED_TE
from .te._compat import VERSION as TE_VERSION
from .te._compat import UnsupportedTEError
from .runtime._install import install as install_seams
from .runtime._install import uninstall as uninstall_seams
from .runtime._levers import Levers
from .runtime._model import ModelWorkspaceState
from .runtime._modules import workspace_state
from .runtime._plan_support import recompute_mismatch_reason, unsupported_reason
from .runtime._plan_support_ops import ops_unsupported_reason
from .runtime._state import ModuleWorkspaceState

__all__ = [
    "workspace_state",
    "ModuleWorkspaceState",
    "ModelWorkspaceState",
    "Levers",
    "unsupported_reason",
    "ops_unsupported_reason",
    "recompute_mismatch_reason",
    "install_seams",
    "uninstall_seams",
    "TE_VERSION",
    "SUPPORTED_TE",
    "UnsupportedTEError",
]
