"""For those who extend the workspace manager: bindings, quantizer plugins, tools.

A user of the package plans calls, pins policies and registers a quantizer
with what ``workspace_manager`` exports. This module holds what a binding to
a framework (``te_integration`` is one) or a plugin author needs beyond
that:

- the quantizer registry itself: :class:`QuantizerRegistry`,
  :data:`default_registry`, the plugins' entry-point group
  (:data:`ENTRY_POINT_GROUP`) and the lookup a binding makes for each call
  (:func:`quantizer_capabilities`);
- the capability profiles by their own names (:data:`PROFILES`, whose
  unknown names raise :class:`UnknownProfileError`) and by TE's quantizer
  class names (:data:`TE_QUANTIZER_PROFILES`);
- the module kinds ``explain`` names, which a binding registers
  (:func:`register_module_kind`, :func:`registered_module_kinds`,
  :class:`ModuleKindEntry`);
- FSDP2 sharding detection, which fills ``WorkspaceContext.sharding``
  (:func:`detect_fsdp2_sharding`, :func:`probe_fsdp2_sharding` and its
  :class:`ShardingProbe`), and FSDP2's own records of the parameters it
  manages (:func:`fsdp2_parameters`, each an :class:`FSDP2Parameter`: the
  sharded parameter an optimizer holds and the unsharded one a module
  computes with; :func:`fsdp2_gathered_parameters`);
- why a weight's workspace cannot be made from its FSDP2 shard bit for bit
  as TE makes it in the call (:func:`shard_gather_refusal`), which a
  binding asks before it sets up a quantized all-gather;
- the one wording of the install hint messages give (:func:`install_hint`);
- a package's ``__getattr__`` and ``__dir__`` for public names that moved
  (:func:`moved_names`), as this package's and ``te_integration``'s use.

Workspace attribution has its own subpackage, ``workspace_manager.attribution``,
and the quantizer testing kit ``workspace_manager.testing``. Re-exports only:
each name is defined in a private module of the package.
"""

from ._errors import UnknownProfileError
from ._explain import ModuleKindEntry, register_module_kind, registered_module_kinds
from ._fsdp2 import (
    FSDP2Parameter,
    ShardingProbe,
    detect_fsdp2_sharding,
    fsdp2_gathered_parameters,
    fsdp2_parameters,
    probe_fsdp2_sharding,
)
from ._hints import install_hint
from ._moved import moved_names
from ._policy import shard_gather_refusal
from ._profiles import PROFILES, TE_QUANTIZER_PROFILES
from ._quantizer_registry import ENTRY_POINT_GROUP, QuantizerRegistry, default_registry, quantizer_capabilities

__all__ = [
    # the quantizer registry
    "QuantizerRegistry",
    "default_registry",
    "ENTRY_POINT_GROUP",
    "quantizer_capabilities",
    # capability profiles by name
    "PROFILES",
    "TE_QUANTIZER_PROFILES",
    "UnknownProfileError",
    # the module kinds explain names, which bindings register
    "register_module_kind",
    "registered_module_kinds",
    "ModuleKindEntry",
    # FSDP2 sharding detection
    "detect_fsdp2_sharding",
    "probe_fsdp2_sharding",
    "ShardingProbe",
    "fsdp2_gathered_parameters",
    "fsdp2_parameters",
    "FSDP2Parameter",
    # the quantized all-gather's exactness
    "shard_gather_refusal",
    # the install hint, and names that moved
    "install_hint",
    "moved_names",
]
