"""``benchmarks.moe_memory`` on CPU: its arguments, the planned
configurations, ``--dry-run`` and the launch message, and the summary's
targets on synthetic figures (the issue's stock numbers, a drop-in that
meets every target, and drop-ins that miss each one)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import _harness as h  # noqa: E402
from benchmarks import moe_memory  # noqa: E402
from benchmarks import moe_memory as summary  # noqa: E402
from benchmarks.moe_memory import SHAPES, ExpertSpec, estimate_seconds  # noqa: E402

#: Per-block forward rise, held, peak over start, after backward, after step (MiB): the
#: issue's stock TE 2.20.2 figures for the e8 stack under FSDP2 and what a fixed drop-in holds.
BF16 = dict(fwd_rise_mib_per_block=16.0, held_mib=112.0, peak_over_start_mib=672.0, after_bwd_mib=520.0,
            after_step_mib=2000.0)
STOCK = dict(fwd_rise_mib_per_block=72.0, held_mib=576.0, peak_over_start_mib=808.0, after_bwd_mib=560.0,
             after_step_mib=2384.0)
FIXED = dict(fwd_rise_mib_per_block=8.0, held_mib=56.0, peak_over_start_mib=640.0, after_bwd_mib=515.0,
             after_step_mib=2000.5)


def fake(job, figures: dict | None = None, losses=(1.0, 0.5)) -> dict:
    spec: ExpertSpec = job.spec
    if job.meta["section"] == "timing":
        t = {"stock": [0.020] * 10, "dropin": [0.021] * 10, "stock_again": [0.0201] * 10}
        return {**job.meta, "step_time_s": t, "losses": {k: list(losses) for k in t}}
    held = {"bf16": BF16, "stock": STOCK, "dropin": FIXED, "lean": {**FIXED, "held_mib": 40.0}}[spec.variant]
    values = {**held, **(figures or {})}
    if not spec.sharded and spec.variant == "dropin" and "held_mib" not in (figures or {}):
        values["held_mib"] = STOCK["held_mib"] - spec.shape.params / h.MIB  # D11: exactly 1 B/param less
    quantizations = {"bf16": 0, "stock": 8, "dropin": 16, "lean": 16}[spec.variant]
    probes = [{**values, "leftover_workspaces": 0, "quantizations": quantizations}]
    return {**job.meta, **values, "probes": probes, "losses": list(losses), "spec": spec.as_dict(),
            "quantizations": float(quantizations), "quantizations_per_step": [quantizations]}


def samples_for(argv=("--quick",), change=None) -> list[dict]:
    """Fake samples of every planned job; ``change(job) -> figures`` alters the drop-in's."""
    args = moe_memory.parse(list(argv))
    out = []
    for job in moe_memory.plan(args, None, 1, 141.0):
        extra = change(job) if change and job.spec.variant == "dropin" and job.meta["section"] != "timing" else None
        out.append(fake(job, extra))
    return out


def rows_by(rows, metric_part: str) -> list[dict]:
    return [r for r in rows if metric_part in r["metric"]]


# -- arguments and plan ------------------------------------------------------------------
def test_quick_and_full_defaults():
    quick, full = moe_memory.parse(["--quick"]), moe_memory.parse([])
    assert quick.blocks == 2 and quick.recipes == ["Float8CurrentScaling"] and quick.tag == "quick"
    assert full.blocks is None and full.recipes == list(moe_memory.RECIPES) and full.microbatches == [1, 4]
    assert full.stacks == ["e8", "e64"] and full.sections == ["fsdp2", "unsharded", "timing"]
    assert moe_memory.parse(["--stacks", "e64", "--blocks", "3"]).stacks == ["e64"]


