"""Two-rank FSDP2 worker for the custom-quantizer example (examples/custom_quantizer).

Run as ``torchrun --nproc_per_node=2 tests/gpu/_custom_fsdp2.py OUT.json``.
It builds a stack of Linear layers (bias-free, bf16 parameters,
``fully_shard`` per layer and at the root, ``reshard_after_forward=True``)
three times, from the same seed: stock ``te.Linear`` in bf16 (the baseline),
stock ``te.Linear`` under ``CustomRecipe(qfactory=example.qfactory)``, and
the drop-in ``te_integration.Linear`` under the same recipe. Each trains 5
steps on the same data (``_fsdp2_stack.train_and_measure``); the worker records the losses, the per-layer
forward increment (allocated memory between consecutive layers' forward
hooks, averaged over the steps after warm-up), peak memory, the weight
quantizer TE used, and the drop-in's plans. Rank 0 writes OUT.json.

The parameters stay in bf16 and are quantized per call: the example's
quantized storage (TE's ``CurrentScalingTensorRef``) is a plain Python
object, not a ``torch.Tensor``, so it can be neither a parameter nor an FSDP2
all-gather input (see docs/extending.md, "A TE quantizer, end to end").
Bias-free, because TE computes the bias gradient with a fused C++ kernel
(``tex.bgrad_quantize``, module/base.py:1786) that only takes TE's built-in
quantizers, and the custom GEMM needs every operand custom.
"""

from __future__ import annotations

import sys

import torch
from _fsdp2_stack import train_and_measure  # first: it puts the repository root on sys.path

from testbed.dist import guard, run_worker
from testbed.model import allocated, random_pair, rank, release_memory, shard

HIDDEN, TOKENS, LAYERS = 512, 128, 6
KINDS = ("bf16", "stock", "managed")


def example_package():
    """examples.custom_quantizer (the repository root is on sys.path)."""
    import examples.custom_quantizer as example

    return example


def build(kind: str) -> torch.nn.Module:
    import transformer_engine.pytorch as te

    import te_integration as ti

    cls = ti.Linear if kind == "managed" else te.Linear
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *[cls(HIDDEN, HIDDEN, bias=False, params_dtype=torch.bfloat16, device="cuda") for _ in range(LAYERS)]
    )
    shard(model, reshard_after_forward=True)
    return model


def data(step: int):
    return random_pair(1000 + 10 * step + rank(), (TOKENS, HIDDEN))


def _weight_quantizer_name(layer) -> str | None:
    from transformer_engine.pytorch.constants import FP8FwdTensorIdx

    quantizers = getattr(layer, "quantizers", {}).get("scaling_fwd") or []
    index = int(FP8FwdTensorIdx.GEMM1_WEIGHT)
    return type(quantizers[index]).__name__ if len(quantizers) > index else None


def _plans(model: torch.nn.Module) -> list:
    import te_integration as ti

    records = []
    for layer in model:
        ctx, plan = ti.last_plans(layer)["weight"]
        records.append({"capabilities": ctx.capabilities.name, "sharding": ctx.sharding.value,
                        "input_requires_grad": ctx.input_requires_grad,
                        "backward": plan.backward_source.value, "summary": plan.summary()})
    return records


def run(kind: str) -> dict:
    recipe = None if kind == "bf16" else example_package().make_recipe()
    baseline = allocated()
    model = build(kind)
    result = train_and_measure(model, recipe, baseline, batch=data)
    result["weight_quantizer"] = _weight_quantizer_name(model[LAYERS - 1])
    if kind == "managed":
        result["plans"] = _plans(model)
    del model
    release_memory()
    return result


def run_cases(report: dict) -> None:
    for kind in KINDS:
        guard(report, kind, lambda: report["runs"].update({kind: run(kind)}))


def main() -> int:
    return run_worker(sys.argv[1], run_cases, hidden=HIDDEN, tokens=TOKENS, layers=LAYERS, runs={})


if __name__ == "__main__":
    sys.exit(main())
