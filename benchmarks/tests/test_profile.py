"""The profiles of ``benchmarks/_profile.py`` on CPU: the call counts of
plain Python functions (the table names the functions a variant adds), the
labels, and the kernel count of stand-in profiler events."""

from __future__ import annotations

import pytest

from benchmarks import step_time
from benchmarks._profile import count_kernels, differences_table, profile_step


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
    table = differences_table("t", stock, dropin, what="Python-level calls")
    added = {row[0].rsplit(":", 1)[1]: row[3] for row in table["rows"]}
    assert added["_wrapped"] == "+3" and "_leaf" not in added  # _leaf: 3 calls in both
    assert f"added {sum(dropin.values()) - sum(stock.values()):+d}" in table["note"]


def test_a_table_of_times_keeps_its_decimals_and_sorts_by_the_largest_difference():
    table = differences_table("t", {"gemm": 90.0, "cast": 4.0}, {"gemm": 90.5, "cat": 6.0, "multi": 3.0},
                              what="GPU busy ms", digits=2, top=3)
    assert table["rows"] == [["cat", "0.00", "6.00", "+6.00"], ["cast", "4.00", "0.00", "-4.00"],
                             ["multi", "0.00", "3.00", "+3.00"]]
    assert "added +5.50; the 3 largest" in table["note"]


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


def test_the_step_time_summary_gets_one_table_per_profiled_case():
    times = {label: [0.010, 0.011] for label in step_time.ORDER}
    losses = {label: [1.0, 0.5] for label in step_time.ORDER}
    profile = {"stock": {"calls": {"a.py:f": 2}}, "dropin": {"calls": {"a.py:f": 2, "b.py:g": 4}}}
    samples = [{"case": "c1", "step_time_s": times, "losses": losses, "profile": profile},
               {"case": "c2", "step_time_s": times, "losses": losses}]
    tables = step_time.summarize(samples)["tables"]
    assert len(tables) == 1 and tables[0]["rows"] == [["b.py:g", "0", "4", "+4"]]


def _event(name: str, device: str, us: float = 0.0, annotation: bool = False):
    from types import SimpleNamespace

    import torch

    kind = torch.autograd.DeviceType.CUDA if device == "cuda" else torch.autograd.DeviceType.CPU
    return SimpleNamespace(name=name, device_type=kind, is_user_annotation=annotation,
                           time_range=SimpleNamespace(elapsed_us=lambda: us))


def test_annotated_ranges_on_the_gpu_timeline_are_not_kernels():
    events = [_event("FSDP::pre_forward (0)", "cpu", annotation=True),
              _event("FSDP::pre_forward (0)", "cuda", us=8000.0),  # the range's mirror, spanning the kernels
              _event("Optimizer.step#FusedAdam.step", "cuda", us=3000.0, annotation=True),
              _event("cast_transpose", "cuda", us=100.0), _event("gemm", "cuda", us=400.0),
              _event("gemm", "cuda", us=500.0), _event("Memcpy HtoD", "cuda", us=50.0),
              _event("cudaLaunchKernel", "cpu"), _event("cudaLaunchKernel", "cpu")]
    counted = count_kernels(events)
    assert counted["by_kernel"] == {"cast_transpose": 1, "gemm": 2}
    assert counted["kernels"] == 3 and counted["launch_calls"] == 2
    assert counted["busy_by"] == {"cast_transpose": 0.1, "gemm": 0.9} and counted["busy_ms"] == 1.0
