"""te_integration's seams on CPU: the plan each recompute setting gets, and
the TE levers the seams set from it, with a stand-in for TE.

The GPU found the case these pin down (a run at d7db962): under FSDP2 and ``te.checkpoint``, a delayed-scaling
recompute pass must leave dgrad's copy to TE's backward rebuild, while
``LayerNormMLP(checkpoint=True)`` keeps the pass's copy (decisions.md, D3).
By default every format's ``te.checkpoint`` pass leaves it to the rebuild,
as TE's does; ``RecomputeCopy.BUILD_ONCE`` keeps the pass's copy for formats
that requantize exactly.
"""

from __future__ import annotations

import contextlib
import types
from types import SimpleNamespace

import pytest
from _binding_standin import load_binding
from _fake_te_grouped import compat_entries as grouped_compat_entries

from workspace_manager import (
    BackwardSource,
    FSDP2WorkspacePolicy,
    RecomputeCopy,
    RecomputePass,
    RecomputeScope,
    RecomputeWorkspacePolicy,
    Sharding,
)

#: The recompute option pinned: a te.checkpoint pass under FSDP2 builds once.
BUILD_ONCE = RecomputeWorkspacePolicy(inner=FSDP2WorkspacePolicy(), recompute_copy=RecomputeCopy.BUILD_ONCE)


def _quantizer_class(name: str, file: str = "float8_tensor", **attrs) -> type:
    # Named as TE's classes, so the registry's TE profiles describe them.
    return type(name, (), {"__module__": f"transformer_engine.pytorch.tensor.{file}", "__qualname__": name, **attrs})


DELAYED = _quantizer_class("Float8Quantizer")
CURRENT = _quantizer_class("Float8CurrentScalingQuantizer")

#: Positions in the stand-in LayerNormMLP argument tuple.
MLP = {"is_first_microbatch": 0, "fp8": 1, "fc1_weight_quantizer": 2, "fc2_weight_quantizer": 3,
       "cpu_offloading": 4, "is_grad_enabled": 5, "fsdp_group": 6, "skip_fp8_weight_update": 7,
       "checkpoint": 8, "debug": 9, "is_fsdp2": 10, "recompute_for_bwd": 11}


#: Positions in the stand-in LayerNormLinear argument tuple.
LNL = {"is_first_microbatch": 0, "fp8": 1, "weight_quantizer": 2, "cpu_offloading": 3, "is_grad_enabled": 4,
       "fsdp_group": 5, "skip_fp8_weight_update": 6, "debug": 7, "is_fsdp2": 8}

#: Positions of the two workspaces in what the stand-in's recompute pass returns.
RECOMPUTED = {"fc1_weight": 4, "fc2_weight": 10}


class _Storage:
    """Stands for TE's QuantizedTensorStorage (no weight here is one)."""


class _LinearFunction:
    """Stands for TE's ``_Linear``: records the knobs the seam set."""

    seen: list = []

    @staticmethod
    def forward(ctx, weight, inp, bias, fwd_args):
        _LinearFunction.seen.append(fwd_args.is_fsdp2)
        if ctx is not None:
            ctx.backward_objects = SimpleNamespace(is_fsdp2=None, weight_quantizer="te's")
        return inp

    @staticmethod
    def backward(ctx, *grads):
        return grads


class _LNLFunction:
    """Stands for TE's ``_LayerNormLinear``, with its exact positional
    signature: records the weight and the argument tuple it got."""

    seen: list = []

    @staticmethod
    def forward(ctx, inp, ln_weight, ln_bias, weight, weight_workspace, bias, non_tensor_args):
        _LNLFunction.seen.append((weight, non_tensor_args))
        if ctx is not None:
            ctx.is_fsdp2, ctx.weight_quantizer = None, "te's"
        return inp

    @staticmethod
    def backward(ctx, *grads):
        return grads


