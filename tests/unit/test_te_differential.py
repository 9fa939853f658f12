"""Differential test: our policies against TE 2.20.2's own decisions.

``te_reference.py`` is a table of TE 2.20.2's decisions written by hand from
TE 2.20.2's source, independently of this package. For every case it
covers, each compared lever (cache, forward columnwise, workspace saved and
with which usages, backward rebuild and its usages, clear after backward,
what a quantized parameter keeps) must either agree with TE or be explained by exactly the
deliberate differences listed below, each of which has a section in
``docs/decisions.md``. A difference no entry explains fails the test, and
so does an entry that explains nothing (the list cannot rot).

The shipped policies' options (``MicrobatchCache``, ``RecomputeCopy``) are
off by default. The comparison runs once per combination of options; an
entry that names an option explains differences only where that option is
on, so the default must agree with TE wherever only an option differs.

A high-precision FSDP2 weight is compared twice: as a binding describes it
without a quantized all-gather, and with one set up over many ranks
(``ShardGather.MANY_RANKS``), against TE's decisions for the same case (TE
gathers such a weight in bf16): there D13 explains what differs.
"""

from __future__ import annotations

import itertools
import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Union

import pytest
import te_reference as ref

from workspace_manager import (
    BackwardOverride,
    BackwardSource,
    CacheAction,
    FSDP2WorkspacePolicy,
    Microbatch,
    MicrobatchCache,
    RecomputeCopy,
    RecomputePass,
    RecomputeScope,
    RecomputeWorkspacePolicy,
    Release,
    ShardGather,
    Sharding,
    Usage,
    WeightSource,
    WorkspaceContext,
    WorkspaceOrigin,
    WorkspacePlan,
    WorkspacePolicy,
    resolve_policy,
    select_policy,
)
from workspace_manager._policy import base_policy_for
from workspace_manager._profiles import FLOAT8_CURRENT_SCALING, FLOAT8_DELAYED_SCALING

DECISIONS_MD = Path(__file__).resolve().parents[2] / "docs" / "decisions.md"

_SHARDING = {
    "none": Sharding.NONE,
    "fsdp2_reshard": Sharding.FSDP2_RESHARD,
    "fsdp2_keep": Sharding.FSDP2_KEEP,
    "distributed_weight": Sharding.DISTRIBUTED_WEIGHT,
}


#: TE's module decisions do not depend on the format, but ours do where a
#: format does not requantize exactly (D4, and the recompute rule below), so
#: every case is compared with a format that does and with one that does not.
FORMATS = (FLOAT8_CURRENT_SCALING, FLOAT8_DELAYED_SCALING)


Option = Union[MicrobatchCache, RecomputeCopy]
#: A combination of options: the microbatch cache's and the recompute copy's.
Config = tuple[MicrobatchCache, RecomputeCopy]
DEFAULT: Config = (MicrobatchCache.OFF, RecomputeCopy.AS_TE)
CONFIGS: tuple[Config, ...] = tuple(itertools.product(MicrobatchCache, RecomputeCopy))


def only(option: Option) -> Config:
    """The combination with ``option`` on and every other option off."""
    return (option, DEFAULT[1]) if isinstance(option, MicrobatchCache) else (DEFAULT[0], option)


def policy_for(ctx: WorkspaceContext, config: Config = DEFAULT) -> WorkspacePolicy:
    """The policy that plans ``ctx``: the manager's own choice by default,
    else the shipped policy with ``config``'s options, pinned as a user
    would pin it."""
    if config == DEFAULT:
        return select_policy(ctx)
    cache, copy = config
    inner = base_policy_for(ctx.sharding)()
    if isinstance(inner, FSDP2WorkspacePolicy):
        inner = FSDP2WorkspacePolicy(microbatch_cache=cache)
    return resolve_policy(ctx, RecomputeWorkspacePolicy(inner=inner, recompute_copy=copy))


def plan_for(case: ref.TECase, caps=FLOAT8_CURRENT_SCALING, config: Config = DEFAULT,
             gather: ShardGather = ShardGather.NONE) -> WorkspacePlan:
    ctx = context_for(case, caps, gather)
    return policy_for(ctx, config).plan(ctx)


def gathers_for(case: ref.TECase) -> tuple[ShardGather, ...]:
    """The quantized all-gathers a binding may set up for the case's weight:
    one over many ranks for a high-precision FSDP2 weight (TE has none; its
    decisions for the case are those of the bf16 gather), else none."""
    if case.sharding.startswith("fsdp2") and case.weight == "high_precision":
        return (ShardGather.NONE, ShardGather.MANY_RANKS)
    return (ShardGather.NONE,)


