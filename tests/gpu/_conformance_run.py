"""Train a drop-in and its stock twin through the same calls on a GPU,
checking every managed call with :class:`_conformance.CallRecorder` and
every output and gradient with ``torch.equal``.

Shared by ``test_conformance.py``, ``test_drawn_plans_gpu.py`` and the
FSDP2 worker ``_conformance_fsdp2.py``. A :class:`Case` says what one run
does; :func:`run_case` returns the problems found (empty: conformant and
bit-exact).
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass

import torch

from _conformance import CallRecorder
from testbed.freshness import reference_reset  # the callers put the repository root on sys.path

HIDDEN, FFN, TOKENS = 128, 256, 64
#: Weight keys and logical shapes per module (all distinct, and distinct
#: from the (TOKENS, HIDDEN) input, so the recorder can tell GEMMs apart).
WEIGHTS = {
    "Linear": {"weight": (FFN, HIDDEN)},
    "LayerNormLinear": {"weight": (FFN, HIDDEN)},
    "LayerNormMLP": {"fc1_weight": (FFN, HIDDEN), "fc2_weight": (HIDDEN, FFN)},
}
#: Recompute modes: none, te.checkpoint (reentrant, non-reentrant), LayerNormMLP(checkpoint=True).
RECOMPUTE = ("none", "reentrant", "non_reentrant", "own")


@dataclass(frozen=True)
class Case:
    recipe: str
    kind: str
    quantized_init: bool
    #: is_first_microbatch of each call of a step: (None,) or (True, False, ...).
    microbatches: tuple = (None,)
    recompute: str = "none"
    override: str | None = None
    input_grad: bool = True
    no_grad: bool = False
    steps: int = 2

    @property
    def label(self) -> str:
        return (f"{self.recipe}/{self.kind}/{'qinit' if self.quantized_init else 'bf16'}/mb={self.microbatches}/"
                f"{self.recompute}/override={self.override}/input_grad={self.input_grad}/no_grad={self.no_grad}")


#: A custom recipe whose LayerNormMLP weights differ in format: FC1's weight
#: and the gradients under delayed scaling, everything else current scaling
#: (TE's CustomRecipe with DelayedScalingRequest, as TE's own
#: test_custom_recipe.py mixes them). The gradients are delayed too because
#: TE 2.20.2 registers a module's backward state for amax reduction whenever
#: its forward state holds a delayed-scaling slot, and a backward state
#: without one has no amax history (quantization.py,
#: add_fp8_tensors_to_global_buffer): stock TE then fails in its first call.
MIXED_FC1_DELAYED = "MixedFc1Delayed"


def _mixed_fc1_delayed():
    from transformer_engine.common import recipe
    from transformer_engine.common.recipe import Format
    from transformer_engine.pytorch.quantization import DelayedScalingRequest
    from transformer_engine.pytorch.tensor.float8_tensor import Float8CurrentScalingQuantizer

    def factory(role):
        delayed = role is not None and (role.tensor_type == "grad_output" or
                                        (role.tensor_type == "weight" and role.name.endswith("fc1")))
        if delayed:
            return DelayedScalingRequest(fp8_format=Format.HYBRID)  # E4M3 forward, E5M2 gradients
        import transformer_engine_torch as tex

        return Float8CurrentScalingQuantizer(tex.DType.kFloat8E4M3, device="cuda")

    return recipe.CustomRecipe(qfactory=factory)


def make_recipe(name: str, override: str | None):
    from transformer_engine.common import recipe

    if name == MIXED_FC1_DELAYED:
        return _mixed_fc1_delayed()
    cls = getattr(recipe, name)
    return cls(backward_override=override) if override is not None else cls()


def build(case: Case, managed: bool, recipe, policy=None):
    import transformer_engine.pytorch as te

    import te_integration as ti

    cls = getattr(ti if managed else te, case.kind)
    kwargs = dict(params_dtype=torch.bfloat16, device="cuda")
    if case.kind == "LayerNormMLP":
        kwargs["checkpoint"] = case.recompute == "own"
    torch.manual_seed(1234)
    init = te.quantized_model_init(enabled=True, recipe=recipe) if case.quantized_init else contextlib.nullcontext()
    with init:
        module = cls(HIDDEN, FFN, **kwargs)
    if managed and policy is not None:
        ti.set_workspace_policy(module, policy)
    return module


def recorder(module, kind: str, step_releases: set[str] | None = None) -> CallRecorder:
    import te_integration as ti
    from te_integration.te import _compat

    return CallRecorder(
        files=[_compat.linear_module, _compat.lnl_module, _compat.lnmlp_module],
        storage_base=_compat.QuantizedTensorStorage, plans=lambda: ti.last_plans(module),
        weights=WEIGHTS[kind], parameter=lambda key: getattr(module, key),
        cache=lambda: module._fp8_workspaces, step_releases=step_releases)


def _inputs(case: Case, step: int, micro: int):
    g = torch.Generator(device="cuda").manual_seed(100 * step + micro)
    x = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g)
    return x.requires_grad_(case.input_grad)


def _forward(module, case: Case, recipe, x, first):
    import transformer_engine.pytorch as te

    kwargs = {} if first is None else {"is_first_microbatch": first}
    with te.autocast(enabled=True, recipe=recipe):
        if case.no_grad:
            with torch.no_grad():
                return module(x, **kwargs)
        if case.recompute in ("reentrant", "non_reentrant"):
            return te.checkpoint(module, x, use_reentrant=case.recompute == "reentrant", **kwargs)
        return module(x, **kwargs)


def _call(module, case, recipe, x, first, rec: CallRecorder | None):
    """One call's forward and backward; what it produced, for comparison."""
    fwd = rec.forward() if rec is not None else contextlib.nullcontext()
    with fwd:
        out = _forward(module, case, recipe, x, first)
    out = out[0] if isinstance(out, tuple) else out
    produced = [out.detach().clone()]
    if case.no_grad:
        return produced
    bwd = rec.backward() if rec is not None else contextlib.nullcontext()
    with bwd:
        (out.float() * 0.01).square().sum().backward()
    produced.append(None if x.grad is None else x.grad.detach().clone())
    return produced


