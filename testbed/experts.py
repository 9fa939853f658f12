"""The MoE expert stack the GPU benchmarks and tests build: blocks of
``te.GroupedLinear(experts, hidden, hidden, bias=False)``, bf16 params, the
tokens split evenly over the experts (:func:`build_expert_stack`), stock or
``te_integration.GroupedLinear``, one parameter per expert or one grouped
parameter (``single_grouped_weight=True, use_grouped_tensor=True``), sharded
with FSDP2 as :func:`testbed.model.shard` does or not at all; and its
reference (:func:`build_expert_reference`): the same experts as one
``te.Linear`` each, the weights copied, the layout TE's own grouped tests
hold bit-exact against ``GroupedLinear``.

It sits beside :mod:`testbed.model` (whose sharding, policy pinning,
optimizer, data and memory marks it shares) rather than in it, to keep each
file short. TE and ``te_integration`` are imported inside the functions:
importing this module needs torch only.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch

from .model import pin_policy, shard

__all__ = ["RECOMPUTE_MODES", "ExpertBlock", "ExpertStack", "build_expert_reference", "build_expert_stack",
           "even_splits", "expert_weights"]

#: How :class:`ExpertStack` runs its blocks: plainly, or each under
#: ``te.checkpoint`` in its reentrant (TE's default) or non-reentrant form.
RECOMPUTE_MODES = (None, "reentrant", "non_reentrant")


def even_splits(tokens: int, experts: int) -> list[int]:
    """``m_splits``: ``tokens`` split as evenly as can be over ``experts``
    (the first ones take the remainder)."""
    if tokens < 0 or experts < 1:
        raise ValueError(f"even_splits: {tokens} tokens over {experts} experts")
    base, extra = divmod(tokens, experts)
    return [base + (1 if i < extra else 0) for i in range(experts)]


class ExpertStack(torch.nn.Sequential):
    """Blocks called as ``block(x, m_splits, is_first_microbatch=...)``
    with ``x`` of shape (tokens, hidden) and the tokens split evenly over
    ``experts``. The blocks are ``GroupedLinear`` modules or
    :class:`ExpertBlock` (the reference); the root stays a module FSDP2 wraps."""

    def __init__(self, experts: int, *blocks: torch.nn.Module) -> None:
        super().__init__(*blocks)
        self.experts = experts

    def forward(self, x, is_first_microbatch=None, recompute: str | None = None):
        """``recompute``: each block under ``te.checkpoint``, ``"reentrant"``
        (TE's default) or ``"non_reentrant"`` (``use_reentrant=False``)."""
        if recompute not in RECOMPUTE_MODES:
            raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
        splits = even_splits(x.shape[0], self.experts)
        if any(getattr(block, "single_grouped_weight", False) for block in self):
            # TE's grouped-tensor path, which one grouped weight needs, takes its splits on the GPU.
            splits = torch.tensor(splits, dtype=torch.int64, device=x.device)
        for block in self:
            if recompute:
                import transformer_engine.pytorch as te

                x = te.checkpoint(block, x, splits, is_first_microbatch=is_first_microbatch,
                                  use_reentrant=recompute == "reentrant")
            else:
                x = block(x, splits, is_first_microbatch=is_first_microbatch)
        return x


class ExpertBlock(torch.nn.Module):
    """One expert per module (``te.Linear``): the rows of ``x`` split by
    ``m_splits``, each part through its expert, concatenated again. The
    experts are children ``0``, ``1``, ... A plain ``Module``, not a
    ``ModuleList``: the ``fully_shard`` of torch 2.11 refuses every
    ``ModuleList`` (later versions accept one that defines ``forward``)."""

    def __init__(self, experts) -> None:
        super().__init__()
        for i, expert in enumerate(experts):
            self.add_module(str(i), expert)

    def __iter__(self):
        return iter(self._modules.values())

    def __len__(self) -> int:
        return len(self._modules)

    def forward(self, x, m_splits, is_first_microbatch=None):
        parts = torch.split(x, m_splits.tolist() if isinstance(m_splits, torch.Tensor) else list(m_splits))
        return torch.cat([expert(part, is_first_microbatch=is_first_microbatch)
                          for expert, part in zip(self, parts)])


@contextlib.contextmanager
def _single_param_env(enabled: bool):
    """TE 2.20 builds ``single_grouped_weight=True`` only with
    ``NVTE_GROUPED_LINEAR_SINGLE_PARAM`` set (and falls back silently
    otherwise): set for the construction, then put back."""
    key, before = "NVTE_GROUPED_LINEAR_SINGLE_PARAM", os.environ.get("NVTE_GROUPED_LINEAR_SINGLE_PARAM")
    if enabled:
        os.environ[key] = "1"
    try:
        yield
    finally:
        if enabled and before is None:
            os.environ.pop(key, None)
        elif enabled:
            os.environ[key] = before


def _shapes(blocks: int, hidden: int, out_features: int | None) -> list[tuple[int, int]]:
    """``(in, out)`` of each block: ``hidden`` square, or alternating
    ``hidden -> out_features -> hidden`` (distinct shapes tell a weight's
    rowwise data from its columnwise data)."""
    if out_features is None:
        return [(hidden, hidden)] * blocks
    return [(hidden, out_features) if i % 2 == 0 else (out_features, hidden) for i in range(blocks)]


def _grouped_blocks(blocks: int, experts: int, hidden: int, *, managed: bool, single: bool,
                    device: str, out_features: int | None = None) -> list[torch.nn.Module]:
    import transformer_engine.pytorch as te

    import te_integration as ti

    cls = ti.GroupedLinear if managed else te.GroupedLinear
    layout = dict(single_grouped_weight=True, use_grouped_tensor=True) if single else {}
    with _single_param_env(single):
        made = [cls(experts, a, b, bias=False, params_dtype=torch.bfloat16, device=device, **layout)
                for a, b in _shapes(blocks, hidden, out_features)]
    if single and not all(getattr(m, "single_grouped_weight", False) for m in made):
        raise RuntimeError("build_expert_stack: TE did not build the single grouped weight layout")
    return made


def build_expert_stack(blocks: int, experts: int, hidden: int, *, recipe=None, managed: bool = False,
                       single_grouped_weight: bool = False, quantized_init: bool = False, sharded: bool = True,
                       reshard_after_forward: bool = True, policy: Any = None,
                       out_features: int | None = None) -> ExpertStack:
    """``blocks`` x ``GroupedLinear(experts, hidden, hidden, bias=False)``,
    bf16 params, from seed 0: stock ``te.GroupedLinear`` or, with
    ``managed``, ``te_integration.GroupedLinear``; ``single_grouped_weight``:
    one grouped parameter per block (``use_grouped_tensor=True``) instead of
    ``weight0..weightN-1``. ``sharded``: ``fully_shard`` on every block and
    the root (see :func:`shard`); otherwise on the GPU as built.
    ``quantized_init`` and ``policy`` as in :func:`build_stack`;
    ``out_features``: blocks alternate ``hidden -> out_features -> hidden``."""
    import transformer_engine.pytorch as te

    qinit = quantized_init and recipe is not None
    meta = qinit and sharded
    init = te.quantized_model_init(enabled=True, recipe=recipe) if qinit else contextlib.nullcontext()
    torch.manual_seed(0)
    with init:
        model = ExpertStack(experts, *_grouped_blocks(blocks, experts, hidden, managed=managed,
                                                      single=single_grouped_weight,
                                                      device="meta" if meta else "cuda",
                                                      out_features=out_features))
    if policy is not None:
        if not managed:
            raise ValueError("build_expert_stack: a policy can be pinned on drop-ins only (managed=True)")
        pin_policy(model, policy)
    if sharded:
        shard(model, reshard_after_forward, materialize=meta)
    return model


def expert_weights(block: torch.nn.Module) -> list[torch.Tensor]:
    """The experts' weights of one high-precision ``GroupedLinear``, one
    (out, in) tensor each: ``weight0..weightN-1``, or views of the single
    grouped parameter's data."""
    n, grouped = block.num_gemms, getattr(block, "weight", None)
    if getattr(block, "single_grouped_weight", False) and grouped is not None:  # TE packed the experts
        return list(grouped.rowwise_data.view(n, block.out_features, block.in_features).unbind(0))
    return [getattr(block, f"weight{i}") for i in range(n)]


def build_expert_reference(blocks: int, experts: int, hidden: int, *, managed: bool = False,
                           single_grouped_weight: bool = False, sharded: bool = True,
                           reshard_after_forward: bool = True, out_features: int | None = None) -> ExpertStack:
    """The stack :func:`build_expert_stack` builds with these arguments (bf16
    params), its experts as ``te.Linear(hidden, hidden, bias=False)`` modules
    (``te_integration.Linear`` with ``managed``), one :class:`ExpertBlock` a
    block, each weight a copy of the grouped stack's. ``sharded``: the same
    ``fully_shard`` layout (every block and the root)."""
    import transformer_engine.pytorch as te

    import te_integration as ti

    source = build_expert_stack(blocks, experts, hidden, single_grouped_weight=single_grouped_weight, sharded=False,
                                out_features=out_features)
    linear = ti.Linear if managed else te.Linear
    model = ExpertStack(experts, *[ExpertBlock(linear(a, b, bias=False, params_dtype=torch.bfloat16,
                                                      device="cuda") for _ in range(experts))
                                   for a, b in _shapes(blocks, hidden, out_features)])
    with torch.no_grad():
        for grouped, block in zip(source, model):
            for weight, expert in zip(expert_weights(grouped), block):
                expert.weight.copy_(weight)
    del source
    if sharded:
        shard(model, reshard_after_forward)
    return model
