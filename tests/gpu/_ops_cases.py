"""The te.ops cases the GPU tests run, stock against drop-in, on one GPU.

Each model form exercises one path of TE's ops into ``BasicLinear``'s
forward (or GroupedLinear's): the op alone, ``te.ops.Linear`` with bias
(fused ``ForwardLinearBiasActivation``), Linear + ``AddExtraInput``
(fused ``ForwardLinearBiasAdd``), ``MakeExtraOutput`` + Linear (fused
``BackwardLinearAdd``), a ``te.ops.Sequential`` MLP with a LayerNorm in
front, and GroupedLinear. ``sharding`` "none" runs the whole-weight plans;
"fsdp2" describes FSDP2 (reshard after forward) to the planner through the
op's sharding probe (``FixedSharding(..., is_fsdp2=False)``: te.ops has no
FSDP2 flag of its own), so the drop-in carries out the FSDP2 plan on one
GPU while the weight is whole. Real FSDP2 runs in ``_ops_fsdp2.py``.

:class:`OpsWatch` records, for every drop-in linear, what its GEMMs read:
the forward weight operand, and the dgrad operand (the forward's storage
object, or a rebuilt one, and its usages).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

H, TOKENS, GROUPS = 128, 64, 4
#: Tokens per group of GroupedLinear: a multiple of 128, as TE's own grouped tests align splits.
GROUP_TOKENS = 128
FORMS = ("basic_linear", "linear_bias", "linear_add", "residual_linear", "mlp", "grouped")


def every_case(recipes):
    """The case grid both te.ops GPU tests run: ``recipes`` x quantized init
    x form x sharding plan, as the test's ``recipe_name``, ``quantized_init``,
    ``form`` and ``sharding`` arguments."""
    import pytest

    marks = [pytest.mark.parametrize("sharding", ["none", "fsdp2"]),
             pytest.mark.parametrize("form", FORMS),
             pytest.mark.parametrize("quantized_init", [False, True], ids=["bf16_params", "quantized_init"]),
             pytest.mark.parametrize("recipe_name", recipes)]

    def apply(test):
        for mark in reversed(marks):  # as stacked decorators apply: the last one first
            test = mark(test)
        return test

    return apply


def case_or_skip(recipe_name: str, quantized_init: bool, form: str, sharding: str):
    """The case and its recipe, or a skip with TE's reason where the GPU lacks the recipe."""
    import pytest
    from testbed.recipes import make_recipe, recipe_skip_reason

    reason = recipe_skip_reason(recipe_name)
    if reason:
        pytest.skip(reason)
    return OpsCase(recipe_name, form, quantized_init, sharding), make_recipe(recipe_name)


def _form(name: str):
    import transformer_engine.pytorch as te

    ops, kw = te.ops, dict(device="cuda", dtype=torch.bfloat16)
    if name == "basic_linear":
        return ops.BasicLinear(H, H, **kw)
    if name == "linear_bias":
        return ops.Linear(H, H, bias=True, **kw)
    if name == "linear_add":
        return ops.Sequential(ops.Linear(H, H, bias=True, **kw), ops.AddExtraInput(in_place=True))
    if name == "residual_linear":
        return ops.Sequential(ops.MakeExtraOutput(in_place=True), ops.Linear(H, H, bias=False, **kw))
    if name == "mlp":
        return ops.Sequential(ops.LayerNorm(H, **kw), ops.Linear(H, 2 * H, bias=True, **kw), ops.GELU(),
                              ops.Linear(2 * H, H, bias=True, **kw))
    return ops.GroupedLinear(GROUPS, H, H, bias=True, **kw)


@dataclass(frozen=True)
class OpsCase:
    recipe: str
    form: str
    quantized_init: bool = False
    sharding: str = "none"

    @property
    def label(self) -> str:
        return f"{self.recipe}/{self.form}/{'qinit' if self.quantized_init else 'bf16'}/{self.sharding}"


def build(case: OpsCase, recipe, managed: bool):
    import transformer_engine.pytorch as te

    import te_integration as ti
    from workspace_manager import Sharding
    from workspace_manager.testing.plans import FixedSharding

    torch.manual_seed(4321)
    init = te.quantized_model_init(enabled=True, recipe=recipe) if case.quantized_init else contextlib.nullcontext()
    with init:
        model = _form(case.form)
    if managed:
        ti.convert_model(model)
        if case.sharding == "fsdp2":
            for op in drop_in_ops(model):
                ti.debug.workspace_state(op).sharding_probe = FixedSharding(Sharding.FSDP2_RESHARD, is_fsdp2=False)
    return model


def drop_in_ops(model) -> list:
    import te_integration as ti

    return [m for m in model.modules() if isinstance(m, (ti.OpsBasicLinear, ti.OpsGroupedLinear))]


def _inputs(case: OpsCase, step: int):
    g = torch.Generator(device="cuda").manual_seed(17 + step)
    tokens = GROUP_TOKENS * GROUPS if case.form == "grouped" else TOKENS
    x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True)
    extra = []
    if case.form == "linear_add":
        extra = [torch.randn(TOKENS, H, device="cuda", dtype=torch.bfloat16, generator=g)]
    if case.form == "grouped":
        extra = [torch.tensor([GROUP_TOKENS] * GROUPS, dtype=torch.int64, device="cuda")]
    return x, extra


