"""``python3 -m examples.custom_quantizer`` (from the repository root): the
testing kit on the TE quantizer, then a drop-in ``Linear`` planned with it.

Needs TransformerEngine 2.20 and a CUDA GPU. Without them it says, in one
line, what is missing and how to install it, and exits with status 1.
"""

from __future__ import annotations

import sys


def main() -> int:
    try:
        import torch

        from . import EXAMPLE_CAPABILITIES, ExamplePerTensorFP8KitAdapter, make_recipe

        if not torch.cuda.is_available():
            raise ImportError("examples.custom_quantizer needs a CUDA GPU, and torch sees none here")
        import te_integration as ti
        import transformer_engine.pytorch as te
    except ImportError as err:
        print(" ".join(str(err).split()), file=sys.stderr)
        return 1
    from workspace_manager.testing import check_quantizer

    report = check_quantizer(ExamplePerTensorFP8KitAdapter, EXAMPLE_CAPABILITIES)
    print(report)
    layer = ti.Linear(1024, 1024, bias=False, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(64, 1024, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    with te.autocast(recipe=make_recipe()):
        out = layer(x)
    out.float().sum().backward()
    context, plan = ti.last_plans(layer)["weight"]
    print(f"drop-in Linear with {context.capabilities.name}: {plan.summary()}")
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
