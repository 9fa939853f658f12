"""The MoE expert MLP the step-time benchmark and tests build: layers of
``GroupedLinear(experts, hidden, ffn)`` -> GELU -> ``GroupedLinear(experts,
ffn, hidden)`` plus the residual, the routed tokens split unevenly over the
experts with one expert empty (:func:`uneven_splits`), bf16 parameters or
parameters made under ``te.quantized_model_init``, stock TE or
``te_integration.GroupedLinear``, and ``fully_shard`` on every layer and the
root (as :func:`testbed.model.shard` does).

It differs from :mod:`testbed.experts`' square blocks in what a router
gives a real MoE layer: two expert GEMMs of different shapes per layer, a
nonlinearity between them, and splits that are neither even nor all
non-empty. TE and ``te_integration`` are imported inside the functions:
importing this module needs torch only.
"""

from __future__ import annotations

import contextlib

import torch

from .model import shard

__all__ = ["ALIGN", "MoEMLPLayer", "MoEMLPStack", "build_moe_mlp_stack", "uneven_splits"]

#: What TE's sm_90 FP8 grouped GEMMs need of every split: a multiple of 16 rows.
ALIGN = 16


def uneven_splits(tokens: int, experts: int, align: int = ALIGN) -> list[int]:
    """``m_splits`` of ``tokens`` over ``experts``: the last expert gets none,
    the others shares in the ratios 1, 2, ..., 7, 1, 2, ... (each a multiple
    of ``align``; the first expert takes what rounding leaves). The same
    split for every call: routing noise is not what is measured."""
    if experts < 2 or tokens < 0 or tokens % align:
        raise ValueError(f"uneven_splits: {tokens} tokens over {experts} experts (needs >= 2 experts and a "
                         f"multiple of {align} tokens)")
    weights = [(i % 7) + 1 for i in range(experts - 1)]
    units, total = tokens // align, sum(weights)
    shares = [units * w // total for w in weights]
    shares[0] += units - sum(shares)
    return [s * align for s in shares] + [0]


class MoEMLPLayer(torch.nn.Module):
    """``x + fc2(gelu(fc1(x, m_splits)), m_splits)``, both GroupedLinear."""

    def __init__(self, fc1: torch.nn.Module, fc2: torch.nn.Module) -> None:
        super().__init__()
        self.fc1, self.fc2 = fc1, fc2

    def forward(self, x, m_splits, is_first_microbatch=None):
        h = self.fc1(x, m_splits, is_first_microbatch=is_first_microbatch)
        h = torch.nn.functional.gelu(h, approximate="tanh")
        return x + self.fc2(h, m_splits, is_first_microbatch=is_first_microbatch)


class MoEMLPStack(torch.nn.Sequential):
    """Layers called with the tokens' fixed :func:`uneven_splits`, as
    ``model(x, is_first_microbatch=...)`` (``x``: (tokens, hidden))."""

    def __init__(self, experts: int, *layers: torch.nn.Module) -> None:
        super().__init__(*layers)
        self.experts = experts

    def forward(self, x, is_first_microbatch=None):
        splits = uneven_splits(x.shape[0], self.experts)
        for layer in self:
            x = layer(x, splits, is_first_microbatch=is_first_microbatch)
        return x


def build_moe_mlp_stack(layers: int, experts: int, hidden: int, ffn: int, *, recipe=None, managed: bool = False,
                        quantized_params: bool = False, sharded: bool = True,
                        reshard_after_forward: bool = True) -> MoEMLPStack:
    """``layers`` x :class:`MoEMLPLayer` of ``experts`` experts, from seed 0:
    stock ``te.GroupedLinear`` or, with ``managed``, ``te_integration.GroupedLinear``.
    ``quantized_params`` (with a ``recipe``): the weights are made under
    ``te.quantized_model_init`` (on the meta device, then materialized after
    sharding, when ``sharded``). ``sharded``: ``fully_shard`` on every layer
    and the root."""
    import transformer_engine.pytorch as te

    import te_integration as ti

    quantized = quantized_params and recipe is not None
    meta = quantized and sharded
    cls = ti.GroupedLinear if managed else te.GroupedLinear
    kw = dict(bias=False, params_dtype=torch.bfloat16, device="meta" if meta else "cuda")
    init = te.quantized_model_init(enabled=True, recipe=recipe) if quantized else contextlib.nullcontext()
    torch.manual_seed(0)
    with init:
        model = MoEMLPStack(experts, *[MoEMLPLayer(cls(experts, hidden, ffn, **kw), cls(experts, ffn, hidden, **kw))
                                       for _ in range(layers)])
    if sharded:
        shard(model, reshard_after_forward, materialize=meta)
    return model