def context_for(case: ref.TECase, capabilities=FLOAT8_CURRENT_SCALING,
                gather: ShardGather = ShardGather.NONE) -> WorkspaceContext:
    """The context a binding builds for a TE call. The reference's
    LayerNormMLP recompute rows are the module's own checkpoint; the others
    are ``te.checkpoint`` regions."""
    own = case.module.startswith("LayerNormMLP") and case.recompute != "none"
    return WorkspaceContext(
        capabilities=capabilities,
        sharding=_SHARDING[case.sharding],
        recompute=RecomputePass(case.recompute),
        recompute_scope=RecomputeScope.MODULE if own else RecomputeScope.REGION,
        grad_enabled=case.grad_enabled,
        # Norm modules need dgrad for their own parameters whatever the input.
        input_requires_grad=case.input_requires_grad if case.module == "Linear" else True,
        weight=WeightSource(case.weight),
        microbatch=Microbatch(case.microbatch),
        backward_override=BackwardOverride(case.backward_override),
        shard_gather=gather,
    )


def our_decisions(case: ref.TECase, plan: WorkspacePlan) -> dict[str, object]:
    ours = {
        "cache": plan.cache.value,
        "saved": plan.saves_quantized,
        "rebuild": plan.backward_source is BackwardSource.REQUANTIZE
        or (plan.backward_source is BackwardSource.REGATHER and case.weight == "high_precision"),
        "clear": Release.DERIVED_COLUMNWISE in plan.release,
    }
    if ours["rebuild"]:
        ours["rebuild_usages"] = plan.backward_usage.label
    if case.weight == "quantized_param":
        ours["parameter_keeps"] = plan.parameter_keeps.label
    if case.weight == "high_precision":
        ours["forward_columnwise"] = Usage.COLUMNWISE in plan.forward_usage
        if ours["saved"]:
            ours["saved_usages"] = (plan.backward_usage if _saves_columnwise_only(case, plan) else plan.forward_usage).label
    return ours


def _saves_columnwise_only(case: ref.TECase, plan: WorkspacePlan) -> bool:
    """D11, as the binding decides it (``te_integration/runtime/_state.py``): a fresh
    (uncached) workspace saved for a backward that reads only its columnwise
    data, outside recompute passes."""
    return (case.weight == "high_precision" and case.recompute == "none" and plan.cache is CacheAction.BYPASS
            and plan.backward_source is BackwardSource.SAVED_WORKSPACE and plan.backward_usage == Usage.COLUMNWISE
            and Usage.COLUMNWISE in plan.forward_usage)


def te_decisions(case: ref.TECase, te: ref.TEDecision) -> dict[str, object]:
    out = {
        "cache": te.cache,
        "saved": te.workspace_saved,
        "rebuild": te.backward_rebuild,
        "clear": te.clear_columnwise_after_backward,
    }
    if te.backward_rebuild:
        out["rebuild_usages"] = te.rebuild_usages
    if case.weight == "quantized_param":
        # quantized_model_init quantizes parameters with both usages under grad
        # (base.py:1848) and nothing drops them later, sharded or not
        # (the FSDP2 all-gather hooks, e.g. ``tensor/float8_tensor.py:943-1052``).
        out["parameter_keeps"] = "rowwise+columnwise"
    if te.forward_columnwise is not None:
        out["forward_columnwise"] = te.forward_columnwise
        if te.workspace_saved:
            # TE saves the workspace forward built, with every usage it has.
            out["saved_usages"] = "rowwise+columnwise" if te.forward_columnwise else "rowwise"
    return out


@dataclass(frozen=True)
class Difference:
    """A deliberate difference from TE: ``applies`` says whether it explains
    a disagreement on ``field`` for ``case`` (with our plan at hand). One
    with an ``option`` explains differences only where that option is on."""

    ident: str
    fields: frozenset[str]
    applies: Callable[[ref.TECase, WorkspacePlan], bool]
    option: Option | None = None

    def available(self, config: Config) -> bool:
        return self.option is None or self.option in config


def _hp(case):
    return case.weight == "high_precision"


def _fsdp2(case):
    return case.sharding.startswith("fsdp2")


def _first(case):
    return case.recompute == "first"


