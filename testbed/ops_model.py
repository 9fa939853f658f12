"""The ``te.ops`` models the GPU tests and the benchmarks both build.

* :func:`build_ops_stack`: ``layers`` blocks of ``te.ops.Linear(hidden,
  hidden, bias=False, dtype=bf16)`` (issue 28's stack), each its own
  module, and its ``te.Linear`` twin (:func:`build_linear_stack`), the
  reference the te.ops stack's memory is held against.
* :func:`build_ops_mlp`: ``layers`` blocks of a transformer-style MLP in one
  ``te.ops.Sequential`` each: LayerNorm, Linear + bias (TE fuses the two
  into ``ForwardLinearBiasActivation``), GELU, Linear + bias.

Stock, or converted with ``te_integration.convert_model`` (before
sharding, as it asks); with ``shard``, ``fully_shard`` on every block and
at the root (:func:`testbed.model.shard`). Seeded, so stock and drop-in
start from the same weights. TE and ``te_integration`` are imported inside
the functions.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from .model import shard as shard_model

__all__ = ["build_ops_stack", "build_ops_mlp", "build_linear_stack", "OpsStack"]


class OpsStack(torch.nn.Sequential):
    """Blocks in sequence; each block is called as a module, so FSDP2's hooks run."""

    def forward(self, x, is_first_microbatch=None):  # same call as testbed.model.Stack
        for block in self:
            x = block(x)
        return x


def _finish(model: torch.nn.Module, managed: bool, shard: bool, policy: Any, reshard_after_forward: bool):
    if managed:
        import te_integration as ti

        ti.convert_model(model, policy=policy)
    if shard:
        shard_model(model, reshard_after_forward)
    return model


def _init(recipe, quantized_init: bool):
    import transformer_engine.pytorch as te

    if quantized_init and recipe is not None:
        return te.quantized_model_init(enabled=True, recipe=recipe)
    return contextlib.nullcontext()


def build_ops_stack(hidden: int = 2048, layers: int = 8, *, managed: bool = False, recipe=None,
                    quantized_init: bool = False, shard: bool = True, policy: Any = None,
                    reshard_after_forward: bool = True) -> OpsStack:
    """``layers`` x ``te.ops.Linear(hidden, hidden, bias=False, dtype=bf16)``, from seed 0."""
    import transformer_engine.pytorch as te

    torch.manual_seed(0)
    with _init(recipe, quantized_init):
        model = OpsStack(*[te.ops.Linear(hidden, hidden, bias=False, device="cuda", dtype=torch.bfloat16)
                           for _ in range(layers)])
    return _finish(model, managed, shard, policy, reshard_after_forward)


def build_linear_stack(hidden: int = 2048, layers: int = 8, *, managed: bool = False, recipe=None,
                       quantized_init: bool = False, shard: bool = True) -> OpsStack:
    """The same stack of ``te.Linear(hidden, hidden, bias=False, params_dtype=bf16)``."""
    import transformer_engine.pytorch as te

    torch.manual_seed(0)
    with _init(recipe, quantized_init):
        model = OpsStack(*[te.Linear(hidden, hidden, bias=False, params_dtype=torch.bfloat16, device="cuda")
                           for _ in range(layers)])
    return _finish(model, managed, shard, None, True)


def build_ops_mlp(hidden: int = 2048, ffn: int = 8192, layers: int = 4, *, managed: bool = False, recipe=None,
                  quantized_init: bool = False, shard: bool = True, policy: Any = None,
                  reshard_after_forward: bool = True) -> OpsStack:
    """``layers`` x ``te.ops.Sequential(LayerNorm, Linear+bias, GELU, Linear+bias)``, from seed 0."""
    import transformer_engine.pytorch as te

    torch.manual_seed(0)
    kw = dict(device="cuda", dtype=torch.bfloat16)
    with _init(recipe, quantized_init):
        model = OpsStack(*[te.ops.Sequential(te.ops.LayerNorm(hidden, **kw), te.ops.Linear(hidden, ffn, **kw),
                                             te.ops.GELU(), te.ops.Linear(ffn, hidden, **kw))
                           for _ in range(layers)])
    return _finish(model, managed, shard, policy, reshard_after_forward)
