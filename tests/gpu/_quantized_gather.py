"""torchrun worker: the quantized FSDP2 all-gather (docs/decisions.md, D13)
against stock TE with bf16 parameters, Float8CurrentScaling.

``torchrun --nproc_per_node=N tests/gpu/_quantized_gather.py OUT.json``
writes one report (``test_quantized_gather.py`` reads it):

* ``bytes``: the binding's shard path (``_compat.shard_amax`` and
  ``cast_with_amax``, the amax not reduced: one rank's whole weight) against
  TE's ``Float8CurrentScalingQuantizer`` on the same weight: FP8 bytes and
  scale_inv, for several shapes, an all-zero weight and one of tiny values.
* ``configs``: two layers of Linear, LayerNormLinear or LayerNormMLP, bf16
  parameters, each layer and the root ``fully_shard``-ed; stock TE modules
  against the drop-ins with ``enable_quantized_gather`` (the FSDP2 policy
  pinned with ``QuantizedGather.ON``, so that it is set up at world size 1
  too); 1 and 4 microbatches, ``reshard_after_forward`` True and False,
  AdamW and SGD, and ``torch.utils.checkpoint`` around each layer. Per
  config: whether every microbatch's output and input gradient, every
  step's sharded parameter gradients and the parameters after each step
  equal stock's bit for bit (with the first difference where not), the
  shard state's counts, and the bytes FSDP2's all-gathers handed each rank
  per step, for both models.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from testbed.dist import guard, run_worker  # noqa: E402
from testbed.recipes import make_recipe  # noqa: E402

HIDDEN, FFN, TOKENS, STEPS = 256, 512, 64, 2
KINDS = ("Linear", "LayerNormLinear", "LayerNormMLP")
CONFIGS = [dict(kind=k, microbatches=mb, reshard=r, optimizer=o, checkpoint=False)
           for k in KINDS for mb in (1, 4) for r in (True, False) for o in ("adamw", "sgd")]
CONFIGS += [dict(kind=k, microbatches=1, reshard=r, optimizer="adamw", checkpoint=True) for k in KINDS
            for r in (True, False)]
BYTE_SHAPES = ((256, 256), (96, 64), (16, 32), (512, 128))


def _layer(kind: str):
    import transformer_engine.pytorch as te

    common = dict(params_dtype=torch.bfloat16, device="cuda")
    if kind == "Linear":
        return te.Linear(HIDDEN, HIDDEN, bias=True, **common)
    if kind == "LayerNormLinear":
        return te.LayerNormLinear(HIDDEN, HIDDEN, bias=True, **common)
    return te.LayerNormMLP(HIDDEN, FFN, **common)


class Layers(torch.nn.Sequential):
    """The layers in turn, each under ``torch.utils.checkpoint`` where asked."""

    checkpoint = False

    def forward(self, x):
        for layer in self:
            x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False) if self.checkpoint else layer(x)
        return x


def build(kind: str, managed: bool, reshard: bool, checkpoint: bool):
    import te_integration as ti
    from torch.distributed.fsdp import fully_shard

    from workspace_manager import FSDP2WorkspacePolicy, QuantizedGather

    torch.manual_seed(0)
    model = Layers(*[_layer(kind) for _ in range(2)])
    model.checkpoint = checkpoint
    if managed:
        ti.convert_model(model)
        for layer in model:
            ti.set_workspace_policy(layer, FSDP2WorkspacePolicy(quantized_gather=QuantizedGather.ON))
    for layer in model:
        fully_shard(layer, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    return model


def _optimizer(name: str, model):
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def _data(step: int, mb: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(100 * step + mb + 7919 * dist.get_rank())
    x = torch.randn(TOKENS, HIDDEN, generator=g, device="cuda", dtype=torch.bfloat16)
    return x.requires_grad_(True)


def _local(t):
    t = t.to_local() if hasattr(t, "to_local") else t
    return getattr(t, "_hp", t)  # a wrapped local tensor: the plain one it holds


class GatheredBytes:
    """Bytes FSDP2's all-gathers hand each rank while active: at world size
    > 1 the output of each all-gather collective; at world size 1, where
    FSDP2 makes no collective, the all-gather input it copies in its place
    (``FSDPParam.all_gather_inputs[0]``, read in ``wait_for_unshard``)."""

    def __enter__(self):
        from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

        self.bytes, self._in_wait, self._saved = 0, False, []
        self._patch(dist, "all_gather_into_tensor", self._counting_collective)
        self._patch(dist, "all_gather_single", self._counting_collective)
        self._patch(_fsdp_param_group.FSDPParamGroup, "wait_for_unshard", self._marking_wait)
        self._patch(_fsdp_param.FSDPParam, "all_gather_inputs", self._counting_inputs)
        return self

    def _patch(self, owner, name, make) -> None:
        if hasattr(owner, name):
            original = owner.__dict__.get(name, getattr(owner, name))
            self._saved.append((owner, name, original))
            setattr(owner, name, make(original))

    def _counting_collective(self, original):
        def call(output_tensor, *args, **kwargs):
            self.bytes += output_tensor.numel() * output_tensor.element_size()
            return original(output_tensor, *args, **kwargs)
        return call

    def _marking_wait(self, original):
        def wait(group, *args, **kwargs):
            self._in_wait = dist.get_world_size() == 1
            try:
                return original(group, *args, **kwargs)
            finally:
                self._in_wait = False
        return wait

    def _counting_inputs(self, original):
        def inputs(fsdp_param):
            out = original.fget(fsdp_param)
            if self._in_wait:
                self.bytes += out[0].numel() * out[0].element_size()
            return out
        return property(inputs)

    def __exit__(self, *exc) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)


def _first_difference(label: str, ours: list, stock: list) -> str | None:
    for i, (a, b) in enumerate(zip(ours, stock, strict=True)):
        if a is None and b is None:
            continue
        if a is None or b is None or not torch.equal(a, b):
            detail = "one is None" if a is None or b is None else f"max |diff| {(a.float() - b.float()).abs().max().item():.3e}"
            return f"{label}[{i}]: {detail}"
    return None


def _train(model, recipe, cfg: dict) -> dict:
    """Outputs, input gradients, sharded gradients, parameters and gathered
    bytes per step, over ``STEPS`` steps of ``cfg``'s microbatches."""
    import transformer_engine.pytorch as te

    opt = _optimizer(cfg["optimizer"], model)
    got = {"outputs": [], "dgrads": [], "grads": [], "params": [], "bytes": []}
    for step in range(STEPS):
        with GatheredBytes() as counted:
            for mb in range(cfg["microbatches"]):
                x = _data(step, mb)
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


