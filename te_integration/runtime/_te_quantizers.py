"""TE's weight quantizers in the registry, checked against the installed TE.

The core already describes TE's quantizers by qualified name
(``workspace_manager.extending.TE_QUANTIZER_PROFILES``); here each name must
resolve to a class of the installed TE, and the hybrid quantizer gets
capabilities computed from its two sub-quantizers.
"""

from __future__ import annotations

import importlib

from workspace_manager import QuantizerCapabilities
from workspace_manager.extending import default_registry, quantizer_capabilities, TE_QUANTIZER_PROFILES

from ..te._compat import VERSION, UnsupportedTEError

_HYBRID = "transformer_engine.pytorch.tensor.hybrid_tensor.HybridQuantizer"


def _resolve(qualified: str) -> type:
    module_name, _, cls_name = qualified.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), cls_name)
    except (ImportError, AttributeError) as err:
        raise UnsupportedTEError(
            f"TransformerEngine {VERSION} has no quantizer class {qualified}, which the workspace "
            f"manager's TE profiles describe ({err})."
        ) from err


def _hybrid(quantizer) -> QuantizerCapabilities:
    """Hybrid formats keep each direction in its own storage, so columnwise
    data is never derived from rowwise data; requantization is exact only if
    both sub-quantizers' is."""
    row = quantizer_capabilities(quantizer.rowwise_quantizer)
    col = quantizer_capabilities(quantizer.columnwise_quantizer)
    return QuantizerCapabilities(
        name=f"hybrid({row.name}|{col.name})",
        columnwise_derivable=False,
        derived_caches=col.derived_caches,
        requantization_safe=bool(quantizer.is_requantization_safe()),
    )


def check_te_quantizers() -> None:
    for qualified in TE_QUANTIZER_PROFILES:
        _resolve(qualified)
    default_registry.register(_HYBRID, _hybrid, override=True, origin="te_integration (hybrid sub-quantizers)")


check_te_quantizers()
