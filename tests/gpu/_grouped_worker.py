"""torchrun worker: GroupedLinear drop-in against stock, on the GPUs present.

    torchrun --nproc_per_node=N tests/gpu/_grouped_worker.py REPORT.json

For each sm_90 recipe, parameter layout, sharding (none, FSDP2 reshard,
FSDP2 keep), weight kind (bf16, quantized init), microbatching and
recompute mode, three training steps of a two-block expert stack run as
stock ``te.GroupedLinear``, as the drop-in, (bf16 weights) as the same
experts in stock ``te.Linear`` modules, and (quantized parameters) as the
reference: stock with its quantized parameters' transposes reset after each
optimizer step (``testbed.freshness.reference_reset``; docs/decisions.md, D12). The report holds, per case, the
losses and final parameters of each (as digests: equal digests are equal
bits), what each block's backward was handed in place of its experts'
workspaces (read from the autograd ctx after forward), the cache entries
left after the step, and the plan. ``test_grouped_linear.py`` reads it.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from testbed.dist import guard, run_worker  # noqa: E402
from testbed.freshness import reference_reset  # noqa: E402
from testbed.experts import RECOMPUTE_MODES, build_expert_reference, build_expert_stack  # noqa: E402
from testbed.model import optimizer_for, release_memory  # noqa: E402
from testbed.recipes import make_recipe, recipe_skip_reason  # noqa: E402

RECIPES = ["DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling"]
SHARDINGS = ["none", "fsdp2_reshard", "fsdp2_keep"]
STEPS = 3
#: Two blocks (256 -> 384 -> 256) of 4 experts, 128 tokens each: every
#: shape distinct, so a saved tensor's shape says what it is.
EXPERTS, HIDDEN, OUT, TOKENS, BLOCKS = 4, 256, 384, 512, 2
EXPERT_SHAPES = {"experts": EXPERTS, "features": (HIDDEN, OUT), "tokens": TOKENS, "blocks": BLOCKS}


def _inputs(seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(TOKENS, HIDDEN, dtype=torch.bfloat16, device="cuda", generator=g).requires_grad_()


def _model(case: dict, variant: str, recipe):
    sharded, keep = case["sharding"] != "none", case["sharding"] == "fsdp2_keep"
    common = dict(single_grouped_weight=case["single"], sharded=sharded, reshard_after_forward=not keep,
                  out_features=OUT)
    if variant == "linears":
        return build_expert_reference(BLOCKS, EXPERTS, HIDDEN, **common)
    return build_expert_stack(BLOCKS, EXPERTS, HIDDEN, recipe=recipe, managed=variant == "managed",
                              quantized_init=case["qinit"], **common)


def _digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t  # this rank's shard: the same for every variant
        if hasattr(t, "dequantize"):
            t = t.dequantize()
        h.update(t.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def _slot_kind(t, block, params: set, cached: set) -> str | None:
    """What one saved tensor is, as far as the experts' weights go: a cache
    entry, a quantized parameter (``qparam``, or ``quantized``: FSDP2's
    gathered copy of one), a fresh workspace's rowwise or columnwise data,
    or a high-precision weight (``param``, or ``hp``: FSDP2's unsharded copy)."""
    import transformer_engine.pytorch as te

    out_f, in_f = block.out_features, block.in_features
    if isinstance(t, te.QuantizedTensor):
        return "cached" if id(t) in cached else ("qparam" if id(t) in params else "quantized")
    shape = tuple(t.shape)
    if t.dtype == torch.uint8 and shape == (out_f, in_f):
        return "row"
    if t.dtype == torch.uint8 and shape == (in_f, out_f):
        return "col"
    if t.dtype != torch.uint8 and shape == (out_f, in_f):
        return "param" if id(t) in params else "hp"
    return None


def _function_node(grad_fn):
    """The ``_GroupedLinear`` node behind the module's output (TE returns a view of it)."""
    todo = [grad_fn]
    while todo:
        node = todo.pop(0)
        if node is None:
            continue
        if "GroupedLinear" in type(node).__name__:
            return node
        todo.extend(next_fn for next_fn, _ in node.next_functions)
    raise LookupError(f"no _GroupedLinear node behind {grad_fn}")


def _saved_kinds(grad_fn, block) -> dict:
    from te_integration.runtime._stale import transpose_matches

    grad_fn = _function_node(grad_fn)
    params = {id(p) for p in block.parameters()}
    cached = {id(w) for w in block._fp8_workspaces.values()}
    counts: dict[str, int] = {}
    for t in grad_fn.saved_tensors:
        kind = None if t is None else _slot_kind(t, block, params, cached)
        if kind is not None:
            counts[kind] = counts.get(kind, 0) + 1
        if kind in ("qparam", "quantized") and transpose_matches(t) is False:
            counts["stale_columnwise"] = counts.get("stale_columnwise", 0) + 1
    return counts


def _run(case: dict, variant: str) -> dict:
    import transformer_engine.pytorch as te
    import te_integration as ti

    recipe = make_recipe(case["recipe"])
    model = _model(case, variant, recipe)
    seen: list = []
    hooks = [blk.register_forward_hook(lambda m, args, out: seen.append((m, out.grad_fn)))
             for blk in model if isinstance(blk, te.GroupedLinear)]
    opt = optimizer_for(model)
    losses, saved, micro = [], [], (True, False, False) if case["microbatches"] else (None,)
    for step in range(STEPS):
        for i, first in enumerate(micro):
            x = _inputs(seed=100 * step + i)
            with te.autocast(enabled=True, recipe=recipe):
                out = model(x, is_first_microbatch=first, recompute=case["recompute"])
            if step == 1 and i == 0:
                saved = [_saved_kinds(fn, m) for m, fn in seen if fn is not None and not case["recompute"]]
            seen.clear()
            loss = out.float().square().mean()
            loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad(set_to_none=True)
        if variant == "reference":
            reference_reset(model)
    for h in hooks:
        h.remove()
    grouped = [m for m in model.modules() if isinstance(m, te.GroupedLinear)]
    result = {"losses": losses, "params": _digest(p for p in model.parameters()), "saved": saved,
              "cache": sorted(k for m in grouped for k in m._fp8_workspaces)}
    if variant == "managed":
        plans = ti.last_plans(grouped[0])
        result["plan"] = plans["weight"][1].summary() if "weight" in plans else None
    del model, opt
    release_memory()
    return result


def _cases(report: dict):
    from transformer_engine.pytorch.module.grouped_linear import is_module_grouped_tensor_path_supported

    for recipe in RECIPES:
        reason = recipe_skip_reason(recipe)
        if reason:
            report["skipped"].append({"recipe": recipe, "reason": reason})
            continue
        single_ok = is_module_grouped_tensor_path_supported(make_recipe(recipe), torch.bfloat16)
        report["grouped_tensor_path"][recipe] = single_ok
        for single in ([False, True] if single_ok else [False]):
            for sharding in SHARDINGS:
                for qinit in (False, True):
                    for microbatches in (False, True):
                        for recompute in RECOMPUTE_MODES:
                            yield {"recipe": recipe, "single": single, "sharding": sharding, "qinit": qinit,
                                   "microbatches": microbatches, "recompute": recompute}


def body(report: dict) -> None:
    from te_integration.te._compat import tex

    report["cublaslt"] = tex.get_cublasLt_version()
    report["shapes"] = EXPERT_SHAPES
    for case in _cases(report):
        entry = {"case": case}
        variants = ["stock", "managed"] + (["linears"] if not case["qinit"] and not case["single"] else []) \
            + (["reference"] if case["qinit"] else [])
        for variant in variants:
            where = f"{case} {variant}"
            guard(report, where, lambda v=variant: entry.__setitem__(v, _run(case, v)))
        report["cases"].append(entry)


if __name__ == "__main__":
    sys.exit(run_worker(sys.argv[1], body, cases=[], skipped=[], grouped_tensor_path={}))