DIFFERENCES: tuple[Difference, ...] = (
    Difference(
        "D1-first-pass-keeps-nothing",
        frozenset({"saved", "rebuild", "clear", "forward_columnwise", "saved_usages"}),
        # The first pass's saved tensors are dropped by checkpointing; its
        # backward decisions are the recompute pass's. Columnwise is built
        # only when a cache that the recompute pass reads is filled.
        lambda case, plan: _first(case),
    ),
    Difference(
        "D2-no-workspace-for-a-backward-that-does-not-read-it",
        frozenset({"saved", "rebuild"}),
        lambda case, plan: case.grad_enabled
        and (
            (case.module == "Linear" and not case.input_requires_grad)
            or case.backward_override == "high_precision"
        ),
    ),
    Difference(
        "D3-recompute-pass-reads-the-cache",
        frozenset({"cache", "saved"}),
        # The pass reads what the first pass cached instead of quantizing into
        # the cache again; LayerNormMLP's own pass hands its copy to backward,
        # which TE does without saving it and our plan calls saved.
        lambda case, plan: case.recompute == "recompute"
        and (plan.cache is CacheAction.READ_ONLY
             or (case.module.startswith("LayerNormMLP") and plan.saves_quantized)),
    ),
    Difference(
        "D3-option-recompute-pass-builds-once",
        frozenset({"saved", "rebuild", "forward_columnwise"}),
        # A te.checkpoint pass under FSDP2 saves its copy where TE rebuilds.
        lambda case, plan: case.recompute == "recompute" and _fsdp2(case) and not case.module.startswith("LayerNormMLP")
        and plan.backward_source is BackwardSource.SAVED_WORKSPACE,
        option=RecomputeCopy.BUILD_ONCE,
    ),
    Difference(
        "D4-option-fsdp2-keep-caches-across-microbatches",
        frozenset({"cache", "saved", "rebuild", "forward_columnwise"}),
        lambda case, plan: case.sharding == "fsdp2_keep" and plan.cache is not CacheAction.BYPASS,
        option=MicrobatchCache.EXACT_FORMATS,
    ),
    Difference(
        "D5-clear-only-what-outlives-backward",
        frozenset({"clear"}),
        # TE clears the rebuilt temporary too; that memory is freed anyway.
        lambda case, plan: _fsdp2(case) and _hp(case),
    ),
    Difference(
        "D6-clear-without-dgrad",
        frozenset({"clear"}),
        lambda case, plan: _fsdp2(case) and not _hp(case) and case.module == "Linear" and not case.input_requires_grad,
    ),
    Difference(
        "D7-distributed-weight-keeps-nothing",
        frozenset({"cache", "forward_columnwise", "rebuild"}),
        lambda case, plan: case.sharding == "distributed_weight",
    ),
    Difference(
        "D8-backward-override-respected-in-rebuild",
        frozenset({"rebuild"}),
        lambda case, plan: _fsdp2(case) and _hp(case) and case.backward_override == "high_precision",
    ),
    Difference(
        "D10-sharded-parameters-keep-what-their-gather-needs",
        frozenset({"parameter_keeps"}),
        lambda case, plan: _fsdp2(case),
    ),
    Difference(
        "D9-rebuild-quantizes-only-what-backward-reads",
        frozenset({"rebuild_usages"}),
        lambda case, plan: True,
    ),
    Difference(
        "D11-saved-workspace-keeps-what-backward-reads",
        frozenset({"saved_usages"}),
        _saves_columnwise_only,
    ),
    Difference(
        "D13-fsdp2-the-workspace-follows-the-shard",
        frozenset({"saved", "rebuild", "clear", "saved_usages", "forward_columnwise"}),
        # Made from the shard, the workspace arrives as the gathered
        # parameter, rowwise data only (no pass builds columnwise data in
        # forward): saved as it (FSDP2 refills it), never rebuilt, its
        # derived columnwise data cleared after backward.
        lambda case, plan: plan.workspace_origin is WorkspaceOrigin.SHARD,
    ),
)


def _compare(config: Config = DEFAULT) -> tuple[list[str], dict[str, list[tuple]]]:
    """The differences no available entry explains, and per entry the
    (case, format, field) triples it explains."""
    unexplained: list[str] = []
    used: dict[str, list[tuple]] = defaultdict(list)
    available = [d for d in DIFFERENCES if d.available(config)]
    for case, gather in ((c, g) for c in ref.ALL_CASES for g in gathers_for(c)):
        for caps in FORMATS:
            plan = plan_for(case, caps, config, gather)
            ours, theirs = our_decisions(case, plan), te_decisions(case, ref.te_decision(case))
            for field in theirs.keys() & ours.keys():
                if ours[field] == theirs[field]:
                    continue
                reasons = [d.ident for d in available if field in d.fields and d.applies(case, plan)]
                for r in reasons:
                    used[r].append((case, caps, field))
                if not reasons:
                    unexplained.append(f"{field}: TE={theirs[field]!r} ours={ours[field]!r} for {case} ({caps.name})")
    return unexplained, used


