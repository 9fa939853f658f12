"""Two-rank FSDP2 worker for the custom-quantizer example (examples/custom_quantizer).

Run as ``torchrun --nproc_per_node=2 tests/gpu/_custom_fsdp2.py OUT.json``.
It builds a stack of Linear layers (bias-free, bf16 parameters,
``fully_shard`` per layer and at the root, ``reshard_after_forward=True``)
three times, from the same seed: stock ``te.Linear`` in bf16 (the baseline),
stock ``te.Linear`` under ``CustomRecipe(qfactory=example.qfactory)``, and
the drop-in ``te_integration.Linear`` under the same recipe. Each trains 5
steps on the same data; the worker records the losses, the per-layer
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

import gc
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
HIDDEN, TOKENS, LAYERS, STEPS, WARMUP = 512, 128, 6, 5, 2
KINDS = ("bf16", "stock", "managed")


def example_package():
    """examples.custom_quantizer, importable from the repository root."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import examples.custom_quantizer as example

    return example


def build(kind: str) -> torch.nn.Module:
    import transformer_engine.pytorch as te
    from torch.distributed.fsdp import fully_shard

    import te_integration as ti

    cls = ti.Linear if kind == "managed" else te.Linear
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *[cls(HIDDEN, HIDDEN, bias=False, params_dtype=torch.bfloat16, device="cuda") for _ in range(LAYERS)]
    )
    attrs = {name: dict(vars(p)) for name, p in model.named_parameters()}
    for layer in model:
        fully_shard(layer, reshard_after_forward=True)
    fully_shard(model, reshard_after_forward=True)
    for name, p in model.named_parameters():
        for key, value in attrs.get(name, {}).items():
            if not hasattr(p, key):
                setattr(p, key, value)
    return model


def data(step: int):
    g = torch.Generator(device="cuda").manual_seed(1000 + 10 * step + dist.get_rank())
    x = torch.randn(TOKENS, HIDDEN, dtype=torch.bfloat16, device="cuda", generator=g)
    return x, torch.randn(x.shape, dtype=x.dtype, device="cuda", generator=g)


def _allocated() -> int:
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def train_and_measure(model: torch.nn.Module, recipe, baseline: int) -> dict:
    import transformer_engine.pytorch as te

    opt = te.optimizers.FusedAdam(model.parameters(), lr=1e-3, master_weights=True,
                                  master_weight_dtype=torch.float32)
    marks, losses, fwd = [], [], []
    hooks = [m.register_forward_hook(lambda *_: marks.append(_allocated())) for m in model.children()]
    torch.cuda.reset_peak_memory_stats()
    for step in range(STEPS):
        marks.clear()
        x, target = data(step)
        opt.zero_grad(set_to_none=True)
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            out = model(x)
        loss = F.mse_loss(out, target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step >= WARMUP:
            fwd.append(sum(b - a for a, b in zip(marks, marks[1:])) / (len(marks) - 1))
    for h in hooks:
        h.remove()
    return {
        "losses": losses,
        "fwd_kib_per_layer": sum(fwd) / len(fwd) / 1024,
        "peak_mib": (torch.cuda.max_memory_allocated() - baseline) / 2**20,
    }


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
    baseline = _allocated()
    model = build(kind)
    result = train_and_measure(model, recipe, baseline)
    result["weight_quantizer"] = _weight_quantizer_name(model[LAYERS - 1])
    if kind == "managed":
        result["plans"] = _plans(model)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return result


def main() -> int:
    out_path = sys.argv[1]
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    report = {"hidden": HIDDEN, "tokens": TOKENS, "layers": LAYERS, "runs": {}, "errors": []}
    for kind in KINDS:
        try:
            report["runs"][kind] = run(kind)
        except Exception:  # recorded, so one failing run does not hide the others
            report["errors"].append({"where": kind, "traceback": traceback.format_exc()})
            gc.collect()
            torch.cuda.empty_cache()
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(report, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
