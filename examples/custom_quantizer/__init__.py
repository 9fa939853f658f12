"""A custom TransformerEngine weight quantizer, end to end.

- :mod:`.quantizer`: ``ExamplePerTensorFP8Quantizer``, built on TE 2.20's
  custom-recipe extension points (a subclass of TE's pure-Python reference
  ``CurrentScalingQuantizerRef``), registered with its workspace
  capabilities, and ``qfactory`` / ``make_recipe()`` for
  ``CustomRecipe(qfactory=...)``.
- :mod:`.kit_adapter`: the testing kit's protocol over that quantizer on CUDA
  tensors, for ``workspace_manager.testing.check_quantizer``.

Importing this package needs TransformerEngine 2.20 for PyTorch; without it
the import raises ImportError saying so. The GPU test is
``tests/gpu/test_custom_quantizer.py``; see docs/extending.md, "A TE
quantizer, end to end".
"""

from .quantizer import EXAMPLE_CAPABILITIES, ExamplePerTensorFP8Quantizer, make_recipe, qfactory
from .kit_adapter import ExampleHandle, ExamplePerTensorFP8KitAdapter

__all__ = [
    "EXAMPLE_CAPABILITIES",
    "ExamplePerTensorFP8Quantizer",
    "qfactory",
    "make_recipe",
    "ExampleHandle",
    "ExamplePerTensorFP8KitAdapter",
]
