"""``benchmarks.quantized_gather`` on CPU: the planned configurations and
``--dry-run``, and the summary on synthetic samples: the step-time targets
by microbatch count, the gathered-bytes target, the memory rows, and the
projection table computed from the measured bytes per parameter."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import quantized_gather as qg  # noqa: E402

MIB = 2**20


def timing(case: str, micro: int, recipe: str, stock_ms: float, gather_ms: float, same_losses: bool = True,
           stack: str = "moe") -> dict:
    t = {"stock": [stock_ms / 1e3] * 10, "dropin": [gather_ms / 1e3] * 10, "stock_again": [stock_ms / 1e3] * 10}
    losses = {"stock": [1.0, 0.5], "stock_again": [1.0, 0.5], "dropin": [1.0, 0.5] if same_losses else [1.0, 0.6]}
    return {"section": "timing", "case": case, "spec": {"stack": stack, "layers": 4, "recipe": recipe, "micro": micro},
            "step_time_s": t, "losses": losses}


def gathered(case: str, stock: int, gather: int, params: int = 1000, micro: int = 4, shard: int = 1000) -> dict:
    return {"section": "bytes", "case": case, "gathered_bytes": {"stock": stock, "dropin": gather},
            "parameters": params, "gathers": 2 * micro, "shard_bytes": shard, "world_size": 1}


def memory(case: str, variant: str, peak: float, after: float) -> dict:
    return {"section": "memory", "case": case, "variant": variant, "peak_over_start_mib": peak,
            "after_step_mib": after}


def row(rows: list[dict], case: str, metric: str) -> dict:
    (found,) = [r for r in rows if r["case"] == case and r["metric"] == metric]
    return found


def test_the_plan_covers_every_stack_recipe_and_microbatch_count():
    args = qg.parse(["--stacks", "moe,dense", "--recipes", "Float8CurrentScaling,DelayedScaling",
                     "--microbatches", "1,4"])
    jobs = qg.plan(args, None, 1, 141.0)
    timed = [j.label for j in jobs if j.meta["section"] == "timing"]
    assert len(timed) == 2 * 2 * 2 and "[timing] dense 4L DelayedScaling x4" in timed
    assert len([j for j in jobs if j.meta["section"] == "memory"]) == 3 * len(timed)


def test_dry_run_needs_neither_cuda_nor_te():
    out = subprocess.run([sys.executable, "-m", "benchmarks.quantized_gather", "--dry-run", "--quick"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    assert "[timing] moe 2L Float8CurrentScaling x4" in out and "configuration(s)" in out


@pytest.mark.parametrize("micro, gather_ms, met", [(4, 96.0, True), (4, 98.0, False), (1, 100.0, True),
                                                   (1, 101.0, False)])
def test_the_step_time_target_depends_on_the_microbatches(micro, gather_ms, met):
    """0.97 of stock with 4 microbatches, 1.00 with one."""
    case = f"moe 4L Float8CurrentScaling x{micro}"
    rows = qg.summarize([timing(case, micro, "Float8CurrentScaling", 100.0, gather_ms)])["rows"]
    assert row(rows, case, "median step time")["ok"] is met
    assert row(rows, case, "losses identical (gather / stock)")["ok"] is True


def test_losses_are_compared_except_under_delayed_scaling():
    case = "moe 4L DelayedScaling x4"
    rows = qg.summarize([timing(case, 4, "DelayedScaling", 100.0, 96.0, same_losses=False)])["rows"]
    assert not [r for r in rows if r["metric"] == "losses identical (gather / stock)"]
    case = "moe 4L Float8BlockScaling x4"
    rows = qg.summarize([timing(case, 4, "Float8BlockScaling", 100.0, 96.0, same_losses=False)])["rows"]
    assert row(rows, case, "losses identical (gather / stock)")["ok"] is False


@pytest.mark.parametrize("deterministic, met", [(None, None), ("1", None), ("0", False)])
def test_the_dense_stack_s_losses_are_a_target_only_with_deterministic_kernels(monkeypatch, deterministic, met):
    """Without NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 two stock dense models may
    differ: the loss rows are reported with no target; with it, a difference is a miss."""
    if deterministic is None:
        monkeypatch.delenv(qg.DETERMINISTIC_ENV, raising=False)
    else:
        monkeypatch.setenv(qg.DETERMINISTIC_ENV, deterministic)
    case = "dense 4L Float8CurrentScaling x4"
    rows = qg.summarize([timing(case, 4, "Float8CurrentScaling", 100.0, 96.0, same_losses=False, stack="dense")])["rows"]
    found = row(rows, case, "losses identical (gather / stock)")
    assert found["ok"] is met
    assert (qg.DETERMINISTIC_ENV in found["note"]) is (met is None)


@pytest.mark.parametrize("gather_bytes, met", [(8_480, True), (8_490, False)])
def test_the_gathered_bytes_target_is_053_of_stock(gather_bytes, met):
    case = "moe 4L Float8CurrentScaling x4"
    rows = qg.summarize([gathered(case, 16_000, gather_bytes)])["rows"]
    assert row(rows, case, "bytes all-gathered per step")["ok"] is met


def test_memory_rows_hold_the_peak_to_stock_s_and_report_held_memory_against_bf16():
    case = "dense 4L Float8CurrentScaling x4"
    samples = [memory(case, "bf16", 900.0, 5000.0), memory(case, "stock", 1000.0, 5000.0),
               memory(case, "dropin", 990.0, 5400.0)]
    rows = qg.summarize(samples)["rows"]
    peak = row(rows, case, "peak over the step's start")
    held = row(rows, case, "held between steps (over before build)")
    assert peak["ok"] is True and peak["bf16"] == 900.0
    assert held["ok"] is None and held["bf16"] == 5000.0 and held["dropin"] == 5400.0
    rows = qg.summarize([*samples[:2], memory(case, "dropin", 1001.0, 5400.0)])["rows"]
    assert row(rows, case, "peak over the step's start")["ok"] is False


def test_the_projection_is_computed_from_the_measured_bytes_per_parameter():
    """Per parameter: stock gathers 2 bytes, the gather 1, the shard holds 1;
    the 70B row at world 8: bf16 shard 2 * 70.6e9 / 8 bytes, quantized
    shard half of that, 4 microbatches x 2 gathers of the whole model."""
    sample = gathered("moe 4L Float8CurrentScaling x4", stock=2 * 1000 * 8, gather=1000 * 8)
    (table,) = qg.summarize([sample])["tables"]
    assert "Computed, not measured" in table["note"]
    first = dict(zip(table["columns"], table["rows"][0]))
    gib = 2**30
    assert first["world"] == 8
    assert first["bf16 shard GiB"] == f"{2 * 70.6e9 / 8 / gib:.1f}"
    assert first["quantized shard GiB (gather)"] == f"{70.6e9 / 8 / gib:.2f}"
    assert first["all-gathered GiB per step, stock"] == f"{2 * 70.6e9 * 8 / gib:.0f}"
    assert first["all-gathered GiB per step, gather"] == f"{70.6e9 * 8 / gib:.0f}"
    assert len(table["rows"]) == len(qg.PROJECTED) * len(qg.PROJECTED_WORLDS)


def test_no_projection_without_a_measured_shard():
    sample = gathered("moe 4L DelayedScaling x4", stock=16_000, gather=16_000, shard=0)
    assert qg.summarize([sample])["tables"] == []


def test_a_profiled_step_gives_its_counts_and_what_differs_most():
    """``--sections profile``: kernels, launches, GPU busy time and Python
    calls per step, with the kernels and functions that differ most."""
    def counts(kernels: int, calls: dict) -> dict:
        return {"kernels": kernels, "launch_calls": kernels, "busy_ms": 10.0, "python_calls": sum(calls.values()),
                "by_kernel": {"gemm": kernels}, "busy_by": {"gemm": 10.0}, "calls": calls}

    case = "moe 4L Float8CurrentScaling x4"
    sample = {"section": "timing", "case": case, "spec": {"micro": 4, "recipe": "Float8CurrentScaling"},
              "profile": {"stock": counts(100, {"te:quantize": 8}), "dropin": counts(120, {"ours:refill": 64})}}
    result = qg.summarize([sample])
    kernels = row(result["rows"], case, "CUDA kernels per step")
    assert (kernels["stock"], kernels["dropin"], kernels["ok"]) == (100, 120, False)
    calls = [t for t in result["tables"] if "Python-level calls" in t["title"]]
    assert calls and calls[0]["rows"][0][0] == "ours:refill"


def test_fp8_parameters_are_timed_on_the_moe_stack_only_and_reported_without_a_target():
    args = qg.parse(["--stacks", "moe,dense", "--recipes", "Float8CurrentScaling", "--microbatches", "4",
                     "--sections", "timing,fp8_params"])
    labels = [j.label for j in qg.plan(args, None, 1, 141.0) if j.meta["section"] == "fp8_params"]
    assert labels == ["[fp8_params] moe 4L Float8CurrentScaling x4"]
    t = {"stock": [0.100] * 10, "stock_fp8_params": [0.130] * 10, "stock_again": [0.101] * 10}
    sample = {"section": "fp8_params", "case": "moe 4L Float8CurrentScaling x4", "step_time_s": t}
    rows = qg.summarize([sample])["rows"]
    case = "moe 4L Float8CurrentScaling x4 FusedAdam"
    fp8 = row(rows, case, "median step time, stock FP8 parameters / stock bf16 parameters")
    assert fp8["ratio"] == pytest.approx(1.3) and fp8["ok"] is None and fp8["target"] == ""
    assert row(rows, case, "median step time, control: stock again / stock")["ratio"] == pytest.approx(1.01)


def test_fp8_parameters_that_te_fails_to_train_are_reported_with_te_s_error():
    sample = {"section": "fp8_params", "case": "moe 2L Float8BlockScaling x4", "te_failed": "ValueError: boom"}
    (only,) = qg.summarize([sample])["rows"]
    assert only["ratio"] is None and only["ok"] is None and "ValueError: boom" in only["note"]
