"""workspace_manager: explicit decisions about quantized weight workspaces.

A :class:`Policy` turns a :class:`WorkspaceContext` (one module
call) into a :class:`WorkspacePlan` (cache, forward usage, what backward
gets, what is released). The package never imports TransformerEngine; the
``te_integration`` package binds it to TE's modules.

This module exports what a user calls: the call and plan vocabulary, the
policies and how one is chosen, :func:`explain`, registering a quantizer,
TE's recipe profiles and the errors. For extenders, ``workspace_manager.extending``
(the registry, profiles by name, module kinds, FSDP2 detection);
workspace attribution is ``workspace_manager.attribution``, the quantizer
testing kit ``workspace_manager.testing``.
"""

from ._context import (
    BackwardOverride,
    Microbatch,
    QuantizerCapabilities,
    RecomputePass,
    RecomputeScope,
    ShardGather,
    Sharding,
    WeightSource,
    WorkspaceContext,
)
from ._errors import (
    ContextTypeError,
    DuplicateQuantizerError,
    InvalidCapabilitiesError,
    InvalidContextError,
    InvalidPlanError,
    PolicyMismatchError,
    QuantizerPluginError,
    UnknownPolicyError,
    UnknownQuantizerError,
    UnknownRecipeError,
    UnsupportedPlanError,
    WorkspaceManagerError,
)
from . import attribution, extending
from ._explain_layout import explain
from ._moved import moved_names
from ._plan import BackwardSource, CacheAction, ColumnwiseSource, Release, Usage, WorkspaceOrigin, WorkspacePlan
from ._policy import (
    DistributedWeightWorkspacePolicy,
    FSDP2WorkspacePolicy,
    KeepForBackwardWorkspacePolicy,
    LeanWorkspacePolicy,
    MicrobatchCache,
    Policy,
    QuantizedGather,
    RecomputeCopy,
    RecomputeWorkspacePolicy,
    WorkspacePolicy,
)
from ._profiles import RECIPE_PROFILES
from ._quantizer_registry import register_quantizer
from ._selection import (
    POLICY_NAMES,
    named_policy,
    plan_call,
    resolve_policy,
    select_policy,
)

__version__ = "0.1.0"

__all__ = [
    # the call, as a policy sees it
    "WorkspaceContext",
    "QuantizerCapabilities",
    "Sharding",
    "RecomputePass",
    "RecomputeScope",
    "WeightSource",
    "Microbatch",
    "BackwardOverride",
    "ShardGather",
    # the plan
    "WorkspacePlan",
    "CacheAction",
    "Usage",
    "BackwardSource",
    "ColumnwiseSource",
    "Release",
    "WorkspaceOrigin",
    # policies: what every policy provides, then the shipped ones
    "Policy",
    "WorkspacePolicy",
    "FSDP2WorkspacePolicy",
    "LeanWorkspacePolicy",
    "KeepForBackwardWorkspacePolicy",
    "RecomputeWorkspacePolicy",
    "DistributedWeightWorkspacePolicy",
    "MicrobatchCache",
    "RecomputeCopy",
    "QuantizedGather",
    "select_policy",
    "resolve_policy",
    "plan_call",
    "named_policy",
    "POLICY_NAMES",
    # the decision table
    "explain",
    # a quantizer of one's own, and TE's recipes
    "register_quantizer",
    "RECIPE_PROFILES",
    # errors
    "WorkspaceManagerError",
    "InvalidContextError",
    "ContextTypeError",
    "PolicyMismatchError",
    "UnsupportedPlanError",
    "UnknownPolicyError",
    "UnknownQuantizerError",
    "UnknownRecipeError",
    "DuplicateQuantizerError",
    "InvalidCapabilitiesError",
    "InvalidPlanError",
    "QuantizerPluginError",
]

#: Names this module exported before ``extending`` and the narrow top level:
#: they still resolve, for one release, with a DeprecationWarning naming
#: their new module.
_MOVED = {
    **dict.fromkeys([
        "QuantizerRegistry", "ENTRY_POINT_GROUP", "default_registry", "quantizer_capabilities", "PROFILES",
        "TE_QUANTIZER_PROFILES", "UnknownProfileError", "register_module_kind", "registered_module_kinds",
        "ModuleKindEntry", "install_hint", "detect_fsdp2_sharding", "fsdp2_gathered_parameters",
        "probe_fsdp2_sharding", "ShardingProbe",
    ], "workspace_manager.extending"),
    **dict.fromkeys([
        "WorkspaceKind", "Lifetime", "WorkspaceRecord", "LiveWorkspace", "TimelinePoint", "WorkspaceLedger",
        "WorkspaceReport", "workspace_kind", "expected_lifetime", "buffers_of",
    ], "workspace_manager.attribution"),
    "KitArgumentError": "workspace_manager.testing",
}
#: te_integration's runtime still imports some of them from here; it moves to
#: the new modules when it is next reworked, and until then importing
#: te_integration must not warn its users about the package's own imports.
__getattr__, __dir__ = moved_names(
    __name__, _MOVED, [*__all__, "attribution", "extending", "testing"])
del moved_names
