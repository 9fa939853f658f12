"""A custom TE weight quantizer, registered with its workspace capabilities.

``ExamplePerTensorFP8Quantizer`` is TE 2.20's pure-Python reference
quantizer for per-tensor current-scaling FP8
(``transformer_engine.pytorch.custom_recipes.reference_current_scaling.
CurrentScalingQuantizerRef``) under a class name of its own, E4M3 by default.
Being Python, it reaches TE only through TE's "custom" path: its ``custom``
property is True, so ``Linear`` marks the call custom (linear.py:2459) and
``general_gemm`` hands GEMMs with custom operands to ``custom_gemm``
(cpp_extensions/gemm.py:246-261), which calls the ``qgemm`` of the activation
or gradient operand's quantizer, TE's reference one (custom_recipes/gemm.py:
70-76). No C++ code ever checks the weight quantizer's exact type.

Its capabilities, read from TE 2.20.2's reference_current_scaling.py:

- ``columnwise_derivable=True``: one per-tensor scale. ``_quantize`` builds
  the columnwise data as the transpose of the rowwise FP8 data with the same
  scale (lines 320-327), and ``update_usage(columnwise_usage=True)`` derives
  it the same way (``_create_transpose``, lines 140-145). A direct columnwise
  quantization and a derived one are the same bytes.
- ``derived_caches=True``: the derived transpose is a new tensor the storage
  allocates (line 144); nothing outside the storage owns it, so it lives
  until someone drops it.
- ``requantization_safe=True``: the scale comes from the tensor's own amax
  on every call (``compute_scale``, lines 239-261 and 312-318); there is no
  amax history, and rounding is deterministic.

``qfactory(role)`` returns this quantizer for weights and TE's own reference
quantizer (``current_scaling_ref_factory``) for every other role. The other
roles must be custom too: TE's custom GEMM refuses a custom operand paired
with a built-in one (custom_recipes/gemm.py:51-52).

Importing this module needs TransformerEngine 2.20 for PyTorch (and so a
CUDA machine); without it, it raises ImportError saying so.
"""

from __future__ import annotations

from typing import Any

from workspace_manager import QuantizerCapabilities, register_quantizer
from workspace_manager.extending import install_hint

try:
    import torch
    from transformer_engine.pytorch.custom_recipes.reference_current_scaling import (
        CurrentScalingQuantizerRef,
        current_scaling_ref_factory,
    )
except (ImportError, OSError) as err:  # OSError: TE's compiled extension failed to load
    raise ImportError(
        "examples.custom_quantizer needs TransformerEngine 2.20 for PyTorch, whose custom-recipe "
        f"reference quantizer it subclasses; importing it failed ({type(err).__name__}: {err}). "
        f"Run the example on a CUDA machine with TE installed: {install_hint('te')}."
    ) from None  # the message names the error: one exception, not a chain of two

__all__ = ["EXAMPLE_CAPABILITIES", "ExamplePerTensorFP8Quantizer", "qfactory", "make_recipe"]

#: What the workspace manager's policies need to know about the format (see
#: the module docstring for where each fact comes from in TE's code).
EXAMPLE_CAPABILITIES = QuantizerCapabilities(
    name="example_per_tensor_fp8",
    columnwise_derivable=True,
    derived_caches=True,
    requantization_safe=True,
)


@register_quantizer(capabilities=EXAMPLE_CAPABILITIES)
class ExamplePerTensorFP8Quantizer(CurrentScalingQuantizerRef):
    """Per-tensor current-scaling FP8 (E4M3 by default) for weights.

    All behaviour is TE's reference implementation; the subclass gives the
    format a name of its own, so the registry (which walks the class
    hierarchy) maps exactly this class to :data:`EXAMPLE_CAPABILITIES`.
    """

    def __init__(
        self,
        dtype: torch.dtype = torch.float8_e4m3fn,
        *,
        rowwise: bool = True,
        columnwise: bool = True,
        pow_2_scales: bool = False,
        eps: float = 0.0,
    ) -> None:
        super().__init__(dtype=dtype, rowwise=rowwise, columnwise=columnwise, pow_2_scales=pow_2_scales, eps=eps)


def qfactory(role: Any) -> Any:
    """The ``CustomRecipe`` quantizer factory: the example quantizer for
    weights, TE's reference current-scaling quantizer for the other roles
    (E5M2 for ``grad_output``, E4M3 otherwise; ``role`` may be None for the
    output and grad-input slots)."""
    if role is not None and role.tensor_type == "weight":
        return ExamplePerTensorFP8Quantizer()
    return current_scaling_ref_factory(role)


def make_recipe(**kwargs: Any) -> Any:
    """``transformer_engine.common.recipe.CustomRecipe(qfactory=qfactory, **kwargs)``."""
    from transformer_engine.common.recipe import CustomRecipe

    return CustomRecipe(qfactory=qfactory, **kwargs)
