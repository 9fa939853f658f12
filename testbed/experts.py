"""The expert stack the GroupedLinear GPU tests use: blocks of experts, as
stock ``te.GroupedLinear``, as the drop-in, or as the same experts in
stock ``te.Linear`` modules (the reference TE's own tests hold GroupedLinear
to). TransformerEngine is imported inside the functions."""

from __future__ import annotations

import torch

__all__ = ["EXPERT_SHAPES", "ExpertStack", "ExpertLinears", "build_expert_stack", "expert_inputs"]

#: Experts per block, the two blocks' feature sizes and the tokens per
#: expert, all distinct, so that a saved tensor's shape says what it is.
EXPERT_SHAPES = {"experts": 4, "features": (256, 384), "tokens_per_expert": 128}


class ExpertLinears(torch.nn.Module):
    """One block's experts as stock ``te.Linear`` modules: the input split
    by ``m_splits``, each part through its expert, the outputs concatenated."""

    def __init__(self, linears: list) -> None:
        super().__init__()
        self.linears = torch.nn.ModuleList(linears)

    def forward(self, x, m_splits, is_first_microbatch=None):
        parts = torch.split(x, list(m_splits))
        return torch.cat([lin(part, is_first_microbatch=is_first_microbatch)
                          for lin, part in zip(self.linears, parts)])


class ExpertStack(torch.nn.Sequential):
    """Blocks of experts; every token split evenly over the experts."""

    def __init__(self, blocks: list, m_splits) -> None:
        super().__init__(*blocks)
        self.m_splits = m_splits

    def forward(self, x, is_first_microbatch=None, recompute: bool = False):
        import transformer_engine.pytorch as te

        for block in self:
            if recompute:
                x = te.checkpoint(block, x, self.m_splits, is_first_microbatch=is_first_microbatch)
            else:
                x = block(x, self.m_splits, is_first_microbatch=is_first_microbatch)
        return x


def _grouped_blocks(*, experts: int, features: tuple[int, int], single: bool) -> list:
    import transformer_engine.pytorch as te

    a, b = features
    kwargs = {"bias": False, "params_dtype": torch.bfloat16, "device": "cuda"}
    if single:
        kwargs.update(single_grouped_weight=True, use_grouped_tensor=True)
    return [te.GroupedLinear(experts, a, b, **kwargs), te.GroupedLinear(experts, b, a, **kwargs)]


def _as_linears(block) -> ExpertLinears:
    """``block``'s experts copied into stock ``te.Linear`` modules."""
    import transformer_engine.pytorch as te

    linears = []
    for i in range(block.num_gemms):
        lin = te.Linear(block.in_features, block.out_features, bias=False, params_dtype=torch.bfloat16,
                        device="cuda")
        with torch.no_grad():
            lin.weight.copy_(getattr(block, f"weight{i}"))
        linears.append(lin)
    return ExpertLinears(linears)


def build_expert_stack(variant: str, *, recipe=None, quantized_init: bool = False, single: bool = False,
                       experts: int | None = None, features: tuple[int, int] | None = None,
                       tokens_per_expert: int | None = None, seed: int = 0) -> ExpertStack:
    """Two blocks of experts, ``variant`` ``stock``, ``managed`` (the drop-in,
    by ``convert_model``) or ``linears``; the same weights for every variant
    (seeded), on the current GPU."""
    import transformer_engine.pytorch as te

    experts = experts or EXPERT_SHAPES["experts"]
    features = features or EXPERT_SHAPES["features"]
    tokens = tokens_per_expert or EXPERT_SHAPES["tokens_per_expert"]
    torch.manual_seed(seed)
    with te.quantized_model_init(enabled=quantized_init, recipe=recipe):
        blocks = _grouped_blocks(experts=experts, features=features, single=single)
    if variant == "linears":
        blocks = [_as_linears(block) for block in blocks]
    m_splits = [tokens] * experts
    if single:  # the grouped-tensor path takes its splits on the GPU
        m_splits = torch.tensor(m_splits, dtype=torch.int64, device="cuda")
    stack = ExpertStack(blocks, m_splits)
    if variant == "managed":
        import te_integration

        te_integration.convert_model(stack)
    elif variant not in ("stock", "linears"):
        raise ValueError(f"variant must be 'stock', 'managed' or 'linears'; received {variant!r}")
    return stack


def expert_inputs(seed: int, *, tokens: int | None = None, features: int | None = None) -> torch.Tensor:
    """A bf16 input of every token, drawn from a generator seeded with ``seed``."""
    tokens = tokens or EXPERT_SHAPES["experts"] * EXPERT_SHAPES["tokens_per_expert"]
    features = features or EXPERT_SHAPES["features"][0]
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(tokens, features, dtype=torch.bfloat16, device="cuda", generator=g).requires_grad_()