def run_config(cfg: dict, recipe) -> dict:
    import te_integration as ti

    from testbed.model import release_memory

    stock = build(cfg["kind"], False, cfg["reshard"], cfg["checkpoint"])
    theirs = _train(stock, recipe, cfg)
    del stock
    ours_model = build(cfg["kind"], True, cfg["reshard"], cfg["checkpoint"])
    setup = ti.enable_quantized_gather(ours_model, recipe)
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


def byte_cases(recipe) -> list[dict]:
    """The shard path's bytes and scale against TE's current-scaling quantizer, whole weights."""
    from te_integration.te import _compat as te_compat

    quantizer = te_compat.weight_quantizer_of(recipe)
    quantizer.set_usage(rowwise=True, columnwise=False)
    weights = {f"{r}x{c}": torch.randn(r, c, device="cuda", dtype=torch.bfloat16) for r, c in BYTE_SHAPES}
    weights["zeros"] = torch.zeros(64, 64, device="cuda", dtype=torch.bfloat16)
    weights["tiny"] = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16) * 1e-30
    out = []
    for name, weight in weights.items():
        data, scale_inv = te_compat.cast_with_amax(weight, te_compat.shard_amax(weight), quantizer)
        stock = quantizer.quantize(weight)
        out.append({"weight": name, "data_equal": bool(torch.equal(data, stock._data.view(torch.uint8))),
                    "scale_inv_equal": bool(torch.equal(scale_inv.reshape(1), stock._scale_inv.reshape(1))),
                    "ours_scale_inv": float(scale_inv.reshape(-1)[0]), "stock_scale_inv": float(stock._scale_inv.reshape(-1)[0])})
    return out


def body(report: dict) -> None:
    report["world_size"] = dist.get_world_size()
    recipe = make_recipe("Float8CurrentScaling")
    guard(report, "bytes", lambda: report.__setitem__("bytes", byte_cases(recipe)))
    for cfg in CONFIGS:
        where = "config " + ", ".join(f"{k}={v}" for k, v in cfg.items())
        guard(report, where, lambda cfg=cfg: report["configs"].append(run_config(cfg, recipe)))


if __name__ == "__main__":
    sys.exit(run_worker(sys.argv[1], body, configs=[], bytes=[]))
