"""The quantized FSDP2 all-gather, for real: run under
``torchrun --nproc_per_node=N tests/distributed/_gather_worker.py RESULT.json``.

Every case builds the same small model twice on CPU: "stock" (plain
parameters, FSDP2 gathers them in their dtype, each ref_linear quantizes the
whole gathered weight) and "ours" (the weights wrapped by
``enable_quantized_gather``: each rank quantizes its shard once per step and
FSDP2 gathers the FP8 bytes). Layer shapes make FSDP2's shards uneven at
world size 4 (rows 3,3,3,1) and leave one rank a shard with no rows. Each
check is a row ``{case, check, expected, got, passed}``; rank 0 writes every
rank's rows to RESULT.json (the checkpoint goes beside it), and the exit
status is 1 on any failed row.
"""

from __future__ import annotations

import copy
import os
import sys
import traceback
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.distributed._gather_reference import (  # noqa: E402
    BatchCurrentScaling, BlockScaling, CurrentScaling, RefFactory, RefFloat8Weight, RefLinear, quantize_whole,
)
from tests.distributed._ranks import report, run  # noqa: E402
from workspace_manager._errors import InvalidContextError  # noqa: E402
from workspace_manager._shard_gather import (  # noqa: E402
    ShardGatherWeight, enable_quantized_gather, enable_quantized_gather_sharded,
)

SHAPES = ((16, 10), (10, 6), (6, 16))  # (fan_in, fan_out) per layer: rows 10, 6, 16
BATCH = 5


@dataclass(frozen=True)
class Config:
    recipe: str = "current"  # "current_batch" (the same, a BatchShardQuantizer), "block" (4x4 tiles, cut by shard boundaries)
    reshard: bool = True
    recompute: bool = False
    microbatches: int = 1
    optimizer: str = "adamw_foreach"  # adamw_fused, sgd, extension (ExtensionSGD)
    params: str = "bf16"  # fp32_mp: fp32 parameters, bf16 gathers (MixedPrecisionPolicy)
    steps: int = 3
    #: "before" fully_shard (enable_quantized_gather) or "after" it (enable_quantized_gather_sharded)
    wrap: str = "before"

    @property
    def name(self) -> str:
        return (f"{self.recipe}/reshard={self.reshard}/recompute={self.recompute}/mb={self.microbatches}/"
                f"{self.optimizer}/{self.params}/wrap={self.wrap}")


PARITY = [
    Config(),
    Config(microbatches=4, optimizer="adamw_fused"),
    Config(recipe="current_batch", microbatches=4, optimizer="adamw_fused"),
    Config(reshard=False, microbatches=4, optimizer="sgd"),
    Config(microbatches=4, optimizer="extension"),
    Config(recompute=True, microbatches=4),
    Config(reshard=False, recompute=True, optimizer="adamw_fused"),
    Config(microbatches=4, params="fp32_mp"),
    Config(params="fp32", optimizer="sgd", microbatches=4),
    Config(recipe="block", microbatches=4),
    Config(recipe="block", reshard=False, recompute=True, microbatches=4, optimizer="sgd"),
    Config(recipe="block", recompute=True, optimizer="adamw_fused", params="fp32_mp"),
    Config(wrap="after", microbatches=4),
    Config(recipe="block", wrap="after", reshard=False, recompute=True, optimizer="sgd"),
]


