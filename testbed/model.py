"""The GPU model that the benchmarks and the GPU tests both build, and what
every measurement of it needs.

The model: a stack of ``te.TransformerLayer`` (``fuse_qkv_params=True``,
bf16 params, no dropout) under FSDP2 (``fully_shard`` on every layer and at
the root), stock or from the drop-ins (``te_integration.managed_construction``),
with bf16 params or under ``te.quantized_model_init``, optionally with
``te.checkpoint`` around every layer; seeded, so stock and drop-in start
from the same weights. Around it: TE's FusedAdam with fp32 master weights,
seeded random batches, the allocated-memory mark and a counter of weight
quantizations. The recipes by name are in :mod:`testbed.recipes`.
The MoE expert stack, built with this module's sharding and pinning, is in
:mod:`testbed.experts`.

Why this module, and why here. ``benchmarks/_stack.py`` and
``tests/gpu/_fsdp2_stack.py`` each had their own copy of this code, the fix
for the parameter attributes ``fully_shard`` drops included; one copy is
what keeps a benchmark and a GPU test measuring the same model. It lives in
``testbed``, a package importable from the repository root that both
import, whereas ``tests/gpu`` is a folder of scripts that torchrun starts by
path: those workers put the repository root on ``sys.path`` and import this
module. It stays apart from ``benchmarks/_stack.py`` (the benchmarks' sizes,
memory probes and timing loops), so that the tests import only what they
build, and a change to how a benchmark measures cannot change what a test
builds.

TE, CUDA, ``torch.distributed`` and ``te_integration`` are imported inside
the functions: importing this module needs torch only.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Any

import torch

__all__ = [
    "QuantizationCounter",
    "Stack",
    "allocated",
    "build_stack",
    "cached_workspaces",
    "optimizer_for",
    "pin_policy",
    "random_pair",
    "rank",
    "release_memory",
    "shard",
]


class Stack(torch.nn.Sequential):
    """The layers in sequence, passing ``is_first_microbatch`` to each, each
    inside ``te.checkpoint`` when ``checkpoint_mode`` says so. The root stays
    a module FSDP2 wraps, so its hooks run."""

    #: "none", or the te.checkpoint mode around every layer ("nonreentrant", "reentrant").
    checkpoint_mode = "none"

    def forward(self, x, is_first_microbatch=None):
        if self.checkpoint_mode == "none":
            for layer in self:
                x = layer(x, is_first_microbatch=is_first_microbatch)
            return x
        import transformer_engine.pytorch as te

        reentrant = self.checkpoint_mode == "reentrant"
        if reentrant and not x.requires_grad:
            # A reentrant checkpoint's output needs grad only if an input does:
            # the layers' parameters are not inputs of its autograd Function.
            x = x.detach().requires_grad_()
        for layer in self:
            x = te.checkpoint(layer, x, is_first_microbatch=is_first_microbatch, use_reentrant=reentrant)
        return x


# -- the model ---------------------------------------------------------------------
def build_stack(hidden: int, ffn: int, heads: int, layers: int, *, recipe, managed: bool = False,
                quantized_init: bool = False, reshard_after_forward: bool = True, checkpoint: str = "none",
                policy: Any = None) -> Stack:
    """``layers`` x ``te.TransformerLayer(hidden, ffn, heads)`` sharded with
    FSDP2, from seed 0. ``recipe`` is a TE recipe object (None: bf16); with
    ``quantized_init`` and a recipe, the layers are built on the meta device
    under ``te.quantized_model_init`` and materialized after sharding.
    ``policy``: a ``workspace_manager.WorkspacePolicy`` pinned on every
    drop-in (``managed`` only; None: selected per call, the default)."""
    import transformer_engine.pytorch as te

    import te_integration as ti

    kwargs: dict[str, Any] = dict(fuse_qkv_params=True, params_dtype=torch.bfloat16, hidden_dropout=0.0,
                                  attention_dropout=0.0)
    qinit = quantized_init and recipe is not None
    if qinit:
        kwargs["device"] = "meta"
    init = te.quantized_model_init(enabled=True, recipe=recipe) if qinit else contextlib.nullcontext()
    construction = ti.managed_construction() if managed else contextlib.nullcontext()
    torch.manual_seed(0)
    with init, construction:
        model = Stack(*[te.TransformerLayer(hidden, ffn, heads, **kwargs) for _ in range(layers)])
    model.checkpoint_mode = checkpoint
    if policy is not None:
        if not managed:
            raise ValueError("build_stack: a policy can be pinned on drop-ins only (managed=True)")
        pin_policy(model, policy)
    shard(model, reshard_after_forward, materialize=qinit)
    return model


def pin_policy(model: torch.nn.Module, policy: Any) -> int:
    """Pin ``policy`` on every drop-in module of ``model`` (and convert
    nothing); returns how many. Raises ValueError if there is none, since a
    pin that reaches no module would measure the defaults under the
    policy's name."""
    import te_integration as ti

    names = ("Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear")
    kinds = tuple(getattr(ti, n) for n in names if hasattr(ti, n))
    drop_ins = [m for m in model.modules() if isinstance(m, kinds)]
    if not drop_ins:
        raise ValueError(f"pin_policy: {type(model).__name__} holds no drop-in module to pin {policy!r} on")
    for module in drop_ins:
        ti.set_workspace_policy(module, policy)
    return len(drop_ins)


