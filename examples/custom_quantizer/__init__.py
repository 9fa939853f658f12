"""A custom TransformerEngine weight quantizer, end to end.

- :mod:`.quantizer`: ``ExamplePerTensorFP8Quantizer``, built on TE 2.20's
  custom-recipe extension points (a subclass of TE's pure-Python reference
  ``CurrentScalingQuantizerRef``), registered with its workspace
  capabilities, and ``qfactory`` / ``make_recipe()`` for
  ``CustomRecipe(qfactory=...)``.
- :mod:`.kit_adapter`: the testing kit's protocol over that quantizer on CUDA
  tensors, for ``workspace_manager.testing.check_quantizer``.

Its names need TransformerEngine 2.20 for PyTorch: without it, importing
one (``from examples.custom_quantizer import make_recipe``) raises one
ImportError saying so. They are imported when first used, so that
``python3 -m examples.custom_quantizer`` (``__main__.py``: the kit and a
drop-in, on a GPU) can say what is missing in one line. The GPU test is
``tests/gpu/test_custom_quantizer.py``; see docs/extending.md, "A TE
quantizer, end to end". ``examples/policies_on_cpu.py`` needs neither.
"""

import importlib

#: Each public name -> the module of this package that defines it.
_HOMES = {
    "EXAMPLE_CAPABILITIES": "quantizer",
    "ExamplePerTensorFP8Quantizer": "quantizer",
    "qfactory": "quantizer",
    "make_recipe": "quantizer",
    "ExampleHandle": "kit_adapter",
    "ExamplePerTensorFP8KitAdapter": "kit_adapter",
}


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)


__all__ = [
    "EXAMPLE_CAPABILITIES",
    "ExamplePerTensorFP8Quantizer",
    "qfactory",
    "make_recipe",
    "ExampleHandle",
    "ExamplePerTensorFP8KitAdapter",
]
