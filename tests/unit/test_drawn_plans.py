"""Any valid plan runs, or is refused by name (CPU, the TE stand-in).

Every call setting (sharding, microbatches, recompute, backward_override,
input grad) is a test of its own, and Hypothesis draws, through
:class:`DrawnPlanPolicy`, a meaningful plan for every context the binding
plans in it. Each call of each step is watched by the conformance recorder
of ``tests/gpu/_conformance.py``
reading the stand-in's storages, which follow TE 2.20's
``Float8TensorStorage`` (``_data``, ``_transpose``, ``prepare_for_saving``)
and its Linear's save, rebuild and clear steps. Every call either conforms,
with outputs and gradients equal to a stock twin's, or is refused at the
module call with a PolicyMismatchError naming a plan field and the context.
The same runs for LayerNormMLP (``_fake_te_mlp.py``: both weights, its own
``checkpoint=True`` recompute, TE's one ``is_fsdp2`` switch for both).
A second test pins plans from a list of plan classes that TE's code can
carry out, written from reading it, and asserts none is refused and each
conforms.
"""

from __future__ import annotations

import gc
import itertools
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import _fake_te
from _examples import scaled
from _fake_te import TELinear, load_full_binding
from _fake_te_mlp import Float8Quantizer, TELayerNormMLP
from workspace_manager import (
    BackwardSource,
    ColumnwiseSource,
    ContextTypeError,
    PolicyMismatchError,
    Sharding,
    Usage,
    WorkspaceContext,
)
from workspace_manager.extending import PROFILES
from workspace_manager.testing.plans import DrawnPlanPolicy, FixedSharding, meaningful_plans

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
from _conformance import CallRecorder  # noqa: E402

IN, OUT, TOKENS, FFN = 8, 6, 4, 12
PLAN_FIELDS = ("cache", "forward_usage", "backward_source", "backward_usage", "columnwise_source", "release",
               "parameter_keeps")


@dataclass(frozen=True)
class Setting:
    sharding: Sharding
    #: Microbatch positions of one step's calls.
    microbatches: tuple
    recompute: bool
    no_grad: bool
    override: str | None
    input_grad: bool
    kind: str = "Linear"
    #: LayerNormMLP(checkpoint=True): the module's own recompute.
    own: bool = False
    #: LayerNormMLP with a delayed-scaling quantizer on FC1: FC1 and FC2 may save differently.
    mixed: bool = False


SHARDINGS = (Sharding.NONE, Sharding.FSDP2_RESHARD, Sharding.FSDP2_KEEP)
#: One call, or three microbatches (first, later, later).
MICROBATCHES = ((None,), (True, False, False))


def linear_settings() -> tuple[Setting, ...]:
    """Every Linear setting (90): no input grad only outside a recompute
    region, whose reentrant checkpoint needs an input that requires grad."""
    found = []
    for sharding, microbatches, mode, override, input_grad in itertools.product(
            SHARDINGS, MICROBATCHES, ("plain", "recompute", "no_grad"), (None, "high_precision", "dequantized"),
            (True, False)):
        if mode == "recompute" and not input_grad:
            continue
        found.append(Setting(sharding, microbatches, recompute=mode == "recompute", no_grad=mode == "no_grad",
                             override=override, input_grad=input_grad))
    return tuple(found)


def mlp_settings() -> tuple[Setting, ...]:
    """Every LayerNormMLP setting (48): no backward_override (TE 2.20's
    LayerNormMLP takes none) and dgrad always (for the norm), with its own
    checkpoint as a fourth mode."""
    return tuple(
        Setting(sharding, microbatches, recompute=mode == "recompute", no_grad=mode == "no_grad", override=None,
                input_grad=True, kind="LayerNormMLP", own=mode == "own", mixed=mixed)
        for sharding, microbatches, mode, mixed in itertools.product(
            SHARDINGS, MICROBATCHES, ("plain", "recompute", "own", "no_grad"), (False, True)))


def _setting_id(setting: Setting) -> str:
    mode = "recompute" if setting.recompute else "no_grad" if setting.no_grad else "own" if setting.own else "plain"
    parts = [setting.sharding.value, f"mb{len(setting.microbatches)}", mode, setting.override or "no_override",
             "dx" if setting.input_grad else "no_dx"]
    return "-".join(parts + (["mixed"] if setting.mixed else []))


