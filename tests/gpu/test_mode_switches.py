"""FSDP2 mode switches mid-training: the drop-ins follow them at once.

One torchrun launch (``_mode_switch.py``, at world size = GPUs present, 1 or
2) trains a stock stack and two drop-in stacks (their defaults, and the
microbatch cache option pinned) through phases separated by
``set_reshard_after_forward`` and ``set_reshard_after_backward`` switches;
the tests below read its report, phase by phase, for each drop-in stack.
"""

from __future__ import annotations

import pytest
from _launch import two_rank_report

from conftest import recipe_skip_reason

# TE and torch.distributed warn freely (deprecations, experimental features); the
# GPU tier checks numbers, not their warnings.
pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning",
                                                        "ignore::FutureWarning")]

RECIPES = ["DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling"]
#: The drop-in stacks of the report: the defaults ("managed"), and the
#: microbatch cache option pinned ("managed_cache"; off by default).
DROP_INS = ["managed", "managed_cache"]
#: Recipes whose quantizers requantize exactly: with the microbatch cache
#: option, the drop-ins cache one workspace per weight across a step's
#: microbatches when forward keeps the gathered weight (DelayedScaling does
#: not: docs/decisions.md, D4).
CACHING = {"Float8CurrentScaling", "Float8BlockScaling"}
FWD_KIB_PER_LAYER = 50


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return two_rank_report("_mode_switch.py", tmp_path_factory.mktemp("mode_switch"),
                           keep_env="TE_WM_MODE_SWITCH_REPORT", timeout=600)


@pytest.fixture(params=[(r, d) for r in RECIPES for d in DROP_INS], ids=lambda p: f"{p[0]}-{p[1]}")
def runs(request, report):
    """(recipe, drop-in stack, phases, stock results, drop-in results) of one
    recipe and one drop-in stack."""
    name, drop_in = request.param
    reason = recipe_skip_reason(name) or report["unsupported"].get(name)
    if reason:
        pytest.skip(reason)
    if name not in report["recipes"]:
        pytest.fail(f"no result for {name}; errors: {report['errors']}")
    result = report["recipes"][name]
    assert len(result[drop_in]) == len(result["stock"]) == len(report["phases"])
    return name, drop_in, report["phases"], result["stock"], result[drop_in]


def _expected_sharding(phase: dict) -> str:
    return "fsdp2_reshard" if phase["reshard_after_forward"] else "fsdp2_keep"


def test_world_size_is_reported(report, capsys):
    assert report["world_size"] == report["dist_world_size"] in (1, 2), report["dist_world_size"]
    with capsys.disabled():
        print(f"\ntest_mode_switches: world size {report['world_size']}")


def test_worker_ran_without_errors(report):
    assert not report["errors"], "\n".join(e["where"] + "\n" + e["traceback"] for e in report["errors"])


def test_phases_switch_both_ways(report):
    """The schedule really switches: forward resharding off, on, off and on
    again, and backward resharding held off during accumulation in both."""
    forward = [p["reshard_after_forward"] for p in report["phases"]]
    assert forward[:3] == [False, True, False] and forward[-1] is True, forward
    assert {p["reshard_after_forward"] for p in report["phases"] if p["accumulate"]} == {False, True}


def test_losses_identical_to_stock_in_every_phase(runs, report):
    """Every microbatch's loss equals stock's exactly (float equality)."""
    _, _, phases, stock, managed = runs
    for phase, s, m in zip(phases, stock, managed):
        shape = [len(step) for step in m["losses"]]
        assert shape == [phase["microbatches"]] * report["steps_per_phase"], (phase["name"], shape)
        assert m["losses"] == s["losses"], phase["name"]


def test_planned_sharding_follows_every_switch(runs):
    """After each step, the plans of one layer's drop-ins (every weight of
    its LayerNormLinear, Linear and LayerNormMLP) name the sharding the
    phase set: FSDP2_KEEP or FSDP2_RESHARD, never the one before the switch."""
    _, _, phases, _, managed = runs
    for phase, m in zip(phases, managed):
        want = _expected_sharding(phase)
        want_last = "fsdp2_keep" if phase["last_layer_keeps"] else want
        for key, expected in (("plan_sharding", want), ("plan_sharding_last", want_last)):
            for shardings in m[key]:
                assert len(shardings) == 3, shardings  # the layer's three drop-ins
                got = {value for values in shardings.values() for value in values}
                assert got == {expected}, (phase["name"], key, shardings)


def test_no_workspace_left_after_any_step(runs):
    """``workspace_report`` lists nothing after each optimizer step, nor is
    a drop-in left mid-call. With the microbatch cache option, before the
    step it lists the cache where the plan keeps one (forward keeps the
    weight, in every layer or in the last one only; a caching recipe), so the empty report after it is the release,
    not a report blind to it. Where forward reshards, or with the defaults
    (which cache nothing under FSDP2, as stock TE), there is no workspace
    even before the step."""
    name, drop_in, phases, _, managed = runs
    for phase, m in zip(phases, managed):
        assert m["report_entries_after_step"] == [0] * len(m["losses"]), (phase["name"], m["after_step_tables"])
        assert m["in_flight_after_step"] == [0] * len(m["losses"]), phase["name"]
        before = m["report_entries_before_step"]
        keeps = not phase["reshard_after_forward"] or phase["last_layer_keeps"]  # some layer keeps its weights
        if drop_in == "managed_cache" and keeps and name in CACHING:
            assert all(n > 0 for n in before), (phase["name"], before)
        else:
            assert before == [0] * len(before), (phase["name"], before)


def test_reshard_phases_forward_increment_within_50_kib_of_bf16(runs, report):
    """Where forward reshards, the drop-ins' per-layer forward increment
    stays within bf16's (FP8 off, same phases) + 50 KiB: no workspace
    outlives its layer's forward, also right after a switch."""
    assert report["bf16"] is not None, report["errors"]
    _, _, phases, stock, managed = runs
    measured = 0
    for phase, base, s, m in zip(phases, report["bf16"], stock, managed):
        if not phase["reshard_after_forward"]:
            assert m["fwd_kib_per_layer"] is None
            continue
        measured += 1
        got, bf16 = m["fwd_kib_per_layer"], base["fwd_kib_per_layer"]
        assert got - bf16 <= FWD_KIB_PER_LAYER, (
            f"{phase['name']}: {got:.1f} KiB/layer vs bf16 {bf16:.1f} (stock {s['fwd_kib_per_layer']:.1f})")
    assert measured >= 3, "too few reshard phases measured"
