"""Capability profiles of TE's weight quantizers, defined without importing TE.

The facts come from TE 2.20.2's tensor storage classes (``update_usage`` and
``_create_transpose`` / ``_create_columnwise`` in
``transformer_engine/pytorch/tensor/storage/*_tensor_storage.py``): which formats can derive
columnwise data from rowwise data, which keep derived data in memory they
allocate themselves, and which re-quantize exactly; and from the scales'
definitions, which can quantize an FSDP2 shard to the whole weight's bytes.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from ._context import QuantizerCapabilities
from ._errors import UnknownProfileError, UnknownRecipeError

__all__ = [
    "FLOAT8_DELAYED_SCALING",
    "FLOAT8_CURRENT_SCALING",
    "FLOAT8_BLOCK_2D",
    "FLOAT8_BLOCK_1D",
    "MXFP8",
    "NVFP4_2D",
    "NVFP4_1D",
    "HYBRID",
    "RECIPE_PROFILES",
    "RecipeProfiles",
    "ProfileTable",
    "PROFILES",
    "TE_QUANTIZER_PROFILES",
]

#: DelayedScaling weights: per-tensor FP8. The transpose is the same bytes
#: rearranged (derivable); on Hopper it is a separate buffer the quantizer
#: allocates. The scale comes from an amax history, so quantizing again after
#: the history moved can differ: not requantization-safe.
FLOAT8_DELAYED_SCALING = QuantizerCapabilities(
    name="float8_delayed_scaling", columnwise_derivable=True, derived_caches=True, requantization_safe=False
)
#: Float8CurrentScaling weights: per-tensor FP8, scale from the tensor itself.
#: A shard quantizes exactly: its amax, MAX-reduced over the shard group, is
#: the whole weight's (max is exact), and the scale is a function of it.
FLOAT8_CURRENT_SCALING = QuantizerCapabilities(
    name="float8_current_scaling", columnwise_derivable=True, derived_caches=True, requantization_safe=True,
    shard_quantization_exact=True,
)
#: Float8BlockScaling weights (128x128 blocks, TE's default for weights):
#: columnwise blocks are a local transpose of the rowwise blocks. A shard
#: quantizes exactly: the grid of block amaxes (zero where the shard has no
#: rows), MAX-reduced, is the whole weight's, wherever shard boundaries cut blocks.
FLOAT8_BLOCK_2D = QuantizerCapabilities(
    name="float8_block_2d", columnwise_derivable=True, derived_caches=True, requantization_safe=True,
    shard_quantization_exact=True,
)
#: Float8BlockScaling with ``w_block_scaling_dim=1``: each direction has its
#: own 1x128 scales and must be quantized from high precision.
FLOAT8_BLOCK_1D = QuantizerCapabilities(
    name="float8_block_1d", columnwise_derivable=False, derived_caches=False, requantization_safe=True
)
#: MXFP8BlockScaling: 1x32 scales per direction; TE 2.20.2 cannot derive one
#: direction from the other (update_usage only drops data).
MXFP8 = QuantizerCapabilities(
    name="mxfp8", columnwise_derivable=False, derived_caches=False, requantization_safe=True
)
#: NVFP4BlockScaling weights (2D 16x16 quantization, TE's default for
#: weights, no stochastic rounding).
NVFP4_2D = QuantizerCapabilities(
    name="nvfp4_2d", columnwise_derivable=True, derived_caches=True, requantization_safe=True
)
#: NVFP4 with ``NVTE_NVFP4_DISABLE_2D_QUANTIZATION=1``: 1D scales per direction.
NVFP4_1D = QuantizerCapabilities(
    name="nvfp4_1d", columnwise_derivable=False, derived_caches=False, requantization_safe=True
)
#: TE's experimental HybridQuantizer: each direction is its own storage,
#: possibly of another format, so neither can be derived from the other.
#: Conservative defaults; the TE binding refines them per instance.
HYBRID = QuantizerCapabilities(
    name="hybrid", columnwise_derivable=False, derived_caches=False, requantization_safe=False
)

def _did_you_mean(name: object, names: Iterable[str]) -> str:
    """``; did you mean 'X'?`` where ``name`` is ``X`` in another case, else ''."""
    close = [n for n in names if isinstance(name, str) and n.lower() == name.lower()]
    return f"; did you mean {close[0]!r}?" if close else ""


class RecipeProfiles(Mapping[str, QuantizerCapabilities]):
    """A read-only mapping of TE recipe class names to the capability profile
    of their weight quantizer. Looking up a name that is no recipe raises
    :class:`UnknownRecipeError` (a KeyError) naming the recipes that exist."""

    def __init__(self, profiles: Mapping[str, QuantizerCapabilities]) -> None:
        self._profiles = dict(profiles)

    def __getitem__(self, recipe: str) -> QuantizerCapabilities:
        try:
            return self._profiles[recipe]
        except (KeyError, TypeError):
            hint = _did_you_mean(recipe, self._profiles)
            raise UnknownRecipeError(
                f"{recipe!r} is no TE recipe; RECIPE_PROFILES knows {', '.join(self._profiles)} "
                f"(TE's recipe class names{hint}). For a capability profile by its own name "
                "(e.g. 'float8_block_1d') use PROFILES"
            ) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._profiles)

    def __len__(self) -> int:
        return len(self._profiles)

    def __repr__(self) -> str:
        return f"RecipeProfiles({self._profiles!r})"


#: The weight profile of each of TE's five built-in recipes.
RECIPE_PROFILES: Mapping[str, QuantizerCapabilities] = RecipeProfiles({
    "DelayedScaling": FLOAT8_DELAYED_SCALING,
    "Float8CurrentScaling": FLOAT8_CURRENT_SCALING,
    "Float8BlockScaling": FLOAT8_BLOCK_2D,
    "MXFP8BlockScaling": MXFP8,
    "NVFP4BlockScaling": NVFP4_2D,
})

class ProfileTable(dict[str, QuantizerCapabilities]):
    """A dict of capability profiles by their names. Looking up a name that
    is no profile raises :class:`UnknownProfileError` (a KeyError) naming
    the profiles, and ``RECIPE_PROFILES`` where the name is a TE recipe's."""

    def __missing__(self, name: object) -> QuantizerCapabilities:
        if isinstance(name, str) and name in RECIPE_PROFILES:
            hint = f"; {name} is a TE recipe: its weight profile is RECIPE_PROFILES[{name!r}]"
        else:
            hint = _did_you_mean(name, self)
        raise UnknownProfileError(f"{name!r} is no capability profile; PROFILES knows {', '.join(self)}{hint}")