def _pair(ti, setting: Setting, policy: DrawnPlanPolicy):
    if setting.kind == "LayerNormMLP":
        stock, managed = (TELayerNormMLP(IN, FFN, seed=7, checkpoint=setting.own) for _ in range(2))
        kind = ti.state.ModuleKind("layernorm_mlp")
        if setting.mixed:
            stock.fc1_quantizer, managed.fc1_quantizer = Float8Quantizer(), Float8Quantizer()
    else:
        stock, managed = TELinear(IN, OUT, seed=7), TELinear(IN, OUT, seed=7)
        kind = ti.state.ModuleKind("linear")
        for module in (stock, managed):
            module.backward_override = setting.override
            module.calls = None  # a kept argument record would hold workspaces the plan releases
    ti.modules.convert_model(managed)
    managed.__dict__["_wm_state"] = ti.state.ModuleWorkspaceState(kind, policy, probe=FixedSharding(setting.sharding))
    return stock, managed


def _grads(module) -> list:
    return [p.grad.clone() for p in module.parameters()]


def _call(module, setting: Setting, x, first):
    if setting.recompute:
        return _fake_te.checkpoint(module, x, is_first_microbatch=first)
    if setting.no_grad:
        with torch.no_grad():
            return module(x, is_first_microbatch=first)
    return module(x, is_first_microbatch=first)


#: Weight keys and shapes, distinct from each other and from the input's (TOKENS, IN).
_WEIGHTS = {"Linear": ("linear", {"weight": (OUT, IN)}),
            "LayerNormMLP": ("lnmlp", {"fc1_weight": (FFN, IN), "fc2_weight": (IN, FFN)})}


def _recorder(ti, module, kind: str, step_releases: set[str]) -> CallRecorder:
    file, weights = _WEIGHTS[kind]
    return CallRecorder(files=[ti.files[file]], storage_base=_fake_te.QuantizedTensorStorage,
                        plans=lambda: ti.modules.last_plans(module), weights=weights,
                        parameter=lambda key: getattr(module, key), cache=lambda: module._fp8_workspaces,
                        step_releases=step_releases)


def _run_stock(stock, setting: Setting, x, first) -> list:
    out = _call(stock, setting, x, first)
    if setting.no_grad:
        return [out]
    out.square().sum().backward()
    return [out, x.grad]


def _run_managed(ti, managed, setting: Setting, x, first, last: bool, opt,
                 releases: set[str]) -> tuple[list, list[str]]:
    rec = _recorder(ti, managed, setting.kind, releases)
    with rec.forward():
        out = _call(managed, setting, x, first)
    if setting.no_grad:
        return [out], rec.mismatches()
    with rec.backward():
        out.square().sum().backward()
    seen = [out, x.grad]
    if last:
        seen += _grads(managed)
        with rec.step():
            opt.step()
            opt.zero_grad(set_to_none=True)
    return seen, rec.mismatches()


def _inputs(setting: Setting, step: int, micro: int):
    gen = torch.Generator().manual_seed(31 * step + micro)
    x = torch.randn(TOKENS, IN, generator=gen)
    return x.clone().requires_grad_(setting.input_grad), x.clone().requires_grad_(setting.input_grad)


def _train(ti, setting: Setting, policy: DrawnPlanPolicy, steps: int = 2) -> list[str]:
    """Both twins through the same steps; the conformance problems of every
    managed call. Outputs and gradients must match bit for bit."""
    _freeze_the_heap()
    stock, managed = _pair(ti, setting, policy)
    opts = [torch.optim.SGD(m.parameters(), lr=0.25) for m in (stock, managed)]
    problems = []
    for step in range(steps):
        releases: set[str] = set()  # the cache entries this step's calls marked for release
        for micro, first in enumerate(setting.microbatches):
            xs, xm = _inputs(setting, step, micro)
            last = micro == len(setting.microbatches) - 1
            want = _run_stock(stock, setting, xs, first)
            if last and not setting.no_grad:
                want += _grads(stock)
                opts[0].step()
                opts[0].zero_grad(set_to_none=True)
            got, found = _run_managed(ti, managed, setting, xm, first, last, opts[1], releases)
            problems += [f"step {step} call {micro}: {p}" for p in found]
            for a, b in zip(want, got):
                assert (a is None and b is None) or torch.equal(a, b), f"step {step} call {micro}: numerics differ"
    return problems


def _assert_refusal_names_the_plan(err: PolicyMismatchError) -> None:
    text = str(err)
    assert any(name in text for name in PLAN_FIELDS), f"the refusal names no plan field: {text}"
    assert "context" in text.lower(), f"the refusal names no context: {text}"


def _drawing(data, allowed=lambda ctx, plan: True) -> DrawnPlanPolicy:
    def choose(ctx, candidates):
        usable = [p for p in candidates if allowed(ctx, p)] or list(candidates)
        return data.draw(st.sampled_from(usable), label=f"plan for {ctx}")
    return DrawnPlanPolicy(chooser=choose)


@pytest.fixture
def ti(monkeypatch):
    _fake_te.LinearFunction.fail_backward = False
    return load_full_binding(monkeypatch)


