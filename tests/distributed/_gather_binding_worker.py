"""torchrun worker (gloo, CPU): the drop-ins' quantized FSDP2 all-gather
(``te_integration.enable_quantized_gather``, D13) with the stand-in TE.

Two models of three drop-in Linears (16->10, 10->6, 6->16: at world size 4
the shards are uneven and one rank holds no rows of the 6-row weight), the
same initial weights, each ``fully_shard``-ed: "stock", whose stand-in
weight quantizer quantizes the gathered fp32 weight in every call (per-tensor
FP8, the arithmetic of the stand-in's shard path), and "ours", set up for the
quantized all-gather after ``fully_shard``. The same with 2D blocks
(Float8BlockScaling: 128x128 blocks) on Linears whose weights FSDP2 cuts on
block boundaries or inside blocks (:data:`BLOCK_SHAPES`), and with a
GroupedLinear of one parameter per expert. Each row is
``{case, what, expected, got, passed}``; the report goes to the path given.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))

from _pytest.monkeypatch import MonkeyPatch  # noqa: E402  (the stand-in's loader takes one)

from _fake_te import TELinear, load_full_binding  # noqa: E402
from _fake_te_gather import RECIPES, Fp8BlockScalingQuantizer, Fp8CurrentScalingQuantizer  # noqa: E402
from _fake_te_grouped import TEGroupedLinear  # noqa: E402

from tests.distributed._ranks import report, rows_of, run  # noqa: E402

TI = load_full_binding(MonkeyPatch())
SHAPES = ((16, 10), (10, 6), (6, 16))
#: (in, out) of the block-scaled Linears: weights of 511 x 16 (cut on block
#: boundaries at world 2 and 4, its last block partial in rows and columns
#: alike), 256 x 511 (at world 2; inside a block at world 4) and 16 x 256
#: (inside a block at both).
BLOCK_SHAPES = ((16, 511), (511, 256), (256, 16))


def _block_set_up(world: int) -> list[str]:
    """The block-scaled weights whose shards start on block boundaries."""
    rows = [out for _, out in BLOCK_SHAPES]
    return [f"{i}.weight" for i, r in enumerate(rows) if world == 1 or -(-r // world) % 128 == 0]


def _row(case: str, what: str, expected, got) -> dict:
    return {"case": case, "what": what, "expected": str(expected), "got": str(got), "passed": expected == got}


class Experts(nn.Module):
    """A GroupedLinear of two experts (one parameter each) with a fixed split of the 5 rows of a batch."""

    def __init__(self, features: int, seed: int) -> None:
        super().__init__()
        self.grouped = TEGroupedLinear(2, features, features, seed=seed)
        self.grouped.quantizers = [Fp8CurrentScalingQuantizer() for _ in range(2)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.grouped(x, [3, 2])


def _layers(kind: str) -> list[nn.Module]:
    if kind == "grouped":
        layers = [TELinear(16, 16, seed=0), Experts(16, seed=1), TELinear(16, 16, seed=2)]
        for layer in layers[::2]:
            layer.quantizer, layer.calls = Fp8CurrentScalingQuantizer(), None
        return layers
    shapes, quantizer = (BLOCK_SHAPES, Fp8BlockScalingQuantizer) if kind == "block" else (SHAPES, Fp8CurrentScalingQuantizer)
    layers = [TELinear(i, o, seed=n) for n, (i, o) in enumerate(shapes)]
    for layer in layers:
        layer.quantizer, layer.calls = quantizer(), None
    return layers


def _pair(mesh, reshard: bool, kind: str = "current"):
    """(stock, ours): drop-in models with the same weights, both sharded."""
    base = nn.Sequential(*_layers(kind))
    stock, ours = (TI.modules.convert_model(copy.deepcopy(base)) for _ in range(2))
    for model in (stock, ours):
        for layer in model:
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    return stock, ours


def _batch(step: int, mb: int) -> torch.Tensor:
    return torch.randn(5, SHAPES[0][0], generator=torch.Generator().manual_seed(1000 * dist.get_rank() + 10 * step + mb))


def _train(model, optimizer, steps: int, microbatches: int) -> list[torch.Tensor]:
    outs = []
    for step in range(steps):
        for mb in range(microbatches):
            out = model(_batch(step, mb))
            out.pow(2).mean().backward()
            outs.append(out.detach())
        optimizer.step()
        optimizer.zero_grad()
    return outs


def _plain(t: torch.Tensor) -> torch.Tensor:
    local = getattr(t, "_local_tensor", t)
    return getattr(local, "_hp", local)


#: Per kind of model: its recipe and the weights set up at a world size.
KINDS = {"current": (RECIPES.current, lambda world: ["0.weight", "1.weight", "2.weight"]),
         "block": (RECIPES.block, _block_set_up),
         "grouped": (RECIPES.current, lambda world: ["0.weight", "1.grouped.weight0", "1.grouped.weight1", "2.weight"])}


def parity_rows(mesh, reshard: bool, microbatches: int, kind: str = "current") -> list[dict]:
    """Outputs, sharded gradients and weights bit-exact with stock over 3
    steps, AdamW; every shard made once per step by the step task, none in
    the all-gather hook after the first, one reduction per step."""
    case = f"parity reshard={reshard} mb={microbatches}" + ("" if kind == "current" else f" {kind}")
    recipe, expected = KINDS[kind]
    stock, ours = _pair(mesh, reshard, kind)
    setup = TI.gather.enable_quantized_gather(ours, recipe())
    weights = expected(dist.get_world_size())
    rows = [_row(case, "weights set up", weights, [f"{c.module}.{c.weight}" for c in setup.set_up])]
    opts = [torch.optim.AdamW(m.parameters(), lr=0.05) for m in (stock, ours)]
    got = [_train(m, o, 3, microbatches) for m, o in zip((stock, ours), opts)]
    rows.append(_row(case, "outputs equal stock's", True, all(torch.equal(a, b) for a, b in zip(*got))))
    same = [n for (n, p), q in zip(ours.named_parameters(), stock.parameters()) if not torch.equal(_plain(p), _plain(q))]
    rows.append(_row(case, "weights after 3 steps equal stock's", [], same))
    counts = setup.state.counts()
    rows.append(_row(case, "refreshes, shards made by them, made in a hook", (3, 3 * len(weights), len(weights)),
                     (counts.refreshes, counts.refreshed_shards, counts.hook_remakes)))
    world = dist.get_world_size()
    rows.append(_row(case, "reductions: the first gathers' and one per step", len(weights) * (world > 1) + 3 * (world > 1),
                     counts.reductions))
    kept = _kept(setup.state)
    _train(ours, opts[1], 1, 1)
    rows.append(_row(case, "the next step's refresh writes over what the last one kept, every weight",
                     (len(weights), kept), (sum(k is not None for k in kept.values()), _kept(setup.state))))
    return rows


def _kept(state) -> dict[str, tuple[int, int] | None]:
    """Per wrapped weight, where its shard's bytes and scales are, or None
    where its last refresh kept nothing to make the next one in."""
    out = {}
    for name, p in state.wrapped():
        link = p._local_tensor._link
        out[name] = None if link.kept is None else (link.shard.data.data_ptr(), link.shard.scale_inv.data_ptr())
    return out


def attribution_rows(mesh) -> list[dict]:
    """workspace_report shows the held shards; stale_workspaces reports none
    after a step and exactly the shard written outside one; release_workspaces
    frees them and the next forward makes them again."""
    case = "report, stale, release"
    _, ours = _pair(mesh, True)
    setup = TI.gather.enable_quantized_gather(ours, RECIPES.current())
    opt = torch.optim.SGD(ours.parameters(), lr=0.1)
    _train(ours, opt, 1, 1)
    held = setup.state.held_bytes()
    report_ = TI.attribution.workspace_report(ours)
    shards = [w for w in report_.entries if w.record.kind.value == "quantized FSDP2 shard"]
    rows = [_row(case, "report: one shard per weight, the held bytes, no leftover", (3, held, ()),
                 (len(shards), sum(w.nbytes for w in shards), report_.leftovers))]
    rows.append(_row(case, "stale after a step", [], TI.stale.stale_workspaces(ours)))
    with torch.no_grad():
        _plain(ours[1].weight).mul_(1.5)  # a write outside a step (as load_state_dict's copy)
    stale = TI.stale.stale_workspaces(ours)
    rows.append(_row(case, "stale after a write outside a step", [("1.weight", "shard_older_than_weight")],
                     [(s.weight, s.kind.value) for s in stale]))
    freed = TI.stale.release_workspaces(ours)
    rows.append(_row(case, "released: the held bytes, none held after", (held, 0), (freed, setup.state.held_bytes())))
    _train(ours, opt, 1, 1)
    rows.append(_row(case, "made again by the next step", (held, []), (setup.state.held_bytes(), TI.stale.stale_workspaces(ours))))
    try:
        TI.gather.enable_quantized_gather(ours, RECIPES.current())
        again = "no error"
    except RuntimeError as err:
        again = "refused" if "set up already" in str(err) else str(err)
    rows.append(_row(case, "setting it up again", "refused", again))
    return rows


def without_the_step_task_rows(mesh) -> list[dict]:
    """With the step task gone, each step's first gather remakes every shard
    in the hook (with one reduction each): what the task saves."""
    case = "without the step task"
    _, ours = _pair(mesh, True)
    setup = TI.gather.enable_quantized_gather(ours, RECIPES.current())
    task = TI.step_hook._TASKS.pop("quantized_shards")
    try:
        _train(ours, torch.optim.AdamW(ours.parameters(), lr=0.05), 3, 2)
    finally:
        TI.step_hook._TASKS["quantized_shards"] = task
    counts = setup.state.counts()
    return [_row(case, "refreshes, made in a hook", (0, 9), (counts.refreshes, counts.hook_remakes))]


def fallback_rows(mesh) -> list[dict]:
    """Recipes whose workspace is made in the call: nothing set up, each
    weight left out with the plan's reason, or this binding's."""
    rows = []
    for recipe, words in ((RECIPES.delayed(), "float8_delayed_scaling does not quantize a shard"),
                          (RECIPES.mxfp8(), "mxfp8 does not quantize a shard")):
        _, ours = _pair(mesh, True)
        setup = TI.gather.enable_quantized_gather(ours, recipe)
        reasons = {words in c.reason for c in setup.choices}
        rows.append(_row(f"fallback {type(recipe).__name__}", "nothing set up, the reason named",
                         (0, None, {True}), (len(setup.set_up), setup.state, reasons)))
    _, ours = _pair(mesh, True, "block")
    setup = TI.gather.enable_quantized_gather(ours, RECIPES.block())
    cut = [f"{c.module}.{c.weight}" for c in setup.left_out if "inside its 128-row blocks" in c.reason]
    everything = [f"{i}.weight" for i in range(len(BLOCK_SHAPES))]
    rows.append(_row("fallback Float8BlockScaling", "weights whose shards cut a block left out, the reason named",
                     [w for w in everything if w not in _block_set_up(dist.get_world_size())], cut))
    _, ours = _pair(mesh, True)
    ours(_batch(0, 0))  # FSDP2's lazy init has run: too late
    try:
        TI.gather.enable_quantized_gather(ours, RECIPES.current())
        got = "no error"
    except Exception as err:  # noqa: BLE001 - the row says what was raised
        got = "refused" if "first forward" in str(err) else f"{type(err).__name__}: {err}"
    rows.append(_row("after the first forward", "refused by name", "refused", got))
    return rows


def checkpoint_rows(mesh, out_dir: Path) -> list[dict]:
    """A DCP checkpoint of ours (model and AdamW state, after 2 steps) loads
    into the model without the quantized gather (stock here), and one more
    step of each gives the same outputs and weights."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    case = "checkpoint into stock"
    stock, ours = _pair(mesh, True)
    TI.gather.enable_quantized_gather(ours, RECIPES.current())
    opts = {"stock": torch.optim.AdamW(stock.parameters(), lr=0.05), "ours": torch.optim.AdamW(ours.parameters(), lr=0.05)}
    _train(ours, opts["ours"], 2, 2)
    _train(stock, opts["stock"], 1, 1)  # other weights and moments than ours: the load must replace them
    model_sd, optim_sd = get_state_dict(ours, opts["ours"])
    path = str(out_dir / "binding-ckpt")
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    model_sd, optim_sd = get_state_dict(stock, opts["stock"])
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(stock, opts["stock"], model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded = [n for (n, p), q in zip(ours.named_parameters(), stock.parameters()) if not torch.equal(_plain(p), _plain(q))]
    rows = [_row(case, "stock's weights after the load equal ours", [], loaded)]
    outs = [_train(m, opts[k], 1, 2) for k, m in (("stock", stock), ("ours", ours))]
    rows.append(_row(case, "the next step's outputs equal", True, all(torch.equal(a, b) for a, b in zip(*outs))))
    after = [n for (n, p), q in zip(ours.named_parameters(), stock.parameters()) if not torch.equal(_plain(p), _plain(q))]
    rows.append(_row(case, "the weights after it equal", [], after))
    return rows


def main() -> int:
    out_path = sys.argv[1]
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    cases = [lambda: parity_rows(mesh, True, 1), lambda: parity_rows(mesh, True, 4), lambda: parity_rows(mesh, False, 4),
             lambda: parity_rows(mesh, True, 2, "block"), lambda: parity_rows(mesh, False, 2, "block"),
             lambda: parity_rows(mesh, True, 2, "grouped"), lambda: parity_rows(mesh, False, 2, "grouped"),
             lambda: attribution_rows(mesh), lambda: without_the_step_task_rows(mesh), lambda: fallback_rows(mesh),
             lambda: checkpoint_rows(mesh, Path(out_path).parent)]
    rows = rows_of(cases, lambda error: _row("setup", "no error", None, error))
    return report(Path(out_path), {"rank": dist.get_rank(), "rows": rows})


if __name__ == "__main__":
    run(main)