class _MLPFunction:
    """Stands for TE's ``_LayerNormMLP``: records the argument tuple."""

    seen: list = []

    @staticmethod
    def _forward(ctx, inp, ln_w, ln_b, fc1_w, fc1_ws, fc1_b, fc2_w, fc2_ws, fc2_b, nta):
        _MLPFunction.seen.append(nta)
        if nta[MLP["recompute_for_bwd"]]:  # TE's recompute pass: its tensors for backward, workspaces built
            out = [ctx] + [object() for _ in range(14)]
            out[RECOMPUTED["fc1_weight"] + 1], out[RECOMPUTED["fc2_weight"] + 1] = fc1_w, fc2_w
            return tuple(out)
        return inp

    @staticmethod
    def backward(ctx, *grads):
        """TE's backward under its own checkpoint: the recompute pass runs first."""
        ctx.recomputed = _MLPFunction._recompute(ctx)
        return grads


class _RegionFlag:
    """TE's ``_IN_ACTIVATION_RECOMPUTE_REGION`` global, following ``phase``."""

    def __init__(self, phase: dict) -> None:
        self._phase = phase

    @property
    def _IN_ACTIVATION_RECOMPUTE_REGION(self) -> bool:
        return self._phase["enabled"]


def _te_file(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(f"stand_in_te.{name}")
    for key, value in attrs.items():
        setattr(module, key, value)
    return module


@pytest.fixture
def binding(monkeypatch):
    phase = {"enabled": False, "recompute": False}
    compat = {
        **grouped_compat_entries(),
        "linear_module": _te_file("linear"), "lnl_module": _te_file("layernorm_linear"),
        "lnmlp_module": _te_file("layernorm_mlp", prepare_for_saving=lambda *tensors: list(tensors)),
        "mha_module": _te_file("multi_head_attention"), "transformer_module": _te_file("transformer"),
        "base_module": _te_file("base"),
        "QuantizedTensorStorage": _Storage,
        "TELinear": type("_TELinear", (), {}),
        "TELayerNormLinear": type("_TELayerNormLinear", (), {}),
        "TELayerNormMLP": type("_TELayerNormMLP", (), {}),
        "LinearFunction": _LinearFunction,
        "LNLFunction": _LNLFunction,
        "FP8GlobalStateManager": SimpleNamespace(get_fp8_recipe=lambda: None),
        "LNMLPFunction": _MLPFunction,
        "LNL_ARGS": LNL,
        "LNMLP_ARGS": MLP,
        "LNMLP_RECOMPUTED": RECOMPUTED,
        "is_fp8_activation_recompute_enabled": lambda: phase["enabled"],
        "in_fp8_activation_recompute_phase": lambda: phase["recompute"],
        "is_graph_capturing": lambda: False,
        "graph_flags": SimpleNamespace(_IS_GRAPH_CAPTURING=False),
        "recompute_flags": _RegionFlag(phase),
        "is_distributed_weight": lambda weight: False,
        "clear_columnwise_cache": lambda tensor: None,
    }
    modules = load_binding(monkeypatch, compat, "runtime._attribution", "runtime._state", "runtime._call",
                           "runtime._quantize", "runtime._release", "kinds.linear", "kinds.layernorm_linear",
                           "kinds.layernorm_mlp", "runtime._functions", "runtime._install")
    _LinearFunction.seen.clear()
    _MLPFunction.seen.clear()
    _LNLFunction.seen.clear()
    install = modules["runtime._install"]
    seams = {name: install.seam_function_of(modules[f"kinds.{name}"].ADAPTER)
             for name in ("linear", "layernorm_linear", "layernorm_mlp")}
    return SimpleNamespace(phase=phase, state=modules["runtime._state"], call=modules["runtime._call"],
                           te=modules["runtime._call"].te, quantize=modules["runtime._quantize"],
                           release=modules["runtime._release"], mlp=modules["kinds.layernorm_mlp"],
                           functions=modules["runtime._functions"], linear_seam=seams["linear"],
                           lnl_seam=seams["layernorm_linear"], mlp_seam=seams["layernorm_mlp"])


def _module(binding, kind: str, sharding: Sharding, policy=None):
    """The little of a drop-in module the seams read: its kind, its state
    (whose sharding reads as given, as FSDP2's state would, and with
    ``policy`` pinned) and its cache."""

    probe = SimpleNamespace(read=lambda: sharding, current=lambda: sharding, stale=lambda: False)
    kind = binding.state.ModuleKind({"linear": "linear", "lnl": "layernorm_linear", "lnmlp": "layernorm_mlp"}[kind])
    state = binding.state.ModuleWorkspaceState(kind, policy, probe=probe)
    return SimpleNamespace(_wm_kind=kind, _wm_state=state, _fp8_workspaces={})


def _record(binding, module):
    """A call record of ``module``, as its prepare_forward makes it (the sharding read from its probe)."""
    state = module._wm_state
    return binding.call.new_record(module, state, state.sharding(module), binding.call.ACTIVE.record)


@contextlib.contextmanager
def _in_call(binding, module):
    """``module``'s call record on top of this thread's stack, as between
    its prepare_forward and end_forward; yields the record."""
    active = binding.call.ACTIVE
    record = _record(binding, module)
    active.record = record
    try:
        yield record
    finally:
        active.record = record.previous


def _plan_mlp(binding, module, nta: tuple, fc1_weight, fc2_weight) -> tuple:
    """The LayerNormMLP adapter's plan of one call: (fc1 weight, its levers,
    fc2 weight, its levers), from inside its call window, or as its own
    recompute pass in backward (from the module its first pass left on ctx)."""
    own_recompute = nta[MLP["recompute_for_bwd"]]
    ctx = SimpleNamespace(_te_wm_backward=binding.release.BackwardWork(module))
    args = ("x", None, None, fc1_weight, None, None, fc2_weight, None, None, nta)
    with contextlib.nullcontext() if own_recompute else _in_call(binding, module):
        record, _ = binding.mlp._begin(ctx, args)
    if record.pushed_by_seam:
        binding.call.ACTIVE.record = record.previous
    return record.weights


def _in_te_checkpoint(binding, recompute: bool) -> None:
    binding.phase.update(enabled=True, recompute=recompute)


def _linear(binding, quantizer: type, sharding=Sharding.FSDP2_RESHARD, policy=None):
    """One managed Linear call through the seam: its slot's plan, and the
    ``is_fsdp2`` levers set for TE's forward and backward."""
    module = _module(binding, "linear", sharding, policy)
    with _in_call(binding, module):
        fwd_args = SimpleNamespace(fp8=True, debug=False, fsdp_group=None, skip_fp8_weight_update=None,
                                   cpu_offloading=False, weight_quantizer=quantizer(), is_grad_enabled=True,
                                   input_requires_grad=True, is_first_microbatch=None, backward_override=None,
                                   is_fsdp2=None)
        ctx = SimpleNamespace()
        binding.linear_seam.forward(ctx, object(), "x", None, fwd_args)
    ctx_plan = module._wm_state.last_plans()["weight"]
    return ctx_plan, _LinearFunction.seen[-1], ctx.backward_objects.is_fsdp2


@pytest.mark.parametrize("quantizer, policy", [(DELAYED, None), (CURRENT, None), (DELAYED, BUILD_ONCE)],
                         ids=["delayed", "current", "delayed-build-once"])
def test_a_recompute_pass_under_fsdp2_is_rebuilt_in_backward_as_te_does(binding, quantizer, policy):
    """By default for every format (D3 is an option), and for delayed scaling
    even with the option: its pass's copy would carry the first pass's scale."""
    _in_te_checkpoint(binding, recompute=True)
    (ctx, plan), forward_lever, backward_clear = _linear(binding, quantizer, policy=policy)
    assert ctx.recompute is RecomputePass.RECOMPUTE and ctx.recompute_scope is RecomputeScope.REGION
    assert plan.backward_source is BackwardSource.REQUANTIZE
    # TE saves nothing (is_fsdp2 True in forward) and clears the rebuilt copy after dgrad.
    assert forward_lever is True and backward_clear is True


def test_current_scaling_recompute_pass_under_fsdp2_keeps_its_copy_with_build_once(binding):
    _in_te_checkpoint(binding, recompute=True)
    (ctx, plan), forward_lever, backward_clear = _linear(binding, CURRENT, policy=BUILD_ONCE)
    assert plan.backward_source is BackwardSource.SAVED_WORKSPACE  # D3's option: built once, saved
    assert forward_lever is False and backward_clear is False


def test_non_reentrant_first_pass_saves_what_the_recompute_pass_saves(binding):
    _in_te_checkpoint(binding, recompute=False)
    (ctx, plan), forward_lever, _ = _linear(binding, DELAYED)
    assert ctx.recompute is RecomputePass.FIRST
    assert forward_lever is True  # as the recompute pass: nothing saved


def _mlp_nta(quantizer: type, *, checkpoint: bool, recompute_for_bwd: bool) -> tuple:
    values = {"is_first_microbatch": None, "fp8": True, "fc1_weight_quantizer": quantizer(),
              "fc2_weight_quantizer": quantizer(), "cpu_offloading": False, "is_grad_enabled": True,
              "fsdp_group": None, "skip_fp8_weight_update": None, "checkpoint": checkpoint, "debug": False,
              "is_fsdp2": True, "recompute_for_bwd": recompute_for_bwd}
    return tuple(values[name] for name in sorted(MLP, key=MLP.get))


@pytest.mark.parametrize(
    "checkpoint, recompute_for_bwd, in_te_checkpoint, expected",
    [
        # LayerNormMLP(checkpoint=True): its first pass is planned as a reentrant
        # first pass, and its recompute pass keeps its copy (TE hands it to backward).
        (True, False, False, (RecomputePass.FIRST, RecomputeScope.MODULE, False)),
        (True, True, False, (RecomputePass.RECOMPUTE, RecomputeScope.MODULE, True)),
        # Inside te.checkpoint: a region's passes.
        (False, False, True, (RecomputePass.RECOMPUTE, RecomputeScope.REGION, True)),
    ],
    ids=["own_first", "own_recompute", "te_checkpoint_recompute"],
)
def test_layernorm_mlp_plans_tell_its_own_recompute_from_a_region(binding, checkpoint, recompute_for_bwd,
                                                                   in_te_checkpoint, expected):
    if in_te_checkpoint:
        _in_te_checkpoint(binding, recompute=True)
    module = _module(binding, "lnmlp", Sharding.FSDP2_RESHARD)
    nta = _mlp_nta(DELAYED, checkpoint=checkpoint, recompute_for_bwd=recompute_for_bwd)
    weights = _plan_mlp(binding, module, nta, object(), object())
    slots = weights[1::2]
    plans = module._wm_state.last_plans()
    assert set(plans) == {"fc1_weight", "fc2_weight"}
    for ctx, plan in plans.values():
        assert (ctx.recompute, ctx.recompute_scope, ctx.grad_enabled) == expected
    sources = {plan.backward_source for _, plan in plans.values()}
    if expected[:2] == (RecomputePass.RECOMPUTE, RecomputeScope.MODULE):
        assert sources == {BackwardSource.SAVED_WORKSPACE}
        assert not any(s.saves_no_workspace for s in slots)
    if expected[:2] == (RecomputePass.RECOMPUTE, RecomputeScope.REGION):
        assert sources == {BackwardSource.REQUANTIZE}
        assert all(s.saves_no_workspace for s in slots)


@pytest.mark.parametrize("quantizer, expected", [(DELAYED, "bypass"), (CURRENT, "read_only")],
                         ids=["delayed", "current"])
def test_layernorm_mlp_own_recompute_reads_a_cache_only_if_requantization_is_exact(binding, quantizer, expected):
    """TE's own recompute quantizes afresh with the scale current in backward;
    a delayed-scaling copy cached at the first microbatch would differ."""
    module = _module(binding, "lnmlp", Sharding.NONE)
    nta = list(_mlp_nta(quantizer, checkpoint=True, recompute_for_bwd=True))
    nta[MLP["is_first_microbatch"]] = False
    _plan_mlp(binding, module, tuple(nta), object(), object())
    for _, plan in module._wm_state.last_plans().values():
        assert plan.cache.value == expected


def _saving_quantizer(name: str, made: list | None = None) -> type:
    """A stand-in quantizer with the usages the quantize_weight seam sets,
    named as TE's class so the registry's TE profiles describe it. Its
    ``quantize`` (which the seam calls for an uncached weight, as TE's
    quantize_weight does) appends what it makes to ``made``."""
    def set_usage(self, *, rowwise=None, columnwise=None):
        self.rowwise_usage = self.rowwise_usage if rowwise is None else rowwise
        self.columnwise_usage = self.columnwise_usage if columnwise is None else columnwise

    def quantize(self, tensor, *, dtype=None):
        out = SimpleNamespace(source=tensor, columnwise=self.columnwise_usage)
        if made is not None:
            made.append(out)
        return out

    return _quantizer_class(name, rowwise_usage=True, columnwise_usage=True, set_usage=set_usage, quantize=quantize)


def test_layernorm_mlp_carries_out_fc1_and_fc2_plans_that_save_differently(binding, monkeypatch):
    """FC1 rebuilt, FC2 saved (a te.checkpoint recompute pass under FSDP2
    with the build-once option: delayed-scaling FC1 must be rebuilt, exact
    FC2 keeps the pass's copy). TE has one switch for both, so the seam runs
    TE with it off and hands FC1's workspace to TE's prepare_for_saving as
    None: backward rebuilds FC1 and reads FC2's saved copy."""
    module = _module(binding, "lnmlp", Sharding.FSDP2_RESHARD, BUILD_ONCE)
    made, saved = [], []
    nta = list(_mlp_nta(_saving_quantizer("Float8CurrentScalingQuantizer", made), checkpoint=False,
                        recompute_for_bwd=False))
    nta[MLP["fc1_weight_quantizer"]] = _saving_quantizer("Float8Quantizer", made)()
    _in_te_checkpoint(binding, recompute=True)
    compat = binding.te

    def quantize_weight(**_):
        raise AssertionError("an uncached weight is quantized by its quantizer, not through TE's quantize_weight")

    def forward(ctx, inp, ln_w, ln_b, fc1_w, fc1_ws, fc1_b, fc2_w, fc2_ws, fc2_b, args):
        # TE's order: quantize both weights through the module global, then save (layernorm_mlp.py:807).
        fc1, _ = binding.quantize.managed_quantize_weight(tensor=fc1_w, quantizer=args[MLP["fc1_weight_quantizer"]])
        fc2, _ = binding.quantize.managed_quantize_weight(tensor=fc2_w, quantizer=args[MLP["fc2_weight_quantizer"]])
        saved.append(compat.lnmlp_module.prepare_for_saving(None, fc1, fc1_w, None, fc2, fc2_w))
        _MLPFunction.seen.append(args)
        return inp

    lnmlp_module = SimpleNamespace(prepare_for_saving=lambda *tensors: list(tensors))
    original = lnmlp_module.prepare_for_saving
    monkeypatch.setattr(compat, "lnmlp_module", lnmlp_module, raising=False)
    monkeypatch.setattr(compat, "quantize_weight", quantize_weight, raising=False)
    monkeypatch.setattr(_MLPFunction, "_forward", staticmethod(forward))
    seam = binding.functions.seam_function(binding.mlp.ADAPTER.function)  # the seam over the patched forward
    fc1_w, fc2_w = object(), object()
    with _in_call(binding, module) as record:
        seam._forward(SimpleNamespace(), "x", None, None, fc1_w, None, None, fc2_w, None, None,
                                  tuple(nta))
    plans = {key: plan.backward_source for key, (_, plan) in module._wm_state.last_plans().items()}
    assert plans == {"fc1_weight": BackwardSource.REQUANTIZE, "fc2_weight": BackwardSource.SAVED_WORKSPACE}
    assert _MLPFunction.seen[-1][MLP["is_fsdp2"]] is False  # TE saves both...
    assert saved == [[None, None, fc1_w, None, made[1], fc2_w]]  # ...but gets None for FC1's workspace
    assert [m.source for m in made] == [fc1_w, fc2_w]
    assert lnmlp_module.prepare_for_saving is original  # put back
    assert record.part.dropped == [made[0]]  # the call's record held FC1's workspace, the one backward rebuilds


def test_layernorm_mlp_split_calls_on_two_threads_each_hand_te_none_for_their_own_rebuilt_weight(binding,
                                                                                                 monkeypatch):
    """The swapped ``prepare_for_saving`` is one module global. A second
    thread's split call that swapped while the first's was in flight would
    find TE's own name put back under it by the first, and save the
    workspace its plan rebuilds. The second call waits for the first."""
    import threading

    from workspace_manager import LeanWorkspacePolicy

    compat = binding.te
    lnmlp_module = SimpleNamespace(prepare_for_saving=lambda *tensors: list(tensors))
    original = lnmlp_module.prepare_for_saving
    first_done, saved, blocked, threads, entered = threading.Event(), {}, [], [], []

    def quantize_weight(*, tensor=None, quantizer=None, **_):
        return SimpleNamespace(source=tensor), None

    def call(name: str) -> None:
        module = _module(binding, "lnmlp", Sharding.NONE, LeanWorkspacePolicy())  # FC1 saved, FC2 rebuilt
        nta = list(_mlp_nta(_saving_quantizer("Float8CurrentScalingQuantizer"), checkpoint=False,
                            recompute_for_bwd=False))
        nta[MLP["fc1_weight_quantizer"]] = _saving_quantizer("Float8Quantizer")()
        with _in_call(binding, module):
            seams[0]._forward(SimpleNamespace(), name, None, None, f"{name} fc1", None, None,
                                      f"{name} fc2", None, None, tuple(nta))

    def forward(ctx, inp, ln_w, ln_b, fc1_w, fc1_ws, fc1_b, fc2_w, fc2_ws, fc2_b, args):
        entered.append(inp)
        fc1, _ = binding.quantize.managed_quantize_weight(tensor=fc1_w, quantizer=args[MLP["fc1_weight_quantizer"]])
        fc2, _ = binding.quantize.managed_quantize_weight(tensor=fc2_w, quantizer=args[MLP["fc2_weight_quantizer"]])
        if inp == "first":
            second = threading.Thread(target=call, args=("second",))
            threads.append(second)
            second.start()
            second.join(0.3)
            # Still waiting, and not yet inside TE's forward: it waits for the
            # first call's swap to end, not (as it would without the lock) for
            # first_done below, which is set only once the first call returned.
            blocked.append(second.is_alive() and entered == ["first"])
        else:
            first_done.wait(5)  # without the wait for the first call, that call ends here
        saved[inp] = [getattr(t, "source", t) for t in compat.lnmlp_module.prepare_for_saving(fc1, fc2)]
        return inp

    monkeypatch.setattr(compat, "lnmlp_module", lnmlp_module, raising=False)
    monkeypatch.setattr(compat, "quantize_weight", quantize_weight, raising=False)
    monkeypatch.setattr(_MLPFunction, "_forward", staticmethod(forward))
    seams = [binding.functions.seam_function(binding.mlp.ADAPTER.function)]  # the seam over the patched forward
    call("first")
    first_done.set()
    threads[0].join(5)
    assert blocked == [True] and not threads[0].is_alive()
    assert saved == {"first": ["first fc1", None], "second": ["second fc1", None]}
    assert lnmlp_module.prepare_for_saving is original


def test_layernorm_mlp_of_two_formats_rebuilds_both_in_a_te_checkpoint_pass_by_default(binding):
    """The same mix by default: both weights are rebuilt in backward, as
    TE's one switch does, so the two plans agree."""
    module = _module(binding, "lnmlp", Sharding.FSDP2_RESHARD)
    nta = list(_mlp_nta(CURRENT, checkpoint=False, recompute_for_bwd=False))
    nta[MLP["fc1_weight_quantizer"]] = DELAYED()
    _in_te_checkpoint(binding, recompute=True)
    _plan_mlp(binding, module, tuple(nta), object(), object())
    sources = {plan.backward_source for _, plan in module._wm_state.last_plans().values()}
    assert sources == {BackwardSource.REQUANTIZE}


def _own_recompute(binding, policy, quantizer=CURRENT):
    """LayerNormMLP(checkpoint=True), unsharded: the seam's recompute pass in
    backward, returning what it hands TE's backward and the ctx."""
    module = _module(binding, "lnmlp", Sharding.NONE, policy)
    ctx = SimpleNamespace(_te_wm_backward=binding.release.BackwardWork(module), fc1_weight_quantizer=quantizer(),
                          fc2_weight_quantizer=quantizer())
    fc1_w, fc2_w = object(), object()
    nta = _mlp_nta(quantizer, checkpoint=True, recompute_for_bwd=True)
    out = binding.mlp_seam._forward(ctx, "x", None, None, fc1_w, None, None, fc2_w, None, None, nta)
    assert binding.call.ACTIVE.record is None  # the pass's own record, popped
    return out, ctx, module


def test_own_recompute_pass_leaves_backward_to_rebuild_where_the_plan_requantizes(binding):
    """Found by the GPU drawn-plan test: TE's own recompute ignores is_fsdp2 and
    handed dgrad the pass's copy while the plan said requantize."""
    from workspace_manager import CacheAction
    from workspace_manager.testing.plans import DrawnPlanPolicy

    def requantize(ctx, candidates):
        return next(p for p in candidates
                    if p.backward_source is BackwardSource.REQUANTIZE and p.cache is CacheAction.BYPASS)

    out, ctx, module = _own_recompute(binding, DrawnPlanPolicy(chooser=requantize))
    plans = module._wm_state.last_plans()
    assert {plan.backward_source for _, plan in plans.values()} == {BackwardSource.REQUANTIZE}
    assert out[RECOMPUTED["fc1_weight"]] is None and out[RECOMPUTED["fc2_weight"]] is None
    # the rebuild builds the columnwise data dgrad reads, and nothing else (D9)
    for name in ("fc1_weight_quantizer", "fc2_weight_quantizer"):
        rebuilder = getattr(ctx, name)
        assert type(rebuilder).__name__ == "RebuildQuantizer" and rebuilder.usage.label == "columnwise"


def test_own_recompute_pass_hands_its_copy_to_backward_where_the_plan_saves_it(binding):
    out, _, module = _own_recompute(binding, None)
    plans = module._wm_state.last_plans()
    assert {plan.backward_source for _, plan in plans.values()} == {BackwardSource.SAVED_WORKSPACE}
    assert out[RECOMPUTED["fc1_weight"]] is not None and out[RECOMPUTED["fc2_weight"]] is not None


def test_own_checkpoint_backward_releases_what_its_recompute_pass_planned(binding, monkeypatch):
    """The release record is written by the recompute pass, inside TE's
    backward: the backward seam must not skip its release step because the
    first pass left none (found by the GPU drawn-plan test)."""
    released = []
    monkeypatch.setattr(binding.release.BackwardWork, "after_te_backward", lambda work: released.append(work))
    module = _module(binding, "lnmlp", Sharding.NONE)
    ctx = SimpleNamespace(_te_wm_backward=binding.release.BackwardWork(module))  # what the first pass leaves
    work = binding.release.BackwardWork(module, releases=(("fc1 weight", "its levers"),))

    def recompute(ctx):
        ctx._te_wm_backward = work  # what the recompute pass's ctx edit leaves when the plan releases
        return ()

    monkeypatch.setattr(_MLPFunction, "_recompute", staticmethod(recompute), raising=False)
    binding.mlp_seam.backward(ctx, "grad")
    assert released == [work]
    assert ctx._te_wm_backward is None


def _block_quantizer(dim: int):
    """Stands for TE's Float8BlockQuantizer, whose capabilities depend on the
    instance (1D or 2D scaling)."""
    quantizer = _quantizer_class("Float8BlockQuantizer", "float8_blockwise_tensor")()
    quantizer.block_scaling_dim = dim
    return quantizer


def _levers(state, module, quantizer):
    return state.levers(module, Sharding.NONE, key="weight", weight=object(), quantizer=quantizer, grad=True,
                        input_requires_grad=True, is_first_microbatch=None, backward_override=None,
                        recompute=RecomputePass.NONE, scope=RecomputeScope.REGION)


def test_instance_dependent_capabilities_are_read_once_per_quantizer_object(binding, monkeypatch):
    """Block FP8's capabilities depend on the quantizer object: each object
    is planned for its own, and a repeated call asks the registry nothing
    (found by the GPU step profile: ten calls per weight and call)."""
    module = _module(binding, "linear", Sharding.NONE)
    state = module._wm_state
    two_d, one_d = _block_quantizer(2), _block_quantizer(1)
    plans = {dim: _levers(state, module, q).context.capabilities.name for dim, q in ((2, two_d), (1, one_d))}
    assert plans[2] != plans[1]
    assert state.shapes_planned() == 2
    asked = []
    registry = binding.state.default_registry
    monkeypatch.setattr(registry, "capabilities_key", lambda q: asked.append(q) or type(q))
    assert _levers(state, module, two_d).context.capabilities.name == plans[2]
    assert _levers(state, module, one_d).context.capabilities.name == plans[1]
    assert asked == [] and state.shapes_planned() == 2


@pytest.mark.parametrize("sharding, saves_none", [(Sharding.FSDP2_RESHARD, True), (Sharding.NONE, False)],
                         ids=["fsdp2", "unsharded"])
def test_layernorm_linear_hands_te_its_arguments_with_the_switch_set(binding, sharding, saves_none):
    """The LayerNormLinear adapter reads the weight and TE's argument tuple at
    their places in ``_LayerNormLinear.forward`` (the stand-in has TE's
    exact signature), sets TE's switch from the plan and backward's levers."""
    module = _module(binding, "lnl", sharding)
    values = {"is_first_microbatch": None, "fp8": True, "weight_quantizer": CURRENT(), "cpu_offloading": False,
              "is_grad_enabled": True, "fsdp_group": None, "skip_fp8_weight_update": None, "debug": False,
              "is_fsdp2": "te's own"}
    nta = tuple(values[name] for name in sorted(LNL, key=LNL.get))
    weight, ctx = object(), SimpleNamespace()
    with _in_call(binding, module):
        binding.lnl_seam.forward(ctx, "x", "ln weight", "ln bias", weight, None, None, nta)
    (seen_weight, seen_nta), = _LNLFunction.seen
    assert seen_weight is weight and len(seen_nta) == len(nta)
    assert seen_nta[LNL["is_fsdp2"]] is saves_none  # TE saves no workspace under FSDP2
    assert seen_nta[:LNL["is_fsdp2"]] == nta[:LNL["is_fsdp2"]]  # nothing else changed
    (context, plan), = module._wm_state.last_plans().values()
    assert context.sharding is sharding
    assert ctx.is_fsdp2 is saves_none and ctx._te_wm_backward is None  # TE's clear of the rebuilt copy