def _config_id(config: Config) -> str:
    return "+".join(option.value for option in config)


@pytest.mark.parametrize("config", CONFIGS, ids=_config_id)
def test_every_difference_from_te_is_deliberate(config):
    unexplained, _ = _compare(config)
    assert not unexplained, f"{len(unexplained)} unexplained differences from TE 2.20.2:\n" + "\n".join(unexplained[:40])


def test_every_listed_difference_occurs():
    """A difference without an option occurs by default; one with an option
    occurs where that option alone is on."""
    used = {config: _compare(config)[1] for config in {DEFAULT, *(only(d.option) for d in DIFFERENCES if d.option)}}
    unused = [d.ident for d in DIFFERENCES if not used[only(d.option) if d.option else DEFAULT][d.ident]]
    assert not unused, f"differences listed but never observed (remove them from the list and the doc): {unused}"


def test_an_option_off_plans_as_te_where_only_the_option_differs():
    """Every decision that, with an option on, differs from TE for no reason
    but the option agrees with TE once the option is off: the default costs
    nothing TE does not there."""
    for difference in (d for d in DIFFERENCES if d.option):
        used = _compare(only(difference.option))[1]
        others = {t for ident, triples in used.items() if ident != difference.ident for t in triples}
        alone = [t for t in used[difference.ident] if t not in others]
        assert alone, difference.ident
        for case, caps, field in alone:
            ours = our_decisions(case, plan_for(case, caps, DEFAULT))
            assert ours[field] == te_decisions(case, ref.te_decision(case))[field], (difference.ident, case, field)


def test_each_option_is_documented_as_an_option_off_by_default():
    sections = re.split(r"^## ", DECISIONS_MD.read_text(), flags=re.M)
    for difference in DIFFERENCES:
        section = " ".join(next(s for s in sections if s.startswith(difference.ident)).split())
        if difference.option is None:
            assert "-option-" not in difference.ident
            continue
        assert "-option-" in difference.ident
        assert f"{type(difference.option).__name__}.{difference.option.name}" in section, difference.ident
        assert "off by default" in section, difference.ident


#: Numbered sections that are guarantees of the binding, not differences in a
#: plan: nothing here compares them; their own tests do (D12:
#: tests/unit/test_binding_freshness.py on the stand-in TE,
#: tests/gpu/test_freshness.py on the GPU).
BINDING_GUARANTEES = frozenset({"D12-no-copy-outlives-its-source"})


def test_differences_are_documented():
    text = DECISIONS_MD.read_text()
    documented = set(re.findall(r"^## (D\d+-[a-z0-9-]+)", text, flags=re.M)) - BINDING_GUARANTEES
    listed = {d.ident for d in DIFFERENCES}
    assert listed <= documented, f"not in docs/decisions.md: {sorted(listed - documented)}"
    assert documented <= listed, f"documented but not tested: {sorted(documented - listed)}"


@pytest.mark.parametrize(
    "module", ["Linear", "LayerNormLinear", "LayerNormMLP.fc1", "LayerNormMLP.fc2"]
)
def test_plain_training_matches_te_exactly(module):
    """The everyday case: unsharded weight, grad, dgrad, no override, every
    microbatch position. Only D11 applies here: without microbatches the
    saved workspace keeps its columnwise data only (TE keeps both); every
    other decision is TE's."""
    cases = [
        c
        for c in ref.ALL_CASES
        if c.module == module
        and c.sharding == "none"
        and c.recompute == "none"
        and c.grad_enabled
        and c.input_requires_grad
        and c.backward_override == "none"
    ]
    assert cases
    for case in cases:
        plan = select_policy(context_for(case)).plan(context_for(case))
        ours, theirs = our_decisions(case, plan), te_decisions(case, ref.te_decision(case))
        if case.weight == "high_precision":
            want = "columnwise" if case.microbatch == "none" else theirs["saved_usages"]
            assert ours.pop("saved_usages") == want and theirs.pop("saved_usages") == "rowwise+columnwise", case
        assert ours == theirs, case