class Block(nn.Module):
    """A ref_linear and a plain bias (so each FSDP2 group mixes an FP8 and a
    high-precision all-gather input)."""

    def __init__(self, fan_in: int, fan_out: int, quantizer, dtype: torch.dtype) -> None:
        super().__init__()
        self.lin = RefLinear(fan_in, fan_out, quantizer, dtype)
        self.bias = nn.Parameter(torch.randn(fan_out, dtype=dtype) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(self.lin(x) + self.bias)


class Model(nn.Module):
    def __init__(self, quantizer, dtype: torch.dtype, recompute: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(i, o, quantizer, dtype) for i, o in SHAPES)
        self.recompute = recompute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.recompute else block(x)
        return x


WEIGHTS = [f"blocks.{i}.lin.weight" for i in range(len(SHAPES))]


def new_quantizer(cfg: Config):
    return {"current": CurrentScaling, "current_batch": BatchCurrentScaling}.get(cfg.recipe, lambda: BlockScaling(4))()


def build_pair(cfg: Config, mesh, seed: int = 0):
    """(stock, ours, state, factory): the same initial weights; ``ours`` wrapped."""
    torch.manual_seed(seed)
    dtype = torch.bfloat16 if cfg.params == "bf16" else torch.float32
    base = Model(None, dtype, cfg.recompute)
    stock, ours = copy.deepcopy(base), copy.deepcopy(base)
    for model in (stock, ours):
        quantizer = new_quantizer(cfg)
        for block in model.blocks:
            block.lin.quantizer = quantizer
    factory = RefFactory(ours.blocks[0].lin.quantizer.block)
    if cfg.wrap == "before":
        state = enable_quantized_gather(ours, ours.blocks[0].lin.quantizer, factory, WEIGHTS)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if cfg.params == "fp32_mp" else MixedPrecisionPolicy()
    for model in (stock, ours):
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=cfg.reshard, mp_policy=mp)
        fully_shard(model, mesh=mesh, reshard_after_forward=cfg.reshard, mp_policy=mp)
    if cfg.wrap == "after":
        state = enable_quantized_gather_sharded(ours, ours.blocks[0].lin.quantizer, factory, WEIGHTS)
    return stock, ours, state, factory


class ExtensionSGD(torch.optim.Optimizer):
    """SGD stepped the way TE's FusedAdam steps (its C++ kernels get each
    DTensor's local tensor): below the Python dispatcher, so no tensor
    subclass sees the write. The kernel
    writes the local tensor's own storage: the wrapper must alias the plain
    tensor's (a storage-less wrapper fails here), and only the step hook
    can know the shard changed."""

    def __init__(self, params, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        with torch._C._DisableTorchDispatch():
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        local = getattr(p, "_local_tensor", p)
                        local.add_(getattr(p.grad, "_local_tensor", p.grad), alpha=-group["lr"])


def make_optimizer(cfg: Config, model: nn.Module):
    if cfg.optimizer == "extension":
        return ExtensionSGD(model.parameters(), lr=0.05)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=0.05, foreach=cfg.optimizer == "adamw_foreach",
                             fused=cfg.optimizer == "adamw_fused")


def batch(step: int, mb: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * dist.get_rank() + 10 * step + mb)
    return torch.randn(BATCH, SHAPES[0][0], generator=g).to(dtype)


def row(case: str, check: str, expected, got, passed: bool | None = None) -> dict:
    return {"case": case, "check": check, "expected": str(expected), "got": str(got),
            "passed": bool(expected == got) if passed is None else bool(passed)}


def local(t: torch.Tensor) -> torch.Tensor:
    t = getattr(t, "_local_tensor", t)
    return t._hp if isinstance(t, ShardGatherWeight) else t


def same_grads(stock: nn.Module, ours: nn.Module) -> list[str]:
    """Names of the parameters whose sharded gradients differ."""
    theirs = dict(stock.named_parameters())
    return [n for n, p in ours.named_parameters() if not torch.equal(local(p.grad), local(theirs[n].grad))]


def same_params(stock: nn.Module, ours: nn.Module) -> list[str]:
    theirs = dict(stock.named_parameters())
    return [n for n, p in ours.named_parameters() if not torch.equal(local(p), local(theirs[n]))]


class GatherBytes:
    """Counts the bytes FSDP2's all-gathers receive (their output buffers),
    at the torch.distributed call FSDP2 makes (all_gather_single in torch
    2.13, all_gather_into_tensor before), while active."""

    NAMES = ("all_gather_single", "all_gather_into_tensor")

    def __init__(self) -> None:
        self.bytes = 0
        self._saved: dict[str, object] = {}
        self._depth = 0

    def __enter__(self) -> GatherBytes:
        for name in self.NAMES:
            if hasattr(dist, name):
                self._saved[name] = getattr(dist, name)
                setattr(dist, name, self._counting(self._saved[name]))
        return self

    def _counting(self, original):
        def call(output_tensor, input_tensor, *args, **kwargs):
            if self._depth == 0:  # one of them may call the other
                self.bytes += output_tensor.numel() * output_tensor.element_size()
            self._depth += 1
            try:
                return original(output_tensor, input_tensor, *args, **kwargs)
            finally:
                self._depth -= 1
        return call

    def __exit__(self, *exc) -> None:
        for name, original in self._saved.items():
            setattr(dist, name, original)


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


