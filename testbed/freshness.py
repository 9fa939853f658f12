"""What the freshness GPU test and the FP8-parameter benchmark both build and run.

* :func:`build_model`: two blocks of one module kind (``Linear``,
  ``LayerNormLinear``, ``LayerNormMLP``, ``GroupedLinear`` or a te.ops MLP
  in one ``te.ops.Sequential``), stock or drop-in, bf16 or quantized
  parameters, unsharded or under FSDP2 (``fully_shard`` per block and at
  the root, resharding after forward or not); seeded, so every variant
  starts from the same weights.
* :func:`reference_reset`: what makes stock TE right after an optimizer
  step, the reference the drop-ins must equal bit for bit where stock reads
  a stale copy: TE's own ``_reset_caches()`` on every quantized parameter
  with a transpose, which is then derived again from the current data, and,
  under FSDP2, the transpose of each unsharded parameter FSDP2 keeps cleared.
* :func:`train`: a few optimizer steps, recording what must be equal.

TE, CUDA and ``te_integration`` are imported inside the functions.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch

from .experts import build_expert_stack
from .model import Stack, shard
from .ops_model import build_ops_mlp

__all__ = ["KINDS", "SHARDINGS", "OPTIMIZERS", "build_model", "reference_reset", "make_optimizer", "train",
           "TrainRecord", "same", "input_grad_error"]

KINDS = ("Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear", "ops")
SHARDINGS = ("none", "fsdp2_reshard", "fsdp2_keep")
OPTIMIZERS = ("FusedAdam", "SGD")
HIDDEN, FFN, EXPERTS, BLOCKS = 128, 256, 4, 2


def _dense_block(kind: str, device: str):
    import transformer_engine.pytorch as te

    kwargs = dict(params_dtype=torch.bfloat16, device=device)
    if kind == "LayerNormMLP":
        return te.LayerNormMLP(HIDDEN, FFN, **kwargs)
    return getattr(te, kind)(HIDDEN, HIDDEN, **kwargs)


def _dense_stack(kind: str, *, managed: bool, recipe, quantized_init: bool, sharding: str) -> Stack:
    import transformer_engine.pytorch as te

    import te_integration as ti

    qinit = quantized_init and recipe is not None
    meta = qinit and sharding != "none"  # TE's quantized parameters are sharded from the meta device
    init = te.quantized_model_init(enabled=True, recipe=recipe) if qinit else contextlib.nullcontext()
    torch.manual_seed(0)
    with init:
        model = Stack(*[_dense_block(kind, "meta" if meta else "cuda") for _ in range(BLOCKS)])
    if managed:
        ti.convert_model(model)
    if sharding != "none":
        shard(model, sharding == "fsdp2_reshard", materialize=meta)
    return model


def build_model(kind: str, *, managed: bool, recipe, quantized_init: bool = True, sharding: str = "none"):
    """Two blocks of ``kind`` (see the module docstring)."""
    if kind not in KINDS or sharding not in SHARDINGS:
        raise ValueError(f"build_model: kind must be one of {KINDS} and sharding one of {SHARDINGS}; "
                         f"received {kind!r}, {sharding!r}")
    sharded, reshard = sharding != "none", sharding == "fsdp2_reshard"
    if kind == "GroupedLinear":
        return build_expert_stack(BLOCKS, EXPERTS, HIDDEN, recipe=recipe, managed=managed,
                                  quantized_init=quantized_init, sharded=sharded, reshard_after_forward=reshard)
    if kind == "ops":
        return build_ops_mlp(HIDDEN, FFN, BLOCKS, managed=managed, recipe=recipe, quantized_init=quantized_init,
                             shard=sharded, reshard_after_forward=reshard)
    return _dense_stack(kind, managed=managed, recipe=recipe, quantized_init=quantized_init, sharding=sharding)


def reference_reset(model: torch.nn.Module) -> int:
    """Stock TE with the stale-transpose fault removed, applied after an
    optimizer step: returns how many transposes it invalidated or cleared."""
    from transformer_engine.pytorch.tensor.utils import clear_columnwise_cache

    from workspace_manager.extending import fsdp2_gathered_parameters

    count = 0
    for param in model.parameters():
        local = getattr(param, "_local_tensor", param)
        if hasattr(local, "_reset_caches") and getattr(local, "_transpose", None) is not None:
            local._reset_caches()
            # Made again now, as the next use would: te.ops's grouped op reads
            # the columnwise data as it finds it and derives none.
            local.update_usage(columnwise_usage=True)
            count += 1
    for _, _, gathered in fsdp2_gathered_parameters(model):
        if getattr(gathered, "_transpose", None) is not None:
            clear_columnwise_cache(gathered)
            count += 1
    return count


def make_optimizer(name: str, model: torch.nn.Module, lr: float = 1e-2):
    """TE's FusedAdam with fp32 master weights, or torch's SGD."""
    if name == "SGD":
        return torch.optim.SGD(model.parameters(), lr=lr)
    import transformer_engine.pytorch as te

    return te.optimizers.FusedAdam(list(model.parameters()), lr=lr, master_weights=True,
                                   master_weight_dtype=torch.float32)


@dataclass
class TrainRecord:
    """What a run produced: losses, input gradients and parameters (this
    rank's shards) after each step, and what the stale-copy checks saw."""

    losses: list[float] = field(default_factory=list)
    tensors: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    #: Stale reads the GEMM watch counted (``check_stale_reads(action="count")``),
    #: in all and per step, and the first few described.
    stale_reads: int = 0
    stale_reads_per_step: list[int] = field(default_factory=list)
    stale_read_examples: list[str] = field(default_factory=list)
    #: Stale copies ``stale_workspaces`` found after each step, before the next forward.
    stale_found: list[int] = field(default_factory=list)


def _inputs(step: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(1000 + step)
    return torch.randn(256, HIDDEN, dtype=torch.bfloat16, device="cuda", generator=g).requires_grad_()


def _snapshot(record: TrainRecord, model: torch.nn.Module, step: int) -> None:
    from transformer_engine.pytorch.quantized_tensor import QuantizedTensor

    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        value = local.dequantize() if isinstance(local, QuantizedTensor) else local
        record.tensors.append((f"param:{name}:{step}", value.detach().clone()))


def train(model: torch.nn.Module, recipe, optimizer: str, steps: int = 4, *, after_step: Any = None,
          watch: bool = True) -> TrainRecord:
    """``steps`` steps of ``model`` under ``recipe`` (FP8 autocast), loss
    the mean square of the output; ``after_step(model)`` runs after each
    optimizer step (the reference's reset). With ``watch``, the GEMMs are
    watched for stale reads and the model inspected for stale copies."""
    import transformer_engine.pytorch as te

    import te_integration as ti

    record, opt = TrainRecord(), make_optimizer(optimizer, model)
    gemms = ti.check_stale_reads(model, action="count") if watch else contextlib.nullcontext()
    with gemms as seen:
        for step in range(steps):
            x = _inputs(step)
            with te.autocast(enabled=True, recipe=recipe):
                out = model(x)
            loss = out.float().square().mean()
            loss.backward()
            record.losses.append(loss.item())
            record.tensors.append((f"dx:{step}", x.grad.detach().clone()))
            opt.step()
            opt.zero_grad(set_to_none=True)
            if after_step is not None:
                after_step(model)
            if watch:
                record.stale_found.append(len(ti.stale_workspaces(model)))
                record.stale_reads_per_step.append(len(seen.reads) - sum(record.stale_reads_per_step))
            _snapshot(record, model, step)
    if watch:
        record.stale_reads = len(seen.reads)
        record.stale_read_examples = [str(read) for read in seen.reads[:6]]
    return record


def same(a: TrainRecord, b: TrainRecord) -> bool:
    """Bit for bit: every loss and every recorded tensor."""
    return a.losses == b.losses and len(a.tensors) == len(b.tensors) and all(
        ka == kb and torch.equal(ta, tb) for (ka, ta), (kb, tb) in zip(a.tensors, b.tensors))


def input_grad_error(a: TrainRecord, b: TrainRecord) -> float:
    """Largest relative error of ``a``'s input gradients against ``b``'s, over the steps."""
    worst = 0.0
    for (ka, ta), (_, tb) in zip(a.tensors, b.tensors):
        if ka.startswith("dx:"):
            norm = tb.float().norm().item()
            worst = max(worst, (ta.float() - tb.float()).norm().item() / norm if norm else 0.0)
    return worst
