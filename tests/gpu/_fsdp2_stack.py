"""Two-rank FSDP2 worker: stock TE vs drop-in TransformerLayer stacks.

Run as ``torchrun --nproc_per_node=2 tests/gpu/_fsdp2_stack.py OUT.json [--quick] [--attribution-only]``.
For each sm_90 recipe x {bf16 params, quantized_model_init} it builds the
8-layer stack of TE's FSDP2 leak tests (hidden 256, ffn 1024, 8 heads,
fuse_qkv_params, bf16 params, fully_shard per layer and at the root) twice,
stock and with drop-ins (``managed_construction``), trains 5 steps on the
same data and records losses, the per-layer forward increment, the backward
retained delta and peak memory, next to a bf16 baseline. A microbatch run
(reshard_after_forward=False, 4 microbatches) counts quantizations, for the
drop-in's defaults and with the microbatch cache option pinned
(:data:`CACHE_OPTION`). A recompute run compares gradients under
``te.checkpoint``, for the defaults and with the recompute option pinned
(:data:`BUILD_ONCE_OPTION`). An
evidence run lists, by allocation site, what stays allocated after backward
that was not before it. An attribution run (issue 6) records one step of
each stack with ``record_workspaces`` and reports what is alive after it.
Rank 0 writes everything to OUT.json.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

# The model and the worker skeleton are the ones the benchmarks use too
# (testbed/model.py, testbed/dist.py): torchrun starts this file by path, so
# the repository root goes on sys.path first.
ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from testbed.dist import guard, run_worker  # noqa: E402
from testbed.model import QuantizationCounter, allocated, build_stack, cached_workspaces  # noqa: E402
from testbed.model import optimizer_for, random_pair, rank, release_memory  # noqa: E402
from testbed.recipes import make_recipe  # noqa: E402

HIDDEN, FFN, HEADS, LAYERS, SEQ, BATCH = 256, 1024, 8, 8, 32, 2
RECIPES = ["DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling"]
STEPS, WARMUP = 5, 2
#: The options of the shipped policies (off by default) that some runs pin on
#: the drop-ins, by their ``explain`` names (docs/decisions.md, D4 and D3).
CACHE_OPTION = "fsdp2_microbatch_cache"
BUILD_ONCE_OPTION = "fsdp2_recompute_build_once"


def build(managed: bool, recipe, quantized_init: bool, reshard_after_forward: bool = True,
          size: tuple[int, int, int, int] = (HIDDEN, FFN, HEADS, LAYERS), policy: str | None = None):
    """The stack of TE's FSDP2 leak tests, or ``size`` = (hidden, ffn, heads, layers);
    ``policy``: an ``explain`` policy name pinned on the drop-ins (None: their defaults)."""
    from workspace_manager import named_policy

    return build_stack(*size, recipe=recipe, managed=managed, quantized_init=quantized_init,
                       reshard_after_forward=reshard_after_forward,
                       policy=None if policy is None else named_policy(policy))


def data(step: int, micro: int = 0):
    """Input and target of one (micro)batch: different per rank, step and microbatch."""
    return random_pair(1000 + 10 * step + micro + rank(), (SEQ, BATCH, HIDDEN))


def mib(n):
    return n / 2**20


def train_and_measure(model, recipe, baseline: int, batch=data):
    """``STEPS`` steps on ``batch(step)``: losses of every step; memory
    figures averaged over the steps after warm-up. Peak and after-step
    figures are relative to ``baseline`` (what was allocated before the
    model was built: TE keeps some global state, e.g. DelayedScaling's amax
    buffers, from models built earlier)."""
    import transformer_engine.pytorch as te

    opt = optimizer_for(model)
    marks, losses, fwd, bwd, kept, after = [], [], [], [], [], []
    hooks = [m.register_forward_hook(lambda *_: marks.append(allocated())) for m in model.children()]
    torch.cuda.reset_peak_memory_stats()
    for step in range(STEPS):
        marks.clear()
        x, target = batch(step)
        opt.zero_grad(set_to_none=True)
        pre_fwd = allocated()
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            out = model(x)
        post_fwd = allocated()
        loss = F.mse_loss(out, target)
        loss.backward()
        post_bwd = allocated()
        opt.step()
        losses.append(loss.item())
        if step >= WARMUP:
            fwd.append(sum(b - a for a, b in zip(marks, marks[1:])) / (len(marks) - 1))
            bwd.append(post_bwd - post_fwd)
            kept.append(post_bwd - pre_fwd)
            after.append(allocated())
    for h in hooks:
        h.remove()
    return {
        "losses": losses,
        "fwd_kib_per_layer": sum(fwd) / len(fwd) / 1024,
        # TE's leak-test measure: after backward minus after forward.
        "bwd_mib": mib(sum(bwd) / len(bwd)),
        # After backward minus before forward: what the whole forward+backward
        # leaves allocated, not offset by how much forward saved.
        "kept_after_bwd_mib": mib(sum(kept) / len(kept)),
        "peak_mib": mib(torch.cuda.max_memory_allocated() - baseline),
        "after_step_mib": mib(sum(after) / len(after) - baseline),
    }


def recompute_gradients(name: str, mode: str, steps: int = 3, policy: str | None = None) -> dict:
    """Stock and drop-in (``policy`` pinned, if given) under te.checkpoint
    around every layer: losses, and how many of this rank's gradient shards
    differ bit for bit at each step. Losses alone hide a dgrad quantized
    with another scale on this model (below bf16's resolution at a loss of
    2); the realistic model showed it at d7db962 (decisions.md, D3)."""
    import transformer_engine.pytorch as te

    recipe = make_recipe(name)
    result = {"recipe": name, "mode": mode, "policy": policy}
    grads = {}
    for label, managed in (("stock", False), ("managed", True)):
        model = build(managed, recipe, False, policy=policy if managed else None)
        model.checkpoint_mode = mode
        opt = optimizer_for(model)
        losses, grads[label] = [], []
        for step in range(steps):
            x, target = data(step)
            opt.zero_grad(set_to_none=True)
            with te.autocast(enabled=recipe is not None, recipe=recipe):
                out = model(x)
            loss = F.mse_loss(out, target)
            loss.backward()
            grads[label].append([None if p.grad is None else _local(p.grad).detach().clone()
                                 for p in model.parameters()])
            opt.step()
            losses.append(loss.item())
        result[label] = {"losses": losses}
        del model, opt
        release_memory()
    result["grads_differing"] = [sum(not _same(a, b) for a, b in zip(s, m))
                                 for s, m in zip(grads["stock"], grads["managed"])]
    result["grads_missing"] = sum(g is None for g in grads["stock"][0])
    result["grads"] = len(grads["stock"][0])
    return result


def _same(a, b) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def warm_up_gemm() -> None:
    """TE allocates its GEMM workspace (32 MiB + 1 KiB on Hopper) once per
    process, at the first GEMM. Run one before the first recording, so that
    it does not land inside that recording (attribution-only runs)."""
    import transformer_engine.pytorch as te

    layer = te.Linear(64, 64, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(16, 64, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    layer(x).sum().backward()
    del layer, x
    torch.cuda.synchronize()


def run_config(name: str, quantized_init: bool) -> dict:
    recipe = make_recipe(name)
    result = {"recipe": name, "quantized_init": quantized_init}
    for label, managed in (("stock", False), ("managed", True)):
        baseline = allocated()
        model = build(managed, recipe, quantized_init)
        result[label] = train_and_measure(model, recipe, baseline)
        del model
        release_memory()
    return result


#: The stacks of a microbatch run: stock, the drop-ins' defaults, and the
#: drop-ins with the microbatch cache option pinned.
MICROBATCH_STACKS = (("stock", False, None), ("managed", True, None), ("managed_cache", True, CACHE_OPTION))


def run_microbatches(name: str, micro: int = 4) -> dict:
    import transformer_engine.pytorch as te
    from te_integration.runtime._install import install

    install()  # stock modules then also pass through the counted name
    recipe = make_recipe(name)
    result = {"recipe": name, "microbatches": micro}
    for label, managed, policy in MICROBATCH_STACKS:
        baseline = allocated()
        model = build(managed, recipe, False, reshard_after_forward=False, policy=policy)
        opt = optimizer_for(model)
        losses, counts, cached_after = [], [], []
        for step in range(3):
            with QuantizationCounter() as counter:
                for m in range(micro):
                    x, target = data(step, m)
                    with te.autocast(enabled=True, recipe=recipe):
                        out = model(x, is_first_microbatch=(m == 0))
                    loss = F.mse_loss(out, target) / micro
                    loss.backward()
                    losses.append(loss.item())
            opt.step()
            opt.zero_grad(set_to_none=True)
            counts.append(counter.count)
            cached_after.append(cached_workspaces(model))
        result[label] = {"losses": losses, "quantizations_per_step": counts,
                         "cached_workspaces_after_step": cached_after,
                         "after_step_mib": mib(allocated() - baseline)}
        del model, opt
        release_memory()
    return result


def forward_backward(model, recipe, step: int, micro: int, before_each=None) -> list[float]:
    """One step's microbatches, forward and backward, without the optimizer
    step; returns their losses. ``micro`` > 1 passes ``is_first_microbatch``;
    ``before_each(m)``, if given, runs before microbatch ``m``'s forward.
    ``recipe`` None: FP8 off (the bf16 baseline)."""
    import transformer_engine.pytorch as te

    losses = []
    for m in range(micro):
        if before_each is not None:
            before_each(m)
        x, target = data(step, m)
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            out = model(x, is_first_microbatch=(m == 0) if micro > 1 else None)
        loss = F.mse_loss(out, target) / micro
        loss.backward()
        losses.append(loss.item())
    return losses


def _one_step(model, opt, recipe, step: int, micro: int) -> None:
    forward_backward(model, recipe, step, micro)
    opt.step()
    opt.zero_grad(set_to_none=True)


def attribution(name: str, quantized_init: bool, micro: int = 1, policy: str | None = None) -> dict:
    """Issue 6: three steps of each stack, each recorded and followed by a
    report; the third step's timeline (a point at every TE module's forward
    and backward boundary) and report are kept. Stock
    modules are observed through the same seams, with no plan. ``micro`` > 1:
    reshard_after_forward=False with that many microbatches. ``policy``: an
    ``explain`` policy name pinned on the drop-ins."""
    import te_integration as ti
    from te_integration.runtime._install import install

    install()
    recipe = make_recipe(name)
    result = {"recipe": name, "quantized_init": quantized_init, "microbatches": micro, "policy": policy}
    for label, managed in (("stock", False), ("managed", True)):
        baseline = allocated()
        model = build(managed, recipe, quantized_init, reshard_after_forward=micro == 1,
                      policy=policy if managed else None)
        opt = optimizer_for(model)
        leftovers = []
        for step in range(3):  # every step recorded; the last one's timeline kept
            with ti.record_workspaces(model) as rec:
                _one_step(model, opt, recipe, step, micro)
            after = rec.report()  # with what the seams saw made: a saved workspace still alive is a leftover
            leftovers.append([e.as_dict() for e in after.leftovers])
        result[label] = {"baseline": baseline, "timeline": rec.timeline_dicts(), "after_step": after.as_dict(),
                         "after_step_table": after.table(), "leftovers_per_step": leftovers}
        del model, opt, rec, after
        release_memory()
    return result


def retained_by_site(name: str, quantized_init: bool = False, managed: bool = False) -> dict:
    """What is allocated after backward that was not after forward, grouped by
    the innermost Python frames that allocated it (evidence for the bwd delta)."""
    import transformer_engine.pytorch as te

    recipe = make_recipe(name)
    model = build(managed, recipe, quantized_init)
    opt = optimizer_for(model)
    for step in range(WARMUP):
        x, target = data(step)
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            out = model(x)
        F.mse_loss(out, target).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.memory._record_memory_history(max_entries=200000)
    x, target = data(WARMUP)
    with te.autocast(enabled=recipe is not None, recipe=recipe):
        out = model(x)
    before = _live_blocks()
    F.mse_loss(out, target).backward()
    after = _live_blocks()
    torch.cuda.memory._record_memory_history(enabled=None)
    new = {addr: info for addr, info in after.items() if addr not in before}
    gone = {addr: info for addr, info in before.items() if addr not in after}
    return {"recipe": name, "quantized_init": quantized_init, "managed": managed,
            "retained": _group(new), "freed": _group(gone),
            "retained_mib": mib(sum(i[0] for i in new.values())), "freed_mib": mib(sum(i[0] for i in gone.values()))}


def _live_blocks() -> dict:
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    blocks = {}
    for seg in snap["segments"]:
        for blk in seg["blocks"]:
            if blk["state"] == "active_allocated":
                frames = [f"{os.path.basename(f['filename'])}:{f['line']}:{f['name']}" for f in blk.get("frames", [])
                          if f["filename"].endswith(".py")][:4]
                blocks[blk["address"]] = (blk["size"], " <- ".join(frames) or "(no python frame)")
    return blocks


def _group(blocks: dict) -> list:
    sites: dict[str, list] = {}
    for size, site in blocks.values():
        entry = sites.setdefault(site, [0, 0])
        entry[0] += size
        entry[1] += 1
    top = sorted(sites.items(), key=lambda kv: -kv[1][0])[:12]
    return [{"site": s, "kib": round(v[0] / 1024, 1), "blocks": v[1]} for s, v in top]


def run_cases(report: dict, quick: bool, attribution_only: bool) -> None:
    """Every case of this worker, each recorded through ``guard`` (one
    failing case does not hide the others). ``attribution_only``: issue 6's
    runs alone (for the timeline figures)."""
    configs = [("bf16", False)] + [(r, q) for r in RECIPES for q in (False, True)]
    if quick:
        configs = configs[:3]
    if attribution_only:
        guard(report, "warm-up GEMM", warm_up_gemm)
    for name, qinit in [] if attribution_only else configs:
        guard(report, f"config {name} qinit={qinit}", lambda: report["configs"].append(run_config(name, qinit)))
    for name in [] if attribution_only else RECIPES[: 1 if quick else 3]:
        guard(report, f"microbatches {name}", lambda: report["microbatches"].append(run_microbatches(name)))
    for name, qinit in configs[1:]:
        guard(report, f"attribution {name} qinit={qinit}",
              lambda: report["attribution"].append(attribution(name, qinit)))
    for name in RECIPES[: 1 if quick else 3]:
        guard(report, f"attribution {name} microbatches",
              lambda: report["attribution"].append(attribution(name, False, micro=4)))
    for name in RECIPES[1: 2 if quick else 3]:  # the recipes the microbatch cache option caches
        guard(report, f"attribution {name} microbatches {CACHE_OPTION}",
              lambda: report["attribution"].append(attribution(name, False, micro=4, policy=CACHE_OPTION)))
    for name, managed in () if attribution_only else (("bf16", False), ("Float8CurrentScaling", False),
                                                        ("Float8CurrentScaling", True)):
        guard(report, f"evidence {name}", lambda: report["evidence"].append(retained_by_site(name, managed=managed)))
    recompute_cases = [(r, m, p) for r in RECIPES for m in ("nonreentrant", "reentrant")
                       for p in (None, BUILD_ONCE_OPTION)]
    for name, mode, policy in [] if attribution_only else recompute_cases:
        guard(report, f"recompute {name} {mode} {policy or 'defaults'}",
              lambda: report["recompute"].append(recompute_gradients(name, mode, policy=policy)))


def main() -> int:
    quick, attribution_only = "--quick" in sys.argv, "--attribution-only" in sys.argv
    return run_worker(sys.argv[1], lambda report: run_cases(report, quick, attribution_only),
                      configs=[], microbatches=[], evidence=[], attribution=[], recompute=[])


if __name__ == "__main__":
    sys.exit(main())