def train_step(model, _optimizer, cfg: Config, step: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """One optimizer step over ``cfg.microbatches`` microbatches; returns the outputs."""
    outs = []
    for mb in range(cfg.microbatches):
        out = model(batch(step, mb, dtype))
        loss_of(out).backward()
        outs.append(out.detach())
    return outs


def parity_rows(cfg: Config, mesh) -> list[dict]:
    """Ours against stock, step by step: outputs, gradients and parameters
    bit-exact; one quantization per weight per step (the refresh), none at
    a gather; one reduction per step; the usages every gather gave."""
    stock, ours, state, factory = build_pair(cfg, mesh)
    opt_s, opt_q = make_optimizer(cfg, stock), make_optimizer(cfg, ours)
    state.attach(opt_q)
    state.refresh()  # prime: before the first forward
    dtype = torch.bfloat16 if cfg.params != "fp32" else torch.float32
    quantizer = ours.blocks[0].lin.quantizer
    rows, mismatched, calls = [], [], []
    for step in range(cfg.steps):
        with GatherBytes() as bytes_stock:
            outs_s = train_step(stock, opt_s, cfg, step, dtype)
        before = quantizer.calls
        with GatherBytes() as bytes_ours:
            outs_q = train_step(ours, opt_q, cfg, step, dtype)
        calls.append(quantizer.calls - before)  # quantizations during forward/backward: none
        mismatched += [f"step {step} mb {i} output" for i, (a, b) in enumerate(zip(outs_s, outs_q)) if not torch.equal(a, b)]
        mismatched += [f"step {step} grad {n}" for n in same_grads(stock, ours)]
        opt_s.step(), opt_q.step()
        opt_s.zero_grad(), opt_q.zero_grad()
        mismatched += [f"step {step} param {n}" for n in same_params(stock, ours)]
    counts = state.counts()
    world = mesh.size()
    rows.append(row(cfg.name, "outputs, grads and params bit-exact with stock", [], mismatched))
    rows.append(row(cfg.name, "quantizations inside forward/backward per step", [0] * cfg.steps, calls))
    rows.append(row(cfg.name, "shards made: prime + one per weight per step, none in a hook",
                    (len(WEIGHTS) * (cfg.steps + 1), 0), (quantizer.calls, counts.hook_remakes)))
    rows.append(row(cfg.name, "amax reductions: one per refresh", cfg.steps + 1 if world > 1 else 0, counts.reductions))
    rows.append(usage_row(cfg, factory))
    rows.append(bytes_row(cfg, bytes_stock.bytes, bytes_ours.bytes, world))
    if hasattr(quantizer, "batches"):
        one = [("statistics", len(WEIGHTS)), ("quantize_all", len(WEIGHTS))]
        rows.append(row(cfg.name, "a batch quantizer: one statistics and one quantize_all call per refresh, all weights",
                        one * (cfg.steps + 1), quantizer.batches))
        # FSDP2's lazy init re-pads the short shards (new storage: the shard is
        # carried over, nothing kept), so the first step makes those in new memory.
        rows.append(row(cfg.name, "shards written over the last ones' memory, per refresh (none at the prime)",
                        [0, len(WEIGHTS) - short_shards(world)] + [len(WEIGHTS)] * (cfg.steps - 1), quantizer.reused))
    return rows


def short_shards(world: int) -> int:
    """How many of this rank's weight shards have fewer rows than FSDP2's padded shard."""
    rank, short = dist.get_rank(), 0
    for _, rows in SHAPES:
        per = -(-rows // world)
        short += max(0, min(per, rows - rank * per)) < per
    return short


def usage_row(cfg: Config, factory: RefFactory) -> dict:
    """reshard -> forward rowwise, backward both (RefFactory says why);
    keep -> one forward gather with both, no backward gather."""
    per_pass = {}
    for phase, sharding, usages in factory.log:
        per_pass.setdefault(f"{phase}/{sharding}", set()).add(usages)
    if cfg.reshard:
        expected = {"forward/fsdp2_reshard": {"rowwise"}, "backward/fsdp2_reshard": {"rowwise+columnwise"}}
    else:
        expected = {"forward/fsdp2_keep": {"rowwise+columnwise"}}
    gathers = len(factory.log)
    per_step = cfg.microbatches * len(SHAPES) * (2 if cfg.reshard else 1)
    return row(cfg.name, "gathered usages per pass, gathers", (expected, per_step * cfg.steps),
               ({k: v for k, v in sorted(per_pass.items())}, gathers))


def bytes_row(cfg: Config, stock: int, ours: int, world: int) -> dict:
    """All-gathered bytes in the last step: weights travel as 1 byte per
    element instead of the gathered dtype's; biases as before."""
    padded = sum(-(-o // world) * world * i for i, o in SHAPES)  # FSDP2 gathers the padded shards
    bias_bytes = sum(-(-o // world) * world for _, o in SHAPES) * 2  # bf16 (or fp32 widened below)
    gathered_dtype = 4 if cfg.params == "fp32" else 2
    bias_bytes = bias_bytes * gathered_dtype // 2
    expected_stock = (padded * gathered_dtype + bias_bytes) * cfg.microbatches * (2 if cfg.reshard else 1)
    expected_ours = (padded * 1 + bias_bytes) * cfg.microbatches * (2 if cfg.reshard else 1)
    if world == 1:
        expected_stock = expected_ours = 0  # FSDP2 copies instead of gathering
    return row(cfg.name, "all-gathered bytes in one step (stock, ours)", (expected_stock, expected_ours), (stock, ours))


class Capture:
    """Forward pre-hooks that keep each layer's gathered weight (the
    RefFloat8Weight FSDP2 installed) as it is when the GEMM starts."""

    def __init__(self, model: nn.Module) -> None:
        self.seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.handles = [block.lin.register_forward_pre_hook(self._hook(i)) for i, block in enumerate(model.blocks)]

    def _hook(self, index: int):
        def hook(module, args):
            weight = module.weight
            data = weight._data.view(torch.uint8).clone() if isinstance(weight, RefFloat8Weight) else None
            self.seen[index] = (data, weight._scale_inv.clone() if data is not None else None)
        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def full_weights(model: nn.Module, dtype: torch.dtype | None) -> list[torch.Tensor]:
    """Every layer's whole weight, from its shards (what stock gathers)."""
    from workspace_manager._shard_gather import plain_tensor

    out = []
    for name in WEIGHTS:
        full = plain_tensor(model.get_parameter(name)).full_tensor()
        out.append(full if dtype is None else full.to(dtype))
    return out


def bytes_rows(cfg: Config, mesh) -> list[dict]:
    """The gathered FP8 bytes and scale of every layer equal those of
    quantizing the whole gathered weight (the reduced statistic gives every
    rank the whole weight's scale), after priming and after a step."""
    stock, ours, state, _ = build_pair(cfg, mesh)
    opt = make_optimizer(cfg, ours)
    state.attach(opt)
    state.refresh()
    rows = []
    for when in ("after priming", "after a step"):
        capture = Capture(ours)
        dtype = torch.float32 if cfg.params == "fp32" else torch.bfloat16
        wholes = full_weights(ours, None if cfg.params == "bf16" else dtype)
        with torch.no_grad():
            ours(batch(0, 0, dtype))
        capture.remove()
        reference = new_quantizer(cfg)
        bad = []
        for i, whole in enumerate(wholes):
            data, scale_inv = quantize_whole(whole, reference)
            got_data, got_scale = capture.seen[i]
            if got_data is None or not torch.equal(got_data, data.view(torch.uint8)) or not torch.equal(got_scale, scale_inv):
                bad.append(i)
        rows.append(row(f"bytes {cfg.name}", f"gathered bytes and scale == whole-weight quantization, {when}", [], bad))
        train_step(ours, opt, replace(cfg, microbatches=1), 0, dtype)
        opt.step()
        opt.zero_grad()
    return rows


def stale_shards(state) -> list[str]:
    return state.stale()


def shard_ids(state) -> dict[str, int]:
    """Identity of each cached shard's bytes (a re-stamp keeps them; a remake does not)."""
    return {name: id(param._local_tensor._link.shard.data) for name, param in state.wrapped()}


def shard_memory(state) -> dict[str, int]:
    """Where each cached shard's bytes are (a remake in the kept memory keeps it)."""
    return {name: param._local_tensor._link.shard.data.data_ptr() for name, param in state.wrapped()}


def refresh_rows(mesh) -> list[dict]:
    """A shard is made again after a step that wrote its parameter, and not
    otherwise: not by microbatches, not by an optimizer holding other
    weights, not by another model's optimizer."""
    cfg = Config(microbatches=4)
    _, ours, state, _ = build_pair(cfg, mesh)
    _, other, other_state, _ = build_pair(cfg, mesh, seed=1)
    quantizer = ours.blocks[0].lin.quantizer
    opt_all = torch.optim.AdamW([p for n, p in ours.named_parameters() if n != WEIGHTS[1]], lr=0.05)
    opt_one = torch.optim.SGD([ours.get_parameter(WEIGHTS[1])], lr=0.05)
    opt_other = torch.optim.AdamW(other.parameters(), lr=0.05)
    for opt, st in ((opt_all, state), (opt_one, state), (opt_other, other_state)):
        st.attach(opt)
    rows = [row("refresh", "prime: one quantization per weight", len(WEIGHTS), state.refresh())]
    start, ids = quantizer.calls, shard_ids(state)
    for model in (ours, other):
        train_step(model, None, cfg, 0, torch.bfloat16)
    rows.append(row("refresh", "4 microbatches, no step: no quantization, same shards",
                    (0, ids), (quantizer.calls - start, shard_ids(state))))
    opt_other.step()
    rows.append(row("refresh", "another model's step: no quantization, same shards",
                    (0, ids), (quantizer.calls - start, shard_ids(state))))
    opt_one.step()
    changed = sorted(n for n, i in shard_ids(state).items() if i != ids[n])
    rows.append(row("refresh", "a step holding one weight remakes that shard only",
                    (1, [WEIGHTS[1]]), (quantizer.calls - start, changed)))
    ids = shard_ids(state)
    opt_all.step()
    changed = sorted(n for n, i in shard_ids(state).items() if i != ids[n])
    rows.append(row("refresh", "a step holding the others remakes theirs",
                    (3, sorted(set(WEIGHTS) - {WEIGHTS[1]})), (quantizer.calls - start, changed)))
    rows.append(row("refresh", "no stale shard after the steps", [], stale_shards(state)))
    return rows


def sharded_param(model: nn.Module, name: str) -> torch.Tensor:
    """FSDP2's sharded parameter ``name`` of ``model``, also while the module holds the gathered one."""
    from workspace_manager._fsdp2 import fsdp2_parameters

    owner, _, attr = name.rpartition(".")
    module = model.get_submodule(owner)
    return next(r.sharded for r in fsdp2_parameters(model) if r.module is module and r.name == attr)


def kept_rows(mesh) -> list[dict]:
    """A refresh writes a shard over the last one's memory only where FSDP2
    holds the weight sharded. With ``reshard_after_forward=False`` a forward
    under ``no_grad`` leaves the gathered weights alive, and the next
    forward reads them without gathering; a write and a refresh in between
    must then get new memory, or that forward reads the old bytes with the
    new scale (stock reads its old gathered bf16 weight). ``release`` drops
    what is kept."""
    cfg = Config(recipe="current_batch", reshard=False)
    stock, ours, state, _ = build_pair(cfg, mesh)
    quantizer = ours.blocks[0].lin.quantizer
    state.refresh()
    ids = shard_memory(state)
    state.refresh()
    rows = [row("kept", "a refresh with every weight sharded writes over the last shards", ([len(WEIGHTS)], ids),
                (quantizer.reused[1:], shard_memory(state)))]
    x = batch(0, 0, torch.bfloat16)
    with torch.no_grad():
        first = ours(x)
        stock(x)
        for model in (stock, ours):  # the sharded parameter: the module holds the gathered one now
            local(sharded_param(model, WEIGHTS[2])).mul_(2.0)
        state.refresh()
        fresh = sorted(n for n, i in shard_memory(state).items() if i != ids[n])
        again_s, again_q = stock(x), ours(x)
    rows.append(row("kept", "a refresh while the gathered weights are alive: new memory for every shard",
                    (0, sorted(WEIGHTS)), (quantizer.reused[-1], fresh)))
    rows.append(row("kept", "the next forward (no gather) reads what the first gathered, as stock",
                    (True, True), (torch.equal(again_q, again_s), torch.equal(again_q, first))))
    state.release()
    state.refresh()
    rows.append(row("kept", "after release nothing is kept: new memory", 0, quantizer.reused[-1]))
    return rows


def version_rows(mesh) -> list[dict]:
    """Writes outside an optimizer step move the version counter, and the
    next gather remakes exactly those shards (to the new weights' bytes)."""
    cfg = Config()
    stock, ours, state, _ = build_pair(cfg, mesh)
    state.refresh()
    rows = []
    with torch.no_grad():
        ours.get_parameter(WEIGHTS[2]).mul_(0.5)
    rows.append(row("version", "an in-place write marks that shard stale", [WEIGHTS[2]], stale_shards(state)))
    rows += gather_matches("version", "after the in-place write", ours, state, remade=1)
    ours.load_state_dict(stock.state_dict())
    rows.append(row("version", "load_state_dict marks every shard stale", sorted(WEIGHTS), sorted(stale_shards(state))))
    rows += gather_matches("version", "after load_state_dict", ours, state, remade=len(WEIGHTS))
    return rows


def gather_matches(case: str, when: str, model, state, remade: int) -> list[dict]:
    before = state.counts().hook_remakes
    capture = Capture(model)
    wholes = full_weights(model, None)
    with torch.no_grad():
        model(batch(0, 0, torch.bfloat16))
    capture.remove()
    reference = new_quantizer(Config())
    bad = [i for i, w in enumerate(wholes)
           if not torch.equal(capture.seen[i][0], quantize_whole(w, reference)[0].view(torch.uint8))]
    return [row(case, f"shards remade in the gather hook {when}", remade, state.counts().hook_remakes - before),
            row(case, f"gathered bytes == whole-weight quantization {when}", [], bad)]


def without_step_hook_rows(mesh) -> list[dict]:
    """The refresh left out (no ``attach``): after a step every shard is
    stale, and the version counters still catch it at the next gather."""
    cfg = Config()
    _, ours, state, _ = build_pair(cfg, mesh)
    opt = make_optimizer(cfg, ours)
    state.refresh()
    train_step(ours, opt, cfg, 0, torch.bfloat16)
    opt.step()
    rows = [row("no_step_hook", "every shard stale after the step", sorted(WEIGHTS), sorted(stale_shards(state)))]
    return rows + gather_matches("no_step_hook", "after an unhooked step", ours, state, remade=len(WEIGHTS))


def holds_wrapper(obj) -> bool:
    """Whether a state dict (nested) holds a ShardGatherWeight anywhere."""
    import torch.utils._pytree as pytree

    return any(isinstance(getattr(t, "_local_tensor", t), ShardGatherWeight)
               for t in pytree.tree_leaves(obj) if isinstance(t, torch.Tensor))


def dcp_rows(mesh, out_dir: Path) -> list[dict]:
    """state_dict and DCP see plain tensors: a checkpoint of ours loads into
    a model built without the wrapper, and back into ours (whose shards the
    load marks stale, so the next gather quantizes the loaded weights)."""
    import torch.distributed.checkpoint as dcp

    cfg = Config()
    stock, ours, state, _ = build_pair(cfg, mesh)
    opt = make_optimizer(cfg, ours)
    state.attach(opt)
    state.refresh()
    train_step(ours, opt, cfg, 0, torch.bfloat16)
    opt.step()
    saved = {n: local(p).clone() for n, p in ours.named_parameters()}
    sd = ours.state_dict()
    rows = [row("dcp", "model and optimizer state dicts hold no wrapper", (False, False),
                (holds_wrapper(sd), holds_wrapper(opt.state_dict())))]
    path = out_dir / "ckpt"
    dcp.save(sd, checkpoint_id=str(path))
    target = stock.state_dict()  # the model built without the wrapper
    dcp.load(target, checkpoint_id=str(path))
    rows.append(row("dcp", "a plain model loads ours", [], [n for n, p in stock.named_parameters()
                                                            if not torch.equal(local(p), saved[n])]))
    with torch.no_grad():
        for p in ours.parameters():
            p.zero_()
    dcp.load(ours.state_dict(), checkpoint_id=str(path))
    rows.append(row("dcp", "ours loads it back", [], [n for n, p in ours.named_parameters()
                                                      if not torch.equal(local(p), saved[n])]))
    rows.append(row("dcp", "the load marks every shard stale", sorted(WEIGHTS), sorted(stale_shards(state))))
    rows += gather_matches("dcp", "after the load", ours, state, remade=len(WEIGHTS))
    fulls = {n: t for n, t in zip(WEIGHTS, full_weights(ours, None))}
    if dist.get_rank() == 0:
        torch.save(fulls, out_dir / "full_weights.pt")
    return rows


def refusal_rows(mesh) -> list[dict]:
    """After its first forward FSDP2 has fixed what its all-gather sends, and
    a parameter FSDP2 does not shard has no all-gather: both refused by name."""
    cfg = Config()
    stock, _, _, factory = build_pair(cfg, mesh)
    loss_of(stock(batch(0, 0, torch.bfloat16))).backward()
    rows = []
    for what, model, names, words in [
        ("after the first forward", stock, WEIGHTS[:1], "has run its first forward"),
        ("a parameter FSDP2 does not shard", Model(None, torch.bfloat16, False), WEIGHTS[:1], "not a parameter FSDP2"),
    ]:
        try:
            enable_quantized_gather_sharded(model, new_quantizer(cfg), factory, names)
            got = "no error"
        except InvalidContextError as err:
            got = "refused" if words in str(err) else f"refused otherwise: {err}"
        rows.append(row("refusals", what, "refused", got))
    return rows


def freed_rows(mesh) -> list[dict]:
    """A model trained with the quantized gather is freed once the user
    drops it (no state of the mechanism keeps it alive): RL trainers build
    and drop models in one process."""
    import gc
    import weakref

    cfg = Config(microbatches=2)
    stock, ours, state, _ = build_pair(cfg, mesh)
    opt = make_optimizer(cfg, ours)
    state.attach(opt)
    for step in range(2):
        train_step(ours, opt, cfg, step, torch.bfloat16)
        opt.step()
        opt.zero_grad()
    held = [weakref.ref(ours), weakref.ref(local(ours.get_parameter(WEIGHTS[0])))]
    del stock, ours, state, opt
    gc.collect()
    return [row("freed", "model and its wrapped local tensors freed after del", [False, False],
                [ref() is not None for ref in held])]


def run_all(mesh, out_dir: Path) -> list[dict]:
    rows = []
    cases = [(cfg.name, lambda cfg=cfg: parity_rows(cfg, mesh)) for cfg in PARITY]
    cases += [(f"bytes {cfg.name}", lambda cfg=cfg: bytes_rows(cfg, mesh))
              for cfg in (Config(), Config(recipe="block"), Config(params="fp32_mp"))]
    cases += [("refusals", lambda: refusal_rows(mesh))]
    cases += [("refresh", lambda: refresh_rows(mesh)), ("kept", lambda: kept_rows(mesh)),
              ("version", lambda: version_rows(mesh)),
              ("no_step_hook", lambda: without_step_hook_rows(mesh)), ("dcp", lambda: dcp_rows(mesh, out_dir)),
              ("freed", lambda: freed_rows(mesh))]
    only = os.environ.get("GATHER_CASES")
    for name, case in cases:
        if only and not any(part in name for part in only.split(",")):
            continue
        try:
            rows.extend(case())
        except Exception as exc:  # noqa: BLE001 - reported as a failed row, with the traceback on stderr
            traceback.print_exc()
            rows.append(row(name, "runs", "no error", f"{type(exc).__name__}: {exc}"))
    return rows


def main() -> int:
    result = Path(sys.argv[1])
    out_dir = result.parent
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    rows = run_all(mesh, out_dir)
    return report(result, {"rank": rank, "rows": rows})


if __name__ == "__main__":
    run(main)