@pytest.mark.parametrize(("argv", "message"), [
    (["--stacks", "e9"], "expected a comma-separated list"),
    (["--microbatches", "0"], "positive integer"),
    (["--recipes", "FP4"], "expected a comma-separated list"),
    (["--layout", "packed"], "invalid choice"),
])
def test_bad_arguments_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        moe_memory.parse(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_the_stacks_are_the_issues_and_a_many_expert_one():
    e8, e64 = SHAPES["e8"], SHAPES["e64"]
    assert e8.params // e8.blocks == 33_554_432 and (e8.experts, e8.hidden, e8.tokens) == (8, 2048, 4096)
    assert e64.experts == 64 and e64.tokens // e64.experts % 16 == 0  # TE's sm_90 FP8 split alignment


def test_the_plan_has_bf16_stock_and_drop_in_per_recipe_and_microbatch_and_lean_unsharded_only():
    args = moe_memory.parse(["--recipes", "DelayedScaling,Float8BlockScaling", "--stacks", "e8"])
    jobs = moe_memory.plan(args, None, 2, 141.0)
    fsdp2 = [(j.spec.micro, j.spec.recipe, j.spec.variant) for j in jobs if j.meta["section"] == "fsdp2"]
    assert fsdp2 == [(m, r, v) for m in (1, 4) for r, v in [("bf16", "bf16"), ("DelayedScaling", "stock"),
                                                            ("DelayedScaling", "dropin"),
                                                            ("Float8BlockScaling", "dropin"),
                                                            ("Float8BlockScaling", "stock")]]
    unsharded = [j.spec for j in jobs if j.meta["section"] == "unsharded"]
    assert {s.variant for s in unsharded} == {"bf16", "stock", "dropin", "lean"}
    assert all(not s.sharded and s.micro == 1 for s in unsharded)
    assert all(j.spec.sharded for j in jobs if j.spec.variant != "lean" and j.meta["section"] != "unsharded")
    timing = [j for j in jobs if j.meta["section"] == "timing"]
    assert [(j.spec.recipe, j.spec.micro) for j in timing] == [("DelayedScaling", 1), ("DelayedScaling", 4),
                                                               ("Float8BlockScaling", 1), ("Float8BlockScaling", 4)]
    assert all(j.estimate_s > 0 for j in jobs)


def test_the_single_weight_layout_reaches_every_spec():
    args = moe_memory.parse(["--quick", "--layout", "single"])
    assert all(j.spec.single_weight for j in moe_memory.plan(args, None, 1, 141.0))


def test_estimates_grow_with_experts_and_microbatches():
    e8, e64 = ExpertSpec(SHAPES["e8"]), ExpertSpec(SHAPES["e64"])
    assert estimate_seconds(e64, 5) > estimate_seconds(e8, 5)
    assert estimate_seconds(ExpertSpec(SHAPES["e8"], micro=4), 5) > estimate_seconds(e8, 5)
    assert estimate_seconds(e8, 5, models=3) == pytest.approx(3 * estimate_seconds(e8, 5))


def test_dry_run_and_help_need_neither_cuda_nor_te():
    code = ("import sys; from benchmarks import moe_memory; rc = moe_memory.main(['--dry-run', '--quick']); "
            "assert 'transformer_engine' not in sys.modules and 'te_integration' not in sys.modules; sys.exit(rc)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "[fsdp2] e8 2B FSDP2 Float8CurrentScaling x4 dropin" in done.stdout and "24 configuration(s)" in done.stdout
    helped = subprocess.run([sys.executable, "-m", "benchmarks.moe_memory", "--help"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert helped.returncode == 0 and "--dry-run" in helped.stdout


def test_without_torchrun_it_says_how_to_launch(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(SystemExit) as exc:
        moe_memory.main(["--quick"])
    assert "torchrun --nproc_per_node=2 -m benchmarks.moe_memory --quick" in str(exc.value)


# -- the summary's targets -------------------------------------------------------------------
def test_a_drop_in_that_holds_what_bf16_holds_meets_every_target():
    rows = summary.summarize(samples_for())["rows"]
    missed = [h.explain_miss(r) for r in rows if r["ok"] is False]
    assert not missed, missed
    judged = {r["metric"] for r in rows if r["ok"] is not None}
    [quantized] = [r for r in rows_by(rows, "weight quantizations") if r["case"] == "e8 2B FSDP2 Float8CurrentScaling"]
    assert (quantized["stock"], quantized["dropin"], quantized["ratio"]) == (8, 16, 2.0)  # backward requantizes
    assert {"forward rise per block", "forward-held (after fwd - before)", "peak over the step's start",
            "after step (over before build)", "forward-held, drop-in (D11)", "forward-held, lean",
            "losses identical to stock"} <= judged


def test_stocks_own_figures_as_the_drop_in_miss_the_fsdp2_targets():
    rows = summary.summarize(samples_for(change=lambda job: STOCK if job.spec.sharded else None))["rows"]
    missed = {(r["case"], r["metric"]) for r in rows if r["ok"] is False}
    for case in ("e8 2B FSDP2 Float8CurrentScaling", "e8 2B FSDP2 Float8CurrentScaling x4 microbatches"):
        assert {(case, "forward rise per block"), (case, "forward-held (after fwd - before)"),
                (case, "peak over the step's start")} <= missed
    assert ("e8 2B FSDP2 Float8CurrentScaling x4 microbatches", "after step (over before build)") in missed
    one = "e8 2B FSDP2 Float8CurrentScaling"
    assert (one, "after step (over before build)") not in missed  # 1 microbatch: no target
    [row] = [r for r in rows if r["case"] == one and r["metric"] == "forward rise per block"]
    assert (row["dropin"], row["bf16"], row["stock"], row["ratio"]) == (72.0, 16.0, 72.0, 1.0)
    assert "drop-in/bf16 4.5000" in row["note"]


def test_the_bf16_bound_allows_only_the_stated_slack():
    over = summary.BF16_SLACK_MIB + 0.01
    rows = summary.summarize(samples_for(change=lambda job: {"held_mib": BF16["held_mib"] + over}
                                         if job.spec.sharded else None))["rows"]
    held = [r for r in rows_by(rows, "forward-held (after fwd") if r["ok"] is not None]
    assert held and all(r["ok"] is False for r in held)


def test_the_unsharded_drop_in_must_hold_one_byte_per_expert_parameter_less_than_stock():
    short = lambda job: {"held_mib": STOCK["held_mib"] - 0.5 * job.spec.shape.params / h.MIB}  # noqa: E731
    rows = summary.summarize(samples_for(change=lambda job: None if job.spec.sharded else short(job)))["rows"]
    d11 = rows_by(rows, "forward-held, drop-in (D11)")
    assert len(d11) == 2 and all(r["ok"] is False for r in d11)
    assert all(r["target"].startswith("<= stock - 1 B/expert param") for r in d11)


def test_lean_must_hold_strictly_less_than_bf16_and_delayed_scaling_losses_are_reported_only():
    args = ["--recipes", "DelayedScaling,Float8CurrentScaling", "--stacks", "e8", "--sections", "unsharded"]
    samples = samples_for(args)
    for s in samples:
        if s["variant"] == "lean":
            s["held_mib"] = BF16["held_mib"]  # equal is not less
            s["losses"] = [1.0, 0.25]
    rows = summary.summarize(samples)["rows"]
    assert all(r["ok"] is False for r in rows_by(rows, "forward-held, lean"))
    lean_losses = {r["case"]: r for r in rows_by(rows, "losses identical to stock, lean")}
    assert lean_losses["e8 8B unsharded DelayedScaling"]["ok"] is None
    assert "does not quantize again exactly" in lean_losses["e8 8B unsharded DelayedScaling"]["note"]
    assert lean_losses["e8 8B unsharded Float8CurrentScaling"]["ok"] is False


def test_losses_that_differ_from_stock_are_a_miss_where_requantizing_is_exact():
    argv = ["--quick", "--sections", "fsdp2,unsharded", "--stacks", "e8", "--recipes",
            "DelayedScaling,Float8BlockScaling"]
    samples = samples_for(argv)
    for s in samples:
        if s["variant"] == "dropin":
            s["losses"] = [1.0, 0.5000001]
    rows = [r for r in summary.summarize(samples)["rows"] if r["metric"] == "losses identical to stock"]
    verdicts = {r["case"]: r["ok"] for r in rows}
    assert verdicts == {"e8 2B FSDP2 DelayedScaling": None, "e8 2B FSDP2 DelayedScaling x4 microbatches": None,
                        "e8 2B FSDP2 Float8BlockScaling": False,
                        "e8 2B FSDP2 Float8BlockScaling x4 microbatches": False,
                        # unsharded, the drop-in keeps stock's bytes (D11): a target in every recipe
                        "e8 2B unsharded DelayedScaling": False, "e8 2B unsharded Float8BlockScaling": False}


def test_step_time_is_reported_beside_the_control_without_a_target():
    rows = summary.summarize(samples_for(["--quick", "--sections", "timing"]))["rows"]
    times = rows_by(rows, "median step time")
    assert len(times) == 8 and all(r["ok"] is None for r in times)
    assert all("price" in r["note"] for r in times if "control" not in r["metric"])
    assert [round(r["ratio"], 3) for r in times if "control" in r["metric"]] == [1.005] * 4


def test_the_markdown_gives_each_figure_against_stock_and_bf16(tmp_path):
    args = moe_memory.parse(["--quick"])
    result = h.new_result("moe_memory", h.config_of(args))
    result["samples"] = samples_for()
    result.update(summary.summarize(result["samples"]))
    _, md = h.write_result(result, tmp_path, args.tag)
    text = md.read_text()
    assert "Targets met:" in text
    [line] = [ln for ln in text.splitlines()
              if ln.startswith("| e8 2B FSDP2 Float8CurrentScaling | forward rise per block (MiB)")]
    assert "| 72 | 8 | 16 | 0.1111 |" in line and "drop-in/bf16 0.5000" in line  # stock, drop-in, bf16


def test_the_recorded_command_is_a_torchrun_one_at_world_size_one(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(sys, "argv", ["moe_memory", "--stacks", "e8"])
    assert h.command_line("moe_memory") == "torchrun --nproc_per_node=1 -m benchmarks.moe_memory --stacks e8"
    monkeypatch.delenv("LOCAL_RANK")
    assert h.command_line("moe_memory").startswith("python3 -m benchmarks.moe_memory")


def test_after_the_step_the_drop_ins_own_recipe_state_is_allowed_on_top_of_bf16():
    state = 10.0  # MiB of amax histories, as a 64-expert stack under delayed scaling has
    argv = ["--quick", "--sections", "fsdp2", "--stacks", "e64"]
    samples = samples_for(argv, change=lambda job: {"after_step_mib": BF16["after_step_mib"] + state + 0.5,
                                                   "quantizer_state_mib": state})
    [row] = [r for r in summary.summarize(samples)["rows"] if r["metric"] == "after step (over before build)"
             and r["ok"] is not None]
    assert row["ok"] and "recipe state 10.00" in row["target"]
    samples = samples_for(argv, change=lambda job: {"after_step_mib": BF16["after_step_mib"] + state + 0.5})
    [row] = [r for r in summary.summarize(samples)["rows"] if r["metric"] == "after step (over before build)"
             and r["ok"] is not None]
    assert row["ok"] is False  # without recipe state to show for it, 10 MiB more is a copy kept


def test_recipe_state_counts_each_storage_of_every_modules_fp8_meta_once():
    import torch

    from benchmarks._stack import quantizer_state_bytes

    class State:
        def __init__(self, history):
            self.amax_history, self.scale, self.view = history, torch.ones(4), history[0]

    shared = torch.zeros(16, 4)
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    a.fp8_meta = {"scaling_fwd": State(shared), "recipe": object(), "fp8_checkpoint": False}
    b.fp8_meta = {"scaling_fwd": State(shared), "scaling_bwd": State(torch.zeros(16, 2))}
    model = torch.nn.Sequential(a, b)
    assert quantizer_state_bytes(model) == 4 * (16 * 4 + 4 + 4 + 16 * 2 + 4)
    assert quantizer_state_bytes(torch.nn.Sequential(torch.nn.Linear(2, 2))) == 0
