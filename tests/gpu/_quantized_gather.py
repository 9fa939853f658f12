"""torchrun worker: the quantized FSDP2 all-gather (docs/decisions.md, D13)
against stock TE with bf16 parameters, Float8CurrentScaling and
Float8BlockScaling (2D weight blocks).

``torchrun --nproc_per_node=N tests/gpu/_quantized_gather.py OUT.json``
writes one report (``test_quantized_gather.py`` reads it):

* ``bytes``: the binding's shard path (per-tensor: ``_compat.shard_amaxes`` and
  ``cast_with_amaxes`` of all the weights at once, the amaxes not reduced; 2D blocks:
  ``block_quantize_rows``), on one rank's whole weight, against TE's own
  weight quantizer of the recipe on the same weight: FP8 bytes and
  scale_inv, and for blocks the columnwise data and scales TE's
  ``_create_columnwise`` derives from the gathered weight against those TE
  quantizes; for several shapes, an all-zero weight and one of tiny values.
* ``configs``: two layers of Linear, LayerNormLinear, LayerNormMLP or
  GroupedLinear (four experts, one parameter each), bf16 parameters, each
  layer and the root ``fully_shard``-ed; stock TE modules against the
  drop-ins with ``enable_quantized_gather`` (the FSDP2 policy pinned with
  ``QuantizedGather.ON``, so that it is set up at world size 1 too); 1 and 4
  microbatches, ``reshard_after_forward`` True and False, AdamW and SGD (and
  TE's FusedAdam with fp32 master weights at 4 microbatches), and
  ``torch.utils.checkpoint`` around each layer; DelayedScaling, which the
  policy makes in the call, with 4 microbatches. Per config: whether every
  microbatch's output and input gradient, every step's sharded parameter
  gradients and the parameters after each step equal stock's bit for bit
  (with the first difference where not), the shard state's counts, and the
  bytes FSDP2's all-gathers handed each rank per step, for both models.
* ``checkpoints``: per recipe, the drop-in model trained two steps with
  AdamW and saved with ``torch.distributed.checkpoint`` (model and optimizer
  state dicts), loaded into a stock TE model and its optimizer, then both
  trained one more step: loaded weights, and the step's outputs, gradients
  and weights, bit for bit.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from testbed.dist import guard, run_worker  # noqa: E402
from testbed.gather import GatheredBytes, enable_on  # noqa: E402
from testbed.recipes import make_recipe  # noqa: E402

HIDDEN, FFN, TOKENS, STEPS, EXPERTS = 256, 512, 64, 2, 4
KINDS = ("Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear")
EXACT = ("Float8CurrentScaling", "Float8BlockScaling")
CONFIGS = [dict(recipe=rc, kind=k, microbatches=mb, reshard=r, optimizer=o, checkpoint=False)
           for rc in EXACT for k in KINDS for mb in (1, 4) for r in (True, False) for o in ("adamw", "sgd")]
CONFIGS += [dict(recipe=rc, kind=k, microbatches=1, reshard=r, optimizer="adamw", checkpoint=True)
            for rc in EXACT for k in KINDS for r in (True, False)]
# TE's FusedAdam (fp32 master weights) steps the local tensors below the dispatcher.
CONFIGS += [dict(recipe=rc, kind=k, microbatches=4, reshard=True, optimizer="te_fused_adam", checkpoint=False)
            for rc in EXACT for k in KINDS]
CONFIGS += [dict(recipe="DelayedScaling", kind=k, microbatches=4, reshard=True, optimizer="adamw", checkpoint=False)
            for k in KINDS]
BYTE_SHAPES = ((256, 256), (96, 64), (16, 32), (512, 128), (384, 640), (200, 136))


class Experts(torch.nn.Module):
    """A ``GroupedLinear`` of :data:`EXPERTS` experts, one parameter each,
    the tokens split evenly (its parameters: ``experts.weight0`` ...)."""

    def __init__(self) -> None:
        super().__init__()
        import transformer_engine.pytorch as te

        self.experts = te.GroupedLinear(EXPERTS, HIDDEN, HIDDEN, bias=False, params_dtype=torch.bfloat16,
                                        device="cuda")

    def forward(self, x):
        return self.experts(x, [x.shape[0] // EXPERTS] * EXPERTS)


def _layer(kind: str):
    import transformer_engine.pytorch as te

    common = dict(params_dtype=torch.bfloat16, device="cuda")
    if kind == "Linear":
        return te.Linear(HIDDEN, HIDDEN, bias=True, **common)
    if kind == "LayerNormLinear":
        return te.LayerNormLinear(HIDDEN, HIDDEN, bias=True, **common)
    if kind == "GroupedLinear":
        return Experts()
    return te.LayerNormMLP(HIDDEN, FFN, **common)


class Layers(torch.nn.Sequential):
    """The layers in turn, each under ``torch.utils.checkpoint`` where asked.
    A checkpointed layer enters ``te.autocast`` itself: torch's checkpoint
    recomputes it inside backward, outside the caller's ``te.autocast``, and
    TE's FP8 state must be the forward's there too (``te.checkpoint`` does
    this for TE's own checkpoint)."""

    checkpoint = False
    recipe = None

    def forward(self, x):
        for layer in self:
            x = torch.utils.checkpoint.checkpoint(self._under_autocast, layer, x, use_reentrant=False) \
                if self.checkpoint else layer(x)
        return x

    def _under_autocast(self, layer, x):
        import transformer_engine.pytorch as te

        with te.autocast(recipe=self.recipe):
            return layer(x)


def build(kind: str, managed: bool, reshard: bool, checkpoint: bool):
    """Two layers of ``kind``, stock or converted to drop-ins, sharded; the
    quantized gather is set up by the caller (``testbed.gather.enable_on``)."""
    import te_integration as ti
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Layers(*[_layer(kind) for _ in range(2)])
    model.checkpoint = checkpoint
    if managed:
        ti.convert_model(model)
    for layer in model:
        fully_shard(layer, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    return model


def _optimizer(name: str, model):
    if name == "te_fused_adam":
        import transformer_engine.pytorch as te

        return te.optimizers.FusedAdam(list(model.parameters()), lr=1e-3, master_weights=True,
                                       master_weight_dtype=torch.float32)
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def _data(step: int, mb: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(100 * step + mb + 7919 * dist.get_rank() + 100003 * seed)
    x = torch.randn(TOKENS, HIDDEN, generator=g, device="cuda", dtype=torch.bfloat16)
    return x.requires_grad_(True)


def _local(t):
    t = t.to_local() if hasattr(t, "to_local") else t
    return getattr(t, "_hp", t)  # a wrapped local tensor: the plain one it holds


def _first_difference(label: str, ours: list, stock: list) -> str | None:
    for i, (a, b) in enumerate(zip(ours, stock, strict=True)):
        if a is None and b is None:
            continue
        if a is None or b is None or not torch.equal(a, b):
            detail = "one is None" if a is None or b is None else f"max |diff| {(a.float() - b.float()).abs().max().item():.3e}"
            return f"{label}[{i}]: {detail}"
    return None


def _train(model, recipe, cfg: dict, opt=None) -> dict:
    """Outputs, input gradients, sharded gradients, parameters and gathered
    bytes per step, over ``cfg["steps"]`` (default ``STEPS``) steps of
    ``cfg``'s microbatches, with ``opt`` (default: a new one of ``cfg``'s)."""
    import transformer_engine.pytorch as te

    opt = _optimizer(cfg["optimizer"], model) if opt is None else opt
    got = {"outputs": [], "dgrads": [], "grads": [], "params": [], "bytes": []}
    model.recipe = recipe
    for step in range(cfg.get("steps", STEPS)):
        with GatheredBytes() as counted:
            for mb in range(cfg["microbatches"]):
                x = _data(step, mb, cfg.get("seed", 0))
                with te.autocast(recipe=recipe):
                    out = model(x)
                out.float().pow(2).mean().backward()
                got["outputs"].append(out.detach().clone())
                got["dgrads"].append(x.grad.clone())
            torch.cuda.synchronize()
        got["bytes"].append(counted.bytes)
        got["grads"] += [None if p.grad is None else _local(p.grad).clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad(set_to_none=True)
        got["params"] += [_local(p).detach().clone() for p in model.parameters()]
    return got


def run_config(cfg: dict) -> dict:
    from testbed.model import release_memory

    recipe = make_recipe(cfg["recipe"])
    stock = build(cfg["kind"], False, cfg["reshard"], cfg["checkpoint"])
    theirs = _train(stock, recipe, cfg)
    del stock
    ours_model = build(cfg["kind"], True, cfg["reshard"], cfg["checkpoint"])
    setup = enable_on(ours_model, recipe)
    weights = [p.numel() for c in setup.set_up for p in [ours_model.get_parameter(f"{c.module}.{c.weight}")]]
    ours = _train(ours_model, recipe, cfg)
    counts = setup.state.counts() if setup.state is not None else None
    result = {**cfg, "set_up": [f"{c.module}.{c.weight}" for c in setup.set_up],
              "left_out": [str(c) for c in setup.left_out], "weight_numels": weights,
              "differences": [d for d in (_first_difference(k, ours[k], theirs[k])
                                          for k in ("outputs", "dgrads", "grads", "params")) if d],
              "bytes": {"stock": theirs["bytes"], "ours": ours["bytes"]},
              "counts": None if counts is None else {"refreshes": counts.refreshes, "hook_remakes": counts.hook_remakes,
                                                     "refreshed_shards": counts.refreshed_shards}}
    del ours_model
    release_memory()
    return result


def _weights_for_bytes() -> dict:
    weights = {f"{r}x{c}": torch.randn(r, c, device="cuda", dtype=torch.bfloat16) for r, c in BYTE_SHAPES}
    weights["zeros"] = torch.zeros(64, 64, device="cuda", dtype=torch.bfloat16)
    weights["tiny"] = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16) * 1e-30
    return weights


def byte_cases(recipe_name: str) -> list[dict]:
    """The shard path's bytes and scales against TE's weight quantizer of
    the recipe, whole weights; for 2D blocks also the columnwise form the
    gathered weight derives against the one TE quantizes. Twice: made new,
    then made again in what the first call kept (as every refresh after the
    first makes them) from other values of the same shapes, which must land
    in the same memory and again equal TE's."""
    from te_integration.te import _compat as te_compat

    recipe = make_recipe(recipe_name)
    quantizer = te_compat.weight_quantizer_of(recipe)
    out, kept = [], None
    for round_ in ("new", "kept"):
        weights = _weights_for_bytes()
        if round_ == "kept":
            weights = {name: -0.37 * w for name, w in weights.items()}
        if recipe_name == "Float8CurrentScaling":
            rows, kept = _current_bytes(te_compat, quantizer, weights, kept)
        else:
            rows, kept = _blocks_bytes(te_compat, quantizer, weights, kept)
        out += [{"recipe": recipe_name, "weight": f"{name} ({round_})", **row} for name, row in rows.items()]
    return out


def _current_bytes(te_compat, quantizer, weights: dict, kept: dict | None) -> tuple[dict, dict]:
    """All the weights in one call, as a refresh casts them (one scale kernel for all)."""
    shards = list(weights.values())
    before = [None] * len(shards) if kept is None else [kept[name] for name in weights]
    made = dict(zip(weights, te_compat.cast_with_amaxes(shards, te_compat.shard_amaxes(shards), quantizer, before)))
    rows = {}
    for name, weight in weights.items():
        quantizer.set_usage(rowwise=True, columnwise=False)
        data, scale_inv, slot = made[name]
        stock = quantizer.quantize(weight)
        rows[name] = {"data_equal": bool(torch.equal(data, stock._data.view(torch.uint8))),
                      "scale_inv_equal": bool(torch.equal(scale_inv.reshape(1), stock._scale_inv.reshape(1)))}
        if kept is not None:
            rows[name]["kept_memory_equal"] = slot is kept[name] and data.data_ptr() == kept[name].data.data_ptr()
    return rows, {name: made[name][2] for name in weights}


def _blocks_bytes(te_compat, quantizer, weights: dict, kept: dict | None) -> tuple[dict, dict]:
    """Each weight on its own, as the 2D-block refresh casts them; ``kept``
    and the result: per weight, ``(BlockCast, where its bytes and scales are)``."""
    rows, now = {}, {}
    for name, weight in weights.items():
        cast, memory = kept[name] if kept is not None else (None, None)
        data, scale_inv, cast = te_compat.block_quantize_rows(weight, quantizer, cast)
        rows[name] = _block_bytes(te_compat, quantizer, weight, data, scale_inv)
        now[name] = (cast, (data.data_ptr(), scale_inv.data_ptr()))
        if memory is not None:
            rows[name]["kept_memory_equal"] = now[name][1] == memory
    return rows, now


def _block_bytes(te_compat, quantizer, weight, data, scale_inv) -> dict:
    both = quantizer.copy()
    both.set_usage(rowwise=True, columnwise=True)
    stock = both.quantize(weight)
    blocks = (-(-weight.shape[0] // 128), -(-weight.shape[1] // 128))
    ours = te_compat.block_weight(data, scale_inv.clone(), torch.bfloat16, quantizer)
    ours.update_usage(rowwise_usage=True, columnwise_usage=True)  # as TE's backward asks
    return {"data_equal": torch.equal(data, stock._rowwise_data.view(torch.uint8)),
            "scale_inv_equal": torch.equal(scale_inv[:, :blocks[1]], stock._rowwise_scale_inv[:, :blocks[1]]),
            "columnwise_data_equal": torch.equal(ours._columnwise_data.view(torch.uint8),
                                                 stock._columnwise_data.view(torch.uint8)),
            "columnwise_scale_inv_equal": torch.equal(ours._columnwise_scale_inv[:, :blocks[0]],
                                                      stock._columnwise_scale_inv[:, :blocks[0]])}


def checkpoint_case(recipe_name: str, directory: str) -> dict:
    """A DCP checkpoint the drop-in model wrote, loaded by stock TE: the
    loaded weights, then one more step of both, bit for bit."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    recipe = make_recipe(recipe_name)
    cfg = dict(kind="LayerNormMLP", microbatches=2, reshard=True, optimizer="adamw", checkpoint=False)
    ours = build(cfg["kind"], True, True, False)
    setup = enable_on(ours, recipe)
    ours_opt = _optimizer("adamw", ours)
    _train(ours, recipe, cfg, opt=ours_opt)
    model_sd, optim_sd = get_state_dict(ours, ours_opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=directory)
    stock = build(cfg["kind"], False, True, False)
    stock_opt = _optimizer("adamw", stock)
    _train(stock, recipe, dict(cfg, microbatches=1), opt=stock_opt)  # optimizer state exists: the load fills it
    model_sd, optim_sd = get_state_dict(stock, stock_opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=directory)
    set_state_dict(stock, stock_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded = [torch.equal(_local(a).detach(), _local(b).detach()) for a, b in zip(ours.parameters(), stock.parameters())]
    go_on = dict(cfg, steps=1, seed=7)
    theirs_next, ours_next = _train(stock, recipe, go_on, opt=stock_opt), _train(ours, recipe, go_on, opt=ours_opt)
    return {"recipe": recipe_name, "set_up": [f"{c.module}.{c.weight}" for c in setup.set_up],
            "loaded_equal": all(loaded),
            "differences": [d for d in (_first_difference(k, ours_next[k], theirs_next[k])
                                        for k in ("outputs", "dgrads", "grads", "params")) if d]}


def body(report: dict) -> None:
    import tempfile

    report["world_size"] = dist.get_world_size()
    for name in EXACT:
        guard(report, f"bytes {name}", lambda name=name: report["bytes"].extend(byte_cases(name)))
    only = os.environ.get("TE_WM_GATHER_ONLY")  # e.g. "checkpoint": the configs with that key true
    for cfg in [c for c in CONFIGS if not only or c.get(only)]:
        where = "config " + ", ".join(f"{k}={v}" for k, v in cfg.items())
        guard(report, where, lambda cfg=cfg: report["configs"].append(run_config(cfg)))
    for name in EXACT:
        holder = [tempfile.mkdtemp(prefix="dcp-") if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(holder)
        guard(report, f"checkpoint {name}",
              lambda name=name, d=holder[0]: report["checkpoints"].append(checkpoint_case(name, d)))


if __name__ == "__main__":
    sys.exit(run_worker(sys.argv[1], body, configs=[], bytes=[], checkpoints=[]))