def _loss(out) -> torch.Tensor:
    outs = out if isinstance(out, tuple) else (out,)
    return sum((o.float() * 0.01).square().sum() for o in outs)


def run(model, case: OpsCase, recipe, steps: int = 3, between=None, fresh_transposes: bool = False,
        warmup_forward: bool = False) -> list:
    """Outputs, input grads, parameter grads and updated parameters of ``steps``
    steps; ``between(step, out)`` runs after each forward (before backward).
    ``fresh_transposes``: after each optimizer step, mark the FP8
    parameters' transposes invalid, so that they are made again from the
    updated data (``testbed.freshness.reference_reset``: the reference
    stock is held to where it reads a stale one, docs/decisions.md D12). ``warmup_forward``: one forward first,
    without backward or step, so that DelayedScaling's amax history holds
    the weights before the first recorded step."""
    import transformer_engine.pytorch as te
    from transformer_engine.pytorch.quantized_tensor import QuantizedTensor

    record = []
    opt = te.optimizers.FusedAdam(list(model.parameters()), lr=1e-2, master_weights=True,
                                  master_weight_dtype=torch.float32)
    if warmup_forward:
        x, extra = _inputs(case, steps)
        with te.autocast(enabled=True, recipe=recipe):
            model(x, *extra)
        del x, extra
    for step in range(steps):
        x, extra = _inputs(case, step)
        with te.autocast(enabled=True, recipe=recipe):
            out = model(x, *extra)
        if between is not None:
            between(step, out)
        record.append(("out", step, (out[0] if isinstance(out, tuple) else out).detach().clone()))
        _loss(out).backward()
        record.append(("dx", step, x.grad.detach().clone()))
        for name, p in model.named_parameters():
            record.append((f"grad:{name}", step, None if p.grad is None else p.grad.detach().clone()))
        opt.step()
        opt.zero_grad(set_to_none=True)
        for name, p in model.named_parameters():
            value = p.dequantize() if isinstance(p, QuantizedTensor) else p
            record.append((f"param:{name}", step, value.detach().clone()))
        if fresh_transposes:
            from testbed.freshness import reference_reset

            reference_reset(model)
        # Nothing of this step stays alive into the next forward: a memory
        # mark taken there sees no old output (or the graph it keeps) freed.
        del out, x, extra
    return record


def fused_forms(model) -> list:
    """The TE classes of the (fused) ops each fuser of a ``te.ops.Sequential``
    ran, forward and backward (empty for an op called alone, whose fuser is
    transient): a drop-in must fuse as stock does."""
    def te_class(op) -> str:
        return next(c.__qualname__ for c in type(op).__mro__ if c.__module__.startswith("transformer_engine"))

    return [([te_class(op) for op, _ in fuser._forward_ops], [te_class(op) for op, _ in fuser._backward_ops])
            for fuser in (getattr(model, "_module_groups", None) or []) if hasattr(fuser, "_forward_ops")]


def stock_or_skip(fn):
    """``fn()``, stock TE's run; skip the test where stock TE itself fails on
    this machine (TE 2.20.2's GroupedLinear with Float8BlockScaling on
    sm_90, which TE's own test_fusible_ops.py fails too)."""
    import pytest

    try:
        return fn()
    except Exception as err:  # noqa: BLE001  (any failure of TE's own code)
        pytest.skip(f"stock TE fails this case here: {type(err).__name__}: {str(err)[:300]}")


def differences(stock: list, managed: list) -> list[str]:
    out = []
    for a, b in zip(stock, managed):
        if a[:2] != b[:2]:
            return [f"records differ in order: {a[:2]} against {b[:2]}"]
        if a[2] is None or b[2] is None:
            if (a[2] is None) != (b[2] is None):
                out.append(f"{a[:2]}: one is None")
            continue
        if not torch.equal(a[2], b[2]):
            out.append(f"{a[:2]}: max abs diff {(a[2].float() - b[2].float()).abs().max().item():.3g}")
    return out or ([] if len(stock) == len(managed) else ["record lengths differ"])


@dataclass
class OpsWatch:
    """What the GEMMs of te.ops's BasicLinear read (patched in its module file):
    ``forward`` the usages of each forward weight operand; ``dgrad`` whether
    each dgrad operand is a storage a forward GEMM read, and its usages."""

    forward: list = field(default_factory=list)
    dgrad: list = field(default_factory=list)

    @contextlib.contextmanager
    def watching(self):
        from transformer_engine.pytorch.ops.basic import basic_linear
        from transformer_engine.pytorch.quantized_tensor import QuantizedTensorStorage

        from _conformance import usages_of

        original = basic_linear.general_gemm

        def gemm(a, b, *args, **kwargs):
            layout = kwargs.get("layout", "TN")
            if isinstance(a, QuantizedTensorStorage) and layout in ("TN", "NN"):
                # A mark on the object, not its id: ids of freed workspaces are reused.
                if layout == "TN":
                    a._te_wm_watched = True
                    self.forward.append((True, usages_of(a)))
                else:
                    self.dgrad.append((getattr(a, "_te_wm_watched", False), usages_of(a)))
            return original(a, b, *args, **kwargs)

        basic_linear.general_gemm = gemm
        try:
            yield self
        finally:
            basic_linear.general_gemm = original
