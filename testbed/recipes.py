"""TE's recipes by name, as the GPU tests and benchmarks choose them: the
recipe object, and TE's own check of whether this GPU supports it.
TransformerEngine is imported inside the functions."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

__all__ = ["make_recipe", "recipe_skip_reason", "supported_recipes"]


def make_recipe(name: str):
    """The TE recipe object for ``name``; None for bf16 (FP8 off)."""
    if name == "bf16":
        return None
    from transformer_engine.common import recipe

    return getattr(recipe, name)()


def recipe_skip_reason(name: str) -> str | None:
    """TE's own support check for the recipe on this GPU (None: supported)."""
    if name == "bf16":
        return None
    from transformer_engine.pytorch import quantization as q

    check = {
        "DelayedScaling": q.check_fp8_support,
        "Float8CurrentScaling": q.check_fp8_support,
        "Float8BlockScaling": q.check_fp8_block_scaling_support,
        "MXFP8BlockScaling": q.check_mxfp8_support,
        "NVFP4BlockScaling": q.check_nvfp4_support,
    }[name]
    ok, reason = check()
    return None if ok else f"{name}: {reason}"


def supported_recipes(names: Iterable[str], unsupported: dict[str, str]) -> Iterator[str]:
    """Each of ``names`` this GPU supports, in order; the others go into
    ``unsupported`` with TE's reason (a worker's report, which its tests read)."""
    for name in names:
        reason = recipe_skip_reason(name)
        if reason:
            unsupported[name] = reason
        else:
            yield name