#: Every profile defined here, by name.
PROFILES: dict[str, QuantizerCapabilities] = ProfileTable(
    (p.name, p)
    for p in (
        FLOAT8_DELAYED_SCALING,
        FLOAT8_CURRENT_SCALING,
        FLOAT8_BLOCK_2D,
        FLOAT8_BLOCK_1D,
        MXFP8,
        NVFP4_2D,
        NVFP4_1D,
        HYBRID,
    )
)


def _float8_block(quantizer: Any) -> QuantizerCapabilities:
    return FLOAT8_BLOCK_2D if getattr(quantizer, "block_scaling_dim", 2) == 2 else FLOAT8_BLOCK_1D


def _nvfp4(quantizer: Any) -> QuantizerCapabilities:
    base = NVFP4_2D if getattr(quantizer, "with_2d_quantization", True) else NVFP4_1D
    if getattr(quantizer, "stochastic_rounding", False):
        return QuantizerCapabilities(
            name=base.name + "_stochastic",
            columnwise_derivable=base.columnwise_derivable,
            derived_caches=base.derived_caches,
            requantization_safe=False,
        )
    return base


_TE_TENSOR = "transformer_engine.pytorch.tensor"

#: TE 2.20's quantizer classes by qualified name, so the core can describe
#: them without importing TE; ``te_integration`` checks at import that each
#: name still resolves in the installed TE.
TE_QUANTIZER_PROFILES: dict[str, Any] = {
    f"{_TE_TENSOR}.float8_tensor.Float8Quantizer": FLOAT8_DELAYED_SCALING,
    f"{_TE_TENSOR}.float8_tensor.Float8CurrentScalingQuantizer": FLOAT8_CURRENT_SCALING,
    f"{_TE_TENSOR}.float8_blockwise_tensor.Float8BlockQuantizer": _float8_block,
    f"{_TE_TENSOR}.mxfp8_tensor.MXFP8Quantizer": MXFP8,
    f"{_TE_TENSOR}.nvfp4_tensor.NVFP4Quantizer": _nvfp4,
    f"{_TE_TENSOR}.hybrid_tensor.HybridQuantizer": HYBRID,
}
