"""torchrun worker: no weight copy outlives its source, every kind, on the GPUs present.

    torchrun --nproc_per_node=N tests/gpu/_freshness_worker.py REPORT.json

Training cases: each module kind x sm_90 recipe x optimizer (TE's FusedAdam
with fp32 master weights, torch's SGD) x sharding (none, FSDP2 resharding,
FSDP2 keeping) with quantized parameters, four steps in three variants:
stock TE, the reference (stock with ``testbed.freshness.reference_reset``
after each step) and the drop-in. Per case the report says whether the
drop-in equals the reference and stock equals the reference bit for bit,
stock's largest relative input-gradient error against the reference, the
stale reads the GEMM watch counted and the stale copies the detector found.

Move cases: each kind with a workspace cache (bf16 parameters,
microbatches), stock and drop-in: what stays allocated on the GPU after
``model.cpu()`` above the same model trained without microbatches, and
what ``release_workspaces`` frees of a model left on the GPU.
``test_freshness.py`` reads the report.
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from testbed.dist import guard, run_worker  # noqa: E402
from testbed.freshness import (  # noqa: E402
    KINDS,
    OPTIMIZERS,
    SHARDINGS,
    build_model,
    input_grad_error,
    reference_reset,
    same,
    train,
)
from testbed.model import allocated, release_memory  # noqa: E402
from testbed.recipes import make_recipe, supported_recipes  # noqa: E402

RECIPES = ["DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling"]
VARIANTS = ("stock", "reference", "managed")
#: Kinds with a workspace cache (te.ops has none).
CACHING_KINDS = ("Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear")


def _variant(case: dict, variant: str, recipe):
    model = build_model(case["kind"], managed=variant == "managed", recipe=recipe, sharding=case["sharding"])
    after = reference_reset if variant == "reference" else None
    return train(model, recipe, case["optimizer"], after_step=after)


def _training_case(report: dict, case: dict, recipe) -> None:
    runs = {}
    for variant in VARIANTS:
        label = f"{case['kind']} {case['recipe']} {case['optimizer']} {case['sharding']} {variant}"
        guard(report, label, lambda v=variant: runs.__setitem__(v, _variant(case, v, recipe)))
        release_memory()
    entry = {"case": case, "ran": sorted(runs)}
    if set(runs) == set(VARIANTS):
        stock, ref, managed = runs["stock"], runs["reference"], runs["managed"]
        entry.update(managed_equals_reference=same(managed, ref), stock_equals_reference=same(stock, ref),
                     stock_dx_error=input_grad_error(stock, ref), managed_dx_error=input_grad_error(managed, ref),
                     losses={v: r.losses for v, r in runs.items()},
                     stale_reads={v: r.stale_reads for v, r in runs.items()},
                     stale_reads_per_step={v: r.stale_reads_per_step for v, r in runs.items()},
                     stale_read_examples={v: r.stale_read_examples for v, r in runs.items()},
                     stale_found={v: r.stale_found for v, r in runs.items()})
    report["cases"].append(entry)


def _residue(kind: str, managed: bool, recipe, microbatches: bool, move: bool) -> dict:
    """Bytes a trained model leaves allocated (moved to the CPU, or on the
    GPU), over what was allocated before it was built; and what
    ``release_workspaces`` freed (on the GPU)."""
    import transformer_engine.pytorch as te

    import te_integration as ti

    release_memory()
    before = allocated()
    model = build_model(kind, managed=managed, recipe=recipe, quantized_init=False)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)  # no state: nothing of the optimizer stays on the GPU
    for step in range(2):
        for micro in range(2 if microbatches else 1):
            x = torch.randn(256, 128, dtype=torch.bfloat16, device="cuda", requires_grad=True)
            with te.autocast(enabled=True, recipe=recipe):
                out = model(x, is_first_microbatch=(micro == 0) if microbatches else None)
            out.float().square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    del x, out, opt
    released = None
    if move:
        model.cpu()
    else:
        released = ti.release_workspaces(model)
    gc.collect()
    return {"residue": allocated() - before, "released": released, "param_bytes": sum(
        p.numel() * p.element_size() for p in model.parameters())}


def _move_case(report: dict, kind: str, recipe_name: str, recipe) -> None:
    entry = {"kind": kind, "recipe": recipe_name}
    for variant in ("stock", "managed"):
        def measure(v=variant) -> None:
            managed = v == "managed"
            entry[v] = {"moved_cached": _residue(kind, managed, recipe, True, True),
                        "moved_uncached": _residue(kind, managed, recipe, False, True),
                        "released_cached": _residue(kind, managed, recipe, True, False),
                        "released_uncached": _residue(kind, managed, recipe, False, False)}
        guard(report, f"move {kind} {recipe_name} {variant}", measure)
    report["moves"].append(entry)


def body(report: dict) -> None:
    report.update(cases=[], moves=[], unsupported={})
    for recipe_name in supported_recipes(RECIPES, report["unsupported"]):
        recipe = make_recipe(recipe_name)
        for kind in KINDS:
            for optimizer in OPTIMIZERS:
                for sharding in SHARDINGS:
                    case = {"kind": kind, "recipe": recipe_name, "optimizer": optimizer, "sharding": sharding}
                    _training_case(report, case, recipe)
    recipe = make_recipe("Float8CurrentScaling")
    for kind in CACHING_KINDS:
        _move_case(report, kind, "Float8CurrentScaling", recipe)


if __name__ == "__main__":
    sys.exit(run_worker(sys.argv[1], body))