@pytest.fixture(scope="module", autouse=True)
def _young_heap():
    """The recorder runs ``gc.collect()`` before each of its liveness
    readings, nine or more per training run. A full collection walks every
    object of the test process (torch, Hypothesis, every test module
    imported so far: about 0.1 s each), which made an example take a second.
    :func:`_freeze_the_heap` moves what is alive before a run out of the
    collector's sight; this gives it back after the module's tests."""
    yield
    gc.unfreeze()


def _freeze_the_heap() -> None:
    """Collect, then freeze every survivor (``gc.freeze``), so that the
    recorder's collections walk only what this run allocates. Its verdict
    stays sound: the run's modules, workspaces and autograd graphs are all
    allocated after the freeze, so any unreachable cycle among them is still
    collected before a liveness reading. A frozen object is never collected,
    so a workspace held only by a frozen object turned garbage would read as
    alive; what is frozen is what lived before the run (the binding,
    Hypothesis, the test modules), which the run does not make garbage."""
    gc.collect()
    gc.freeze()


#: No shrinking: every example is a whole training run, and a failure's
#: message already names the call, the plan and what differed. The settings
#: are enumerated (each its own test); Hypothesis draws the plans of each
#: setting's calls: 4 per setting in the default profiles, 120 with
#: ``HYPOTHESIS_PROFILE=thorough`` (``_examples.py``).
_EXAMPLES = scaled(share=1 / 25, at_least=2)
_HYPOTHESIS = settings(max_examples=_EXAMPLES, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate],
                       suppress_health_check=[HealthCheck.function_scoped_fixture])


def _carried_out_or_refused(ti, setting: Setting, data) -> None:
    try:
        problems = _train(ti, setting, _drawing(data))
    except PolicyMismatchError as err:
        _assert_refusal_names_the_plan(err)
        return
    assert not problems, "\n".join(problems)


def test_only_a_refusal_by_name_passes_a_run_that_does_not_conform(monkeypatch):
    """A failed check of a run (numerics, conformance) fails the test: only
    a PolicyMismatchError that names a plan field and the context passes,
    and one that names neither fails too."""
    setting = linear_settings()[0]

    def raising(error):
        def train(*args):
            raise error
        return train

    monkeypatch.setattr(sys.modules[__name__], "_train", raising(AssertionError("step 0 call 0: numerics differ")))
    with pytest.raises(AssertionError, match="numerics differ"):
        _carried_out_or_refused(None, setting, None)
    refusal = PolicyMismatchError("backward_source=saved_workspace cannot be carried out for the context ...")
    monkeypatch.setattr(sys.modules[__name__], "_train", raising(refusal))
    _carried_out_or_refused(None, setting, None)
    monkeypatch.setattr(sys.modules[__name__], "_train", raising(PolicyMismatchError("no")))
    with pytest.raises(AssertionError, match="names no plan field"):
        _carried_out_or_refused(None, setting, None)


@pytest.mark.parametrize("setting", linear_settings(), ids=_setting_id)
@_HYPOTHESIS
@given(data=st.data())
def test_every_drawn_plan_is_carried_out_or_refused_by_name(ti, setting, data):
    _carried_out_or_refused(ti, setting, data)


@pytest.mark.parametrize("setting", mlp_settings(), ids=_setting_id)
@_HYPOTHESIS
@given(data=st.data())
def test_every_drawn_layernorm_mlp_plan_is_carried_out_or_refused_by_name(ti, setting, data):
    """The same for LayerNormMLP's two weights, each drawn its own plan,
    through TE's own checkpoint too (the GPU drawn-plan test found its
    recompute pass not carried out in round 6; this stand-in finds it on
    the code before the fix)."""
    _carried_out_or_refused(ti, setting, data)


def test_the_settings_are_every_combination_once():
    """Enumerated, not drawn: each axis's every value appears, and no setting twice."""
    linear, mlp = linear_settings(), mlp_settings()
    # shardings x microbatches x (plain, recompute, no_grad: input grad either way but under recompute) x overrides
    assert len(linear) == len(set(linear)) == 3 * 2 * (2 + 1 + 2) * 3
    assert len(mlp) == len(set(mlp)) == 3 * 2 * 4 * 2
    assert {s.override for s in linear} == {None, "high_precision", "dequantized"}
    assert {(s.recompute, s.no_grad, s.own) for s in mlp} == {(False, False, False), (True, False, False),
                                                              (False, True, False), (False, False, True)}
    for each in (linear, mlp):  # a test id per setting
        assert len({_setting_id(s) for s in each}) == len(each)


