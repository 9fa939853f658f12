"""The step-time benchmark's call-count profile (``benchmarks/_profile.py``),
on plain Python functions: it names the functions a variant adds."""

from __future__ import annotations

from benchmarks import step_time
from benchmarks._profile import added_calls_table, profile_counts


def _leaf() -> int:
    return 1


def _stock() -> int:
    return sum(_leaf() for _ in range(3))


def _wrapped() -> int:
    return _leaf()


def _dropin() -> int:
    return sum(_wrapped() for _ in range(3))


def test_the_table_names_each_added_function_with_its_count():
    stock, _ = profile_counts(_stock)
    dropin, own_s = profile_counts(_dropin)
    assert own_s >= 0
    table = added_calls_table("t", stock, dropin)
    added = {row[0].rsplit(":", 1)[1]: row[3] for row in table["rows"]}
    assert added["_wrapped"] == "+3" and "_leaf" not in added  # _leaf: 3 calls in both
    assert f"added {sum(dropin.values()) - sum(stock.values()):+d}" in table["note"]


def test_function_labels_keep_no_machine_path():
    calls, _ = profile_counts(_stock)
    assert any(label.startswith("tests/unit/") or label.startswith("test_benchmark_profile.py:") for label in calls)
    assert not any(label.startswith("/") for label in calls)


def test_the_summary_gets_one_table_per_profiled_case():
    times = {label: [0.010, 0.011] for label in step_time.ORDER}
    losses = {label: [1.0, 0.5] for label in step_time.ORDER}
    profile = {"stock": {"calls": {"a.py:f": 2}, "own_s": 0.1}, "dropin": {"calls": {"a.py:f": 2, "b.py:g": 4},
                                                                          "own_s": 0.1}}
    samples = [{"case": "c1", "step_time_s": times, "losses": losses, "profile": profile},
               {"case": "c2", "step_time_s": times, "losses": losses}]
    tables = step_time.summarize(samples)["tables"]
    assert len(tables) == 1 and tables[0]["rows"] == [["b.py:g", "0", "4", "+4"]]
