"""workspace_manager: explicit decisions about quantized weight workspaces.

A :class:`Policy` turns a :class:`WorkspaceContext` (one module
call) into a :class:`WorkspacePlan` (cache, forward usage, what backward
gets, what is released). The package never imports TransformerEngine; the
``te_integration`` package binds it to TE's modules.
"""

from ._context import (
    BackwardOverride,
    Microbatch,
    QuantizerCapabilities,
    RecomputePass,
    RecomputeScope,
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
    KitArgumentError,
    PolicyMismatchError,
    QuantizerPluginError,
    UnknownProfileError,
    UnknownQuantizerError,
    UnknownRecipeError,
    UnsupportedPlanError,
    WorkspaceManagerError,
)
from ._explain import ModuleKindEntry, register_module_kind, registered_module_kinds
from ._hints import install_hint
from ._fsdp2 import ShardingProbe, detect_fsdp2_sharding, fsdp2_gathered_parameters, probe_fsdp2_sharding
from .attribution import (
    Lifetime,
    LiveWorkspace,
    TimelinePoint,
    WorkspaceKind,
    WorkspaceLedger,
    WorkspaceRecord,
    WorkspaceReport,
    buffers_of,
    expected_lifetime,
    workspace_kind,
)
from ._plan import BackwardSource, CacheAction, ColumnwiseSource, Release, Usage, WorkspacePlan
from ._policy import (
    DistributedWeightWorkspacePolicy,
    FSDP2WorkspacePolicy,
    KeepForBackwardWorkspacePolicy,
    LeanWorkspacePolicy,
    MicrobatchCache,
    Policy,
    RecomputeCopy,
    RecomputeWorkspacePolicy,
    WorkspacePolicy,
)
from ._profiles import PROFILES, RECIPE_PROFILES, TE_QUANTIZER_PROFILES
from ._quantizer_registry import (
    ENTRY_POINT_GROUP,
    QuantizerRegistry,
    default_registry,
    quantizer_capabilities,
    register_quantizer,
)
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
    # the plan
    "WorkspacePlan",
    "CacheAction",
    "Usage",
    "BackwardSource",
    "ColumnwiseSource",
    "Release",
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
    "select_policy",
    "resolve_policy",
    "plan_call",
    "named_policy",
    "POLICY_NAMES",
    # attribution: who holds which quantized bytes, and why
    "WorkspaceKind",
    "Lifetime",
    "WorkspaceRecord",
    "LiveWorkspace",
    "TimelinePoint",
    "WorkspaceLedger",
    "WorkspaceReport",
    "workspace_kind",
    "expected_lifetime",
    "buffers_of",
    # detection
    "detect_fsdp2_sharding",
    "fsdp2_gathered_parameters",
    "probe_fsdp2_sharding",
    "ShardingProbe",
    # quantizer registry and TE profiles
    "QuantizerRegistry",
    "ENTRY_POINT_GROUP",
    "default_registry",
    "register_quantizer",
    "quantizer_capabilities",
    "PROFILES",
    "RECIPE_PROFILES",
    "TE_QUANTIZER_PROFILES",
    # the module kinds explain names, which bindings register
    "register_module_kind",
    "registered_module_kinds",
    "ModuleKindEntry",
    # how to install the optional parts (the te and test extras)
    "install_hint",
    # errors
    "WorkspaceManagerError",
    "InvalidContextError",
    "ContextTypeError",
    "PolicyMismatchError",
    "UnsupportedPlanError",
    "UnknownQuantizerError",
    "UnknownRecipeError",
    "UnknownProfileError",
    "DuplicateQuantizerError",
    "InvalidCapabilitiesError",
    "InvalidPlanError",
    "QuantizerPluginError",
    "KitArgumentError",
]