def test_picked_plans_choose_on_any_thread_and_say_what_they_chose():
    """The GPU drawn-plan test's chooser: asked from another thread (as
    autograd's backward thread asks for a recompute pass's plan on a GPU),
    it picks by the numbers drawn up front, in turn, and lists its choices."""
    import threading

    from workspace_manager.testing.plans import PickedPlans

    ctx = WorkspaceContext(capabilities=PROFILES["float8_current_scaling"], sharding=Sharding.NONE)
    plans = meaningful_plans(ctx)
    assert len(plans) > 2
    chooser, got = PickedPlans([1, len(plans) + 2]), []
    policy = DrawnPlanPolicy(chooser=chooser)
    worker = threading.Thread(target=lambda: got.append(policy.plan(ctx)))
    worker.start()
    worker.join()
    assert got == [plans[1]] and chooser.chosen == [(ctx, plans[1])]
    assert chooser(ctx, plans) is plans[2]  # the next pick, modulo the candidates
    assert plans[1].summary() in chooser.describe()
    with pytest.raises(ContextTypeError, match="non-empty list of non-negative ints"):
        PickedPlans([])


def carried_out_by_te(ctx, plan) -> bool:
    """Plan classes TE 2.20's Linear can carry out, from its code
    (``_linear_forward_impl``, ``_linear_backward_impl``): the binding sets
    the quantizer's usages and owns the cache, so every cache action and
    forward usage can be had; TE saves the workspace or, with ``is_fsdp2``,
    saves nothing and quantizes ``saved_weight`` again before dgrad; its
    backward calls ``update_usage(columnwise_usage=True)``, which makes a
    per-tensor FP8 transpose (or 2D-block columnwise data) from rowwise
    data; ``backward_override`` makes dgrad dequantize the saved workspace
    or read the high-precision weight. So, for a high-precision weight:
    no quantized backward weight (NONE, HIGH_PRECISION); a rebuild
    (REQUANTIZE); a saved workspace built with both usages for quantized
    dgrad; a rowwise-only saved workspace for a derivable format (columnwise
    derived in backward) or for a dequantized dgrad."""
    if ctx.is_quantized_param:
        return plan.parameter_keeps == Usage.BOTH and not ctx.sharding.is_fsdp2
    source = plan.backward_source
    if source in (BackwardSource.NONE, BackwardSource.HIGH_PRECISION, BackwardSource.REQUANTIZE):
        return True
    if source is not BackwardSource.SAVED_WORKSPACE:
        return False
    if plan.columnwise_source in (ColumnwiseSource.FORWARD, ColumnwiseSource.DERIVED):
        return True
    return plan.backward_usage == Usage.ROWWISE and plan.forward_usage == Usage.ROWWISE


@pytest.mark.parametrize("setting", linear_settings(), ids=_setting_id)
@_HYPOTHESIS
@given(data=st.data())
def test_plans_te_can_carry_out_are_never_refused(ti, setting, data):
    """Drawn among :func:`carried_out_by_te`'s plans, a run is never refused,
    and (as every run) conforms with stock's numbers."""
    policy = _drawing(data, carried_out_by_te)
    try:
        problems = _train(ti, setting, policy)
    except PolicyMismatchError as err:
        refused = {ctx: plan.summary() for ctx, plan in policy.planned().items()}
        pytest.fail(f"refused a plan TE can carry out: {err}\nplans: {refused}")
    assert not problems, "\n".join(problems)


def test_a_fixed_sharding_reads_what_it_was_given_and_refuses_anything_else():
    keep = FixedSharding(Sharding.FSDP2_KEEP)
    assert (keep.read(), keep.current(), keep.stale(), keep.is_fsdp2) == (Sharding.FSDP2_KEEP,) * 2 + (False, True)
    assert FixedSharding(Sharding.FSDP2_KEEP, is_fsdp2=False).is_fsdp2 is False  # TE sees a whole weight
    assert FixedSharding(Sharding.NONE).is_fsdp2 is False
    with pytest.raises(ContextTypeError, match="needs a Sharding"):
        FixedSharding("fsdp2_keep")


def test_layernorm_mlp_whose_fc1_and_fc2_save_differently_conforms(ti, monkeypatch):
    """LeanWorkspacePolicy with a delayed-scaling FC1: FC1's workspace is
    saved (its requantization is not exact), FC2 is rebuilt in backward.
    TE's one is_fsdp2 switch cannot say that; the binding carries out both
    plans, call by call, with stock's numbers."""
    from workspace_manager import LeanWorkspacePolicy

    split = []
    forward_split = ti.layernorm_mlp._forward_split
    monkeypatch.setattr(ti.layernorm_mlp, "_forward_split", lambda *args: split.append(1) or forward_split(*args))
    for microbatches in ((None,), (True, False, False)):
        setting = Setting(Sharding.NONE, microbatches, recompute=False, no_grad=False, override=None,
                          input_grad=True, kind="LayerNormMLP", mixed=True)
        problems = _train(ti, setting, LeanWorkspacePolicy())
        assert not problems, "\n".join(problems)
    assert split  # the calls ran the split path