def shard(model: torch.nn.Module, reshard_after_forward: bool, *, materialize: bool = False) -> None:
    """``fully_shard`` every child of ``model`` and the root. ``materialize``:
    the weights were built on the meta device; reset them from seed 0. The
    attributes TE sets on its parameters (``tensor_model_parallel``,
    ``partition_dim``, ...) are put back: the parameters FSDP2 makes in
    their place do not carry them."""
    from torch.distributed.fsdp import fully_shard

    attrs = {name: dict(vars(p)) for name, p in model.named_parameters()}
    for child in model.children():
        fully_shard(child, reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)
    if materialize:
        torch.manual_seed(0)
        for module in model.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
    for name, p in model.named_parameters():
        for key, value in attrs.get(name, {}).items():
            if not hasattr(p, key):
                setattr(p, key, value)


def optimizer_for(model: torch.nn.Module):
    """TE's FusedAdam with fp32 master weights, lr 1e-3."""
    import transformer_engine.pytorch as te

    return te.optimizers.FusedAdam(model.parameters(), lr=1e-3, master_weights=True,
                                   master_weight_dtype=torch.float32)


# -- data --------------------------------------------------------------------------
def rank() -> int:
    """This process's rank (0 without a process group)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def random_pair(seed: int, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """An input and a target of ``shape`` (bf16, on the current GPU), drawn
    one after the other from a generator seeded with ``seed``. Each caller
    keeps its own seeding rule, so its data stays what it measured before."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(shape, dtype=torch.bfloat16, device="cuda", generator=g)
    return x, torch.randn(x.shape, dtype=x.dtype, device="cuda", generator=g)


# -- measuring ---------------------------------------------------------------------
def allocated() -> int:
    """``memory_allocated`` once the GPU has finished what was queued."""
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def release_memory() -> None:
    """Collect garbage and return cached blocks, between two models."""
    gc.collect()
    torch.cuda.empty_cache()


def cached_workspaces(model: torch.nn.Module) -> int:
    """Workspaces held in the TE modules' own caches (``_fp8_workspaces``)."""
    return sum(len(getattr(m, "_fp8_workspaces", None) or {}) for m in model.modules())


class QuantizationCounter:
    """Counts real weight quantizations in forward (cache hits without
    refresh excluded), stock and drop-in alike.

    A new workspace is counted where it is made: TE's ``quantize_weight``
    makes it with ``quantizer.quantize(tensor, dtype=...)``, and the drop-in's
    seam makes that same call itself for an uncached weight, so the counter
    wraps ``quantize`` on TE's quantizer classes and counts the calls that
    pass ``dtype`` (no other TE caller does; activations and backward rebuilds
    call the quantizer without it). A refreshed cache entry is counted at
    ``quantize_weight`` (through ``te_integration.te._compat``), where it returns
    the workspace it was handed."""

    def __init__(self, compat: Any = None, quantizer_base: type | None = None,
                 quantized: type | None = None) -> None:
        # The three are TE's unless given (the CPU test gives stand-ins).
        if compat is None:
            from te_integration.te import _compat as compat
        if quantizer_base is None or quantized is None:
            from transformer_engine.pytorch.quantized_tensor import QuantizedTensor, Quantizer

            quantizer_base, quantized = quantizer_base or Quantizer, quantized or QuantizedTensor
        self.compat, self.original, self.count = compat, compat.quantize_weight, 0
        self._base, self._quantized = quantizer_base, quantized
        self._patched: list[tuple[type, Any]] = []
        self._depth = 0

    def __enter__(self) -> QuantizationCounter:
        def counting(**kw):
            out, new = self.original(**kw)
            refreshed = kw.get("update_workspace", True) or kw.get("skip_update_flag") is not None
            if kw.get("workspace") is not None and out is kw["workspace"] and refreshed:
                self.count += 1
            return out, new

        self.compat.quantize_weight = counting
        for cls in _with_own_quantize(self._base):
            self._patched.append((cls, cls.__dict__["quantize"]))
            cls.quantize = self._counting_quantize(cls.__dict__["quantize"], self._quantized)
        return self

    def _counting_quantize(self, original: Any, quantized: type) -> Any:
        def quantize(quantizer, tensor, *args, **kw):
            # Outermost call only: an override may call its base's quantize.
            outer = self._depth == 0
            if outer and "dtype" in kw and kw.get("out") is None and not isinstance(tensor, quantized):
                self.count += 1
            self._depth += 1
            try:
                return original(quantizer, tensor, *args, **kw)
            finally:
                self._depth -= 1

        return quantize

    def __exit__(self, *exc: Any) -> None:
        self.compat.quantize_weight = self.original
        for cls, original in reversed(self._patched):
            cls.quantize = original
        self._patched.clear()


def _with_own_quantize(base: type) -> list[type]:
    """``base`` and every subclass loaded now that defines its own ``quantize``."""
    found, todo = [], [base]
    while todo:
        cls = todo.pop()
        if "quantize" in cls.__dict__ and cls not in found:
            found.append(cls)
        todo.extend(cls.__subclasses__())
    return found
