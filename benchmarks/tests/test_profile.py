"""The step-time benchmark's call-count profile (``benchmarks/_profile.py``),
on plain Python functions: it names the functions a variant adds."""

from __future__ import annotations

import pytest

from benchmarks import step_time
from benchmarks._profile import added_calls_table, own_time_table, profile_step


def _leaf() -> int:
    return 1


def _stock() -> int:
    return sum(_leaf() for _ in range(3))


def _wrapped() -> int:
    return _leaf()


def _dropin() -> int:
    return sum(_wrapped() for _ in range(3))


def test_the_table_names_each_added_function_with_its_count():
    stock = profile_step(_stock)["calls"]
    step = profile_step(_dropin)
    dropin = step["calls"]
    assert step["own_s"] >= 0
    table = added_calls_table("t", stock, dropin)
    added = {row[0].rsplit(":", 1)[1]: row[3] for row in table["rows"]}
    assert added["_wrapped"] == "+3" and "_leaf" not in added  # _leaf: 3 calls in both
    assert f"added {sum(dropin.values()) - sum(stock.values()):+d}" in table["note"]


def test_function_labels_keep_no_machine_path():
    calls = profile_step(_stock)["calls"]
    assert any(label.startswith("benchmarks/tests/test_profile.py:") for label in calls)  # from the project root
    assert not any(label.startswith("/") for label in calls)


@pytest.mark.parametrize("file, label", [
    ("/opt/torch/.venv/lib/python3.12/site-packages/torch/nn/modules/module.py", "torch/nn/modules/module.py:f"),
    ("/usr/lib/python3/site-packages/transformer_engine/pytorch/module/base.py",
     "transformer_engine/pytorch/module/base.py:f"),
    ("/home/u/project/te_integration/runtime/_call.py", "te_integration/runtime/_call.py:f"),
])
def test_an_installed_package_is_labelled_from_the_package_on(file, label):
    from benchmarks._profile import _label

    assert _label(file, "f") == label


def test_the_summary_gets_one_table_per_profiled_case():
    times = {label: [0.010, 0.011] for label in step_time.ORDER}
    losses = {label: [1.0, 0.5] for label in step_time.ORDER}
    profile = {"stock": {"calls": {"a.py:f": 2}, "own_s": 0.1}, "dropin": {"calls": {"a.py:f": 2, "b.py:g": 4},
                                                                          "own_s": 0.1}}
    samples = [{"case": "c1", "step_time_s": times, "losses": losses, "profile": profile},
               {"case": "c2", "step_time_s": times, "losses": losses}]
    tables = step_time.summarize(samples)["tables"]
    assert len(tables) == 1 and tables[0]["rows"] == [["b.py:g", "0", "4", "+4"]]


def test_the_own_time_table_lists_every_function_only_the_dropin_runs():
    stock, dropin = profile_step(_stock), profile_step(_dropin)
    assert abs(dropin["own_s"] - sum(dropin["own_by"].values())) < 1e-12
    table = own_time_table("t", stock["own_by"], dropin["own_by"], top=1)
    only = [row[0] for row in table["rows"] if row[0].endswith("(drop-in only)")]
    assert any(":_wrapped" in row[0] for row in table["rows"])  # in the top entry or among the drop-in-only ones
    assert not any(":_leaf (drop-in only)" in name for name in only)  # stock runs _leaf too
    assert "functions stock does not run" in table["note"]


def test_the_summary_adds_the_own_time_table_when_the_profile_has_times():
    times = {label: [0.010, 0.011] for label in step_time.ORDER}
    losses = {label: [1.0, 0.5] for label in step_time.ORDER}
    profile = {"stock": {"calls": {"a.py:f": 2}, "own_by": {"a.py:f": 0.002}, "own_s": 0.002},
               "dropin": {"calls": {"a.py:f": 2, "b.py:g": 4}, "own_by": {"a.py:f": 0.002, "b.py:g": 0.001},
                          "own_s": 0.003}}
    tables = step_time.summarize([{"case": "c", "step_time_s": times, "losses": losses, "profile": profile}])["tables"]
    assert [t["title"].split(":")[0] for t in tables] == ["Where the host time goes", "Own host time per function"]
    assert tables[1]["rows"][0] == ["a.py:f", "2.000", "2.000"] and tables[1]["rows"][1] == ["b.py:g", "0.000", "1.000"]
