"""``benchmarks.call_overhead`` on CPU: its module kinds (GroupedLinear with
a number of experts), the argument errors, and the check that the drop-in's
added host time per call does not grow with the experts, on synthetic rows."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import call_overhead as co  # noqa: E402


def row(kind: str, added: float, control: float = 0.1, recipe: str = "Float8CurrentScaling") -> dict:
    return {"kind": kind, "recipe": recipe, "stock_us": 300.0, "added_us": added, "added_us_range": [added, added],
            "control_us": control, "control_us_range": [control, control]}


@pytest.mark.parametrize(("kind", "parsed"), [
    ("Linear", ("Linear", None)), ("LayerNormMLP", ("LayerNormMLP", None)),
    ("GroupedLinear:8", ("GroupedLinear", 8)), ("GroupedLinear:64", ("GroupedLinear", 64)),
])
def test_kinds_name_the_module_and_its_experts(kind, parsed):
    assert co.parse_kind(kind) == parsed


@pytest.mark.parametrize("kind", ["GroupedLinear", "GroupedLinear:0", "GroupedLinear:x", "Linear:8", "Conv"])
def test_bad_kinds_are_refused(kind):
    with pytest.raises(ValueError):
        co.parse_kind(kind)


def test_the_default_kinds_include_grouped_linear_with_8_and_64_experts():
    assert {"GroupedLinear:8", "GroupedLinear:64"} <= set(co.KINDS)


def test_a_bad_kind_is_a_usage_error_before_any_gpu_is_asked(capsys):
    with pytest.raises(SystemExit) as exc:
        co.main(["--kinds", "Linear,GroupedLinear"])
    assert exc.value.code == 2 and "give GroupedLinear its experts" in capsys.readouterr().err


def test_added_time_that_stays_flat_with_the_experts_meets_the_check():
    [check] = co.expert_growth([row("Linear", 2.0), row("GroupedLinear:8", 2.0), row("GroupedLinear:64", 2.4)])
    assert check["experts"] == (8, 64) and check["ok"] and check["ratio"] == pytest.approx(1.2)
    assert check["allowed_us"] == co.GROWTH_US


def test_added_time_per_expert_fails_the_check_and_the_summary_says_so():
    rows = [row("GroupedLinear:8", 2.0), row("GroupedLinear:64", 2.0 + 56 * 0.3)]  # 0.3 us per extra expert
    [check] = co.expert_growth(rows)
    assert not check["ok"] and check["growth_us"] == pytest.approx(16.8)
    text = co.summary(rows)
    assert "ratio 9.40" in text and "MISSED: the added time grows with the experts" in text


def test_a_noisy_control_widens_what_counts_as_growth():
    rows = [row("GroupedLinear:8", 2.0, control=-1.5), row("GroupedLinear:64", 4.5, control=1.5)]
    [check] = co.expert_growth(rows)
    assert check["allowed_us"] == 3.0 and check["ok"]


def test_each_recipe_is_checked_on_its_own_and_one_expert_count_is_not_a_check():
    rows = [row("GroupedLinear:8", 1.0, recipe="DelayedScaling"), row("GroupedLinear:64", 9.0, recipe="DelayedScaling"),
            row("GroupedLinear:8", 1.0), row("Linear", 1.0)]
    [check] = co.expert_growth(rows)
    assert check["recipe"] == "DelayedScaling" and not check["ok"]
    assert co.expert_growth([row("GroupedLinear:8", 1.0)]) == []


def counted(kind: str, calls: float, recipe: str = "Float8CurrentScaling") -> dict:
    return row(kind, 1.0, recipe=recipe) | {"added_calls": calls}


def test_counted_calls_that_stay_flat_with_the_experts_meet_the_call_check():
    [check] = co.call_growth([counted("GroupedLinear:8", 22.0), counted("GroupedLinear:64", 22.0)])
    assert check["ok"] and check["per_expert"] == 0.0 and check["experts"] == (8, 64)


def test_one_counted_call_per_expert_fails_the_call_check_and_the_summary_says_so():
    rows = [counted("GroupedLinear:8", 30.0), counted("GroupedLinear:64", 86.0)]
    [check] = co.call_growth(rows)
    assert not check["ok"] and check["per_expert"] == pytest.approx(1.0)
    assert "+1.00 per extra expert: MISSED: the drop-in adds calls per expert" in co.summary(rows)


def test_rows_without_counted_calls_make_no_call_check():
    assert co.call_growth([row("GroupedLinear:8", 1.0), row("GroupedLinear:64", 1.0)]) == []