def test_fsdp2_reshard_matches_te_on_the_leak_fix():
    """TE#2681/#2805: under FSDP2, a high-precision weight is never cached,
    gets rowwise-only data in forward and is requantized in backward."""
    for case in ref.ALL_CASES:
        if case.sharding != "fsdp2_reshard" or case.recompute != "none" or not _hp(case):
            continue
        te = ref.te_decision(case)
        plan = select_policy(context_for(case)).plan(context_for(case))
        assert plan.cache.value == te.cache == "bypass"
        assert (Usage.COLUMNWISE in plan.forward_usage) is te.forward_columnwise is False
        assert not plan.saves_quantized and not te.workspace_saved


def _region_recompute_cases_under_fsdp2() -> list[ref.TECase]:
    """te.checkpoint recompute passes of a high-precision FSDP2 weight whose
    backward runs quantized dgrad."""
    cases = [c for c in ref.ALL_CASES if c.recompute == "recompute" and _fsdp2(c) and _hp(c)
             and not c.module.startswith("LayerNormMLP") and c.backward_override == "none"
             and (c.input_requires_grad or c.module != "Linear")]
    assert cases
    return cases


def _rebuilds_as_te(case: ref.TECase, plan: WorkspacePlan) -> None:
    te = ref.te_decision(case)
    assert te.backward_rebuild and not te.workspace_saved and not te.forward_columnwise, case
    assert plan.backward_source is BackwardSource.REQUANTIZE and not plan.saves_quantized, case
    assert Usage.COLUMNWISE not in plan.forward_usage, case


@pytest.mark.parametrize("caps", FORMATS, ids=lambda caps: caps.name)
def test_a_recompute_pass_under_fsdp2_rebuilds_as_te_does_by_default(caps):
    """D3 is an option, off by default: a ``te.checkpoint`` recompute pass
    under FSDP2 quantizes rowwise data only and saves nothing, and backward
    quantizes again, as TE does, for every format."""
    for case in _region_recompute_cases_under_fsdp2():
        _rebuilds_as_te(case, plan_for(case, caps))


def test_a_delayed_scaling_recompute_pass_under_fsdp2_rebuilds_as_te_does_even_when_building_once():
    """A ``te.checkpoint`` recompute pass quantizes with the first pass's
    delayed-scaling scale; TE's FSDP2 backward rebuilds with the scale of
    backward time. Saving the pass's copy (the D3 option) would change
    dgrad's bytes, so with delayed scaling the plan stays TE's whatever the
    option. Found on GPUs at d7db962: losses left stock's at step 2."""
    build_once = only(RecomputeCopy.BUILD_ONCE)
    for case in _region_recompute_cases_under_fsdp2():
        _rebuilds_as_te(case, plan_for(case, FLOAT8_DELAYED_SCALING, build_once))
        # A format that requantizes exactly builds once and saves, as asked.
        current = plan_for(case, FLOAT8_CURRENT_SCALING, build_once)
        assert current.backward_source is BackwardSource.SAVED_WORKSPACE, case
        assert Usage.COLUMNWISE in current.forward_usage, case


@pytest.mark.parametrize("caps", FORMATS, ids=lambda caps: caps.name)
def test_fsdp2_microbatches_are_quantized_every_time_as_te_does_by_default(caps):
    """D4 is an option, off by default: under FSDP2 nothing is cached and no
    workspace of a high-precision weight is saved, for every microbatch
    position; with the option, a format that requantizes exactly caches."""
    cases = [c for c in ref.ALL_CASES if c.sharding == "fsdp2_keep" and c.recompute == "none" and _hp(c)
             and c.grad_enabled and c.microbatch != "none"]
    assert cases
    for case in cases:
        te, plan = ref.te_decision(case), plan_for(case, caps)
        assert plan.cache.value == te.cache == "bypass", case
        assert not plan.saves_quantized and not te.workspace_saved, case
        cached = plan_for(case, caps, only(MicrobatchCache.EXACT_FORMATS))
        assert (cached.cache is not CacheAction.BYPASS) is caps.requantization_safe, case


def test_a_modules_own_recompute_keeps_its_copy_whatever_the_format():
    """LayerNormMLP(checkpoint=True): TE hands the recompute pass's copies
    straight to backward, so the plan says so for every format, with the
    options on or off."""
    cases = [c for c in ref.ALL_CASES if c.recompute == "recompute" and c.module.startswith("LayerNormMLP")
             and _fsdp2(c) and _hp(c)]
    assert cases
    for case in cases:
        for caps, config in itertools.product(FORMATS, CONFIGS):
            plan = plan_for(case, caps, config)
            assert plan.backward_source is BackwardSource.SAVED_WORKSPACE, (case, caps.name, config)
            te = ref.te_decision(case)  # returned into backward, not saved, and not rebuilt
            assert te.forward_columnwise and not te.backward_rebuild, case