def _local(t):
    """This rank's part of a tensor (FSDP2 holds DTensors between calls)."""
    return t.to_local() if hasattr(t, "to_local") else t


def _grads_and_params(module) -> list:
    seen = []
    for _, p in module.named_parameters():
        grad = p.grad if p.grad is not None else getattr(p, "main_grad", None)
        seen.append(None if grad is None else _local(grad).detach().clone())
    return seen


def _params(module) -> list:
    from transformer_engine.pytorch.quantized_tensor import QuantizedTensor

    values = [_local(p) for p in module.parameters()]
    return [(v.dequantize() if isinstance(v, QuantizedTensor) else v).detach().clone() for v in values]


def _optimizer(module):
    import transformer_engine.pytorch as te

    return te.optimizers.FusedAdam(list(module.parameters()), lr=1e-2, master_weights=True,
                                   master_weight_dtype=torch.float32)


def _compare(where: str, want: list, got: list) -> list[str]:
    if len(want) != len(got):
        return [f"{where}: stock produced {len(want)} tensors, the drop-in {len(got)}"]
    out = []
    for i, (a, b) in enumerate(zip(want, got)):
        if (a is None) != (b is None):
            out.append(f"{where}: tensor {i} is None on one side only")
        elif a is not None and not torch.equal(a, b):
            out.append(f"{where}: tensor {i} differs (max abs {(a.float() - b.float()).abs().max().item():.3g})")
    return out


class StockTEFails(Exception):
    """The stock twin raised: TE itself cannot run the setting, so the
    drop-in has nothing to match (a skip with TE's error as the reason)."""


class StockTEFailsWarning(Warning):
    """A setting left out because stock TE fails it (see :class:`StockTEFails`).
    Not a UserWarning: the GPU test modules ignore those (TE's own)."""


def report_stock_failures(lines: list[str]) -> None:
    """Warn once per setting stock TE fails, so pytest's warnings summary
    lists it. Not a UserWarning (the GPU test modules ignore those, TE's
    own), and shown even under the project's ``error`` filter: the setting is
    TE's failure, not the test's."""
    with warnings.catch_warnings():
        warnings.simplefilter("always", StockTEFailsWarning)
        for line in lines:
            warnings.warn(f"setting not run, stock TE fails it: {line}", StockTEFailsWarning, stacklevel=2)


def run_case(case: Case, policy=None, *, numerics: bool = True, prepare=None) -> list[str]:
    """Both twins through ``case``; conformance problems of every managed
    call, and (with ``numerics``) every difference from stock, made the
    reference: its quantized parameters' transposes reset after each
    optimizer step (``testbed.freshness.reference_reset``), which changes
    stock only where it would read a stale one (docs/decisions.md, D12). ``prepare``
    is applied to both modules before training (e.g. ``fully_shard``)."""
    recipe = make_recipe(case.recipe, case.override)
    stock, managed = build(case, False, recipe), build(case, True, recipe, policy)
    if prepare is not None:
        prepare(stock)
        prepare(managed)
    opts = (_optimizer(stock), _optimizer(managed))
    problems = []
    for step in range(case.steps):
        releases: set[str] = set()  # the cache entries this step's calls marked for release
        for micro, first in enumerate(case.microbatches):
            where = f"{case.label} step {step} call {micro}"
            try:
                want = _call(stock, case, recipe, _inputs(case, step, micro), first, None)
            except Exception as err:  # noqa: BLE001  (TE's own failure: nothing to compare against)
                raise StockTEFails(f"{where}: stock TE itself raises {type(err).__name__}: {err}") from err
            rec = recorder(managed, case.kind, releases)
            got = _call(managed, case, recipe, _inputs(case, step, micro), first, rec)
            last = micro == len(case.microbatches) - 1 and not case.no_grad
            if last:
                want += _grads_and_params(stock)
                got += _grads_and_params(managed)
                opts[0].step()
                opts[0].zero_grad(set_to_none=True)
                reference_reset(stock)  # stock without its stale FP8 transposes (D12); a no-op elsewhere
                with rec.step():
                    opts[1].step()
                    opts[1].zero_grad(set_to_none=True)
                want += _params(stock)
                got += _params(managed)
            problems += [f"{where}: {p}" for p in rec.mismatches()]
            if numerics:
                problems += _compare(where, want, got)
    return problems
