"""The benchmark harness on CPU: arguments, planning, summaries with their
targets, JSON and Markdown output, plotting, and the CPU benchmark end to end.

The GPU benchmarks themselves run on two CUDA GPUs with TE; here their pure
parts (argument parsing, the planned configurations, the summary of raw
samples) run on synthetic figures.
"""

from __future__ import annotations

import io
import json
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import _harness as h  # noqa: E402
from benchmarks import fsdp2_memory, microbatch, plot, recompute, run_all, step_time  # noqa: E402
from benchmarks._stack import SIZES, auto_layers  # noqa: E402

try:
    import matplotlib  # noqa: F401

    HAVE_MATPLOTLIB = True
except ImportError:
    HAVE_MATPLOTLIB = False


# -- synthetic figures -------------------------------------------------------------
def fake_measure(job, rnd: random.Random, *, peak_extra: float = 0.0, slow: float = 1.0) -> dict:
    """What ``_stack.measure`` returns, with made-up but plausible figures."""
    spec = job.spec
    dropin = spec.variant == "dropin"
    return {**job.meta, "spec": spec.as_dict(), "variant": spec.variant,
            "peak_mib": 50.0 + 3 * spec.layers + (peak_extra if dropin else 0.0),
            "after_step_mib": 40.0 + 2 * spec.layers,
            "fwd_kib_per_layer": 516.5 if spec.variant == "bf16" else 454.5,
            "bwd_mib": 2.5, "kept_after_bwd_mib": 6.0,
            "step_time_s": [0.030 * (slow if dropin else 1.0) + 1e-4 * rnd.random() for _ in range(10)],
            "losses": [1.0, 0.5, 0.25], "quantizations_per_step": [8 if dropin else 32],
            "cached_workspaces_after_step": [0], "weight_numel": 2**20}


def fsdp2_samples(**kw) -> tuple[object, list[dict]]:
    args = fsdp2_memory.parse(["--quick"])
    rnd = random.Random(0)
    return args, [fake_measure(job, rnd, **kw) for job in fsdp2_memory.plan(args, None, 2, 141.0)]


def result_with(name: str, args, summary: dict, samples: list[dict]) -> dict:
    result = h.new_result(name, h.config_of(args))
    result["samples"] = samples
    result.update(summary)
    result["wall_s"] = 1.0
    return result


# -- arguments -----------------------------------------------------------------------
def test_quick_and_full_defaults_and_overrides():
    quick = fsdp2_memory.parse(["--quick"])
    assert quick.sizes == ["leak"] and quick.steps == 3 and quick.tag == "quick"
    assert quick.recipes == list(h.RECIPES) and quick.inits == ["bf16", "qinit"]
    full = fsdp2_memory.parse([])
    assert full.sizes == ["leak", "realistic"] and full.steps >= 10 and full.depths == [2, 4, 8, 16]
    assert full.out == h.RESULTS / "fsdp2_memory" and full.tag == ""
    mine = fsdp2_memory.parse(["--quick", "--recipes", "Float8CurrentScaling", "--steps", "12", "--out", "/tmp/x"])
    assert mine.recipes == ["Float8CurrentScaling"] and mine.steps == 12 and mine.out == Path("/tmp/x")
    assert microbatch.parse([]).microbatches == [4, 8]
    assert recompute.parse(["--quick"]).modes == ["nonreentrant"]


@pytest.mark.parametrize("argv, message", [
    (["--recipes", "MXFP8BlockScaling"], "expected a comma-separated list of DelayedScaling"),
    (["--steps", "0"], "expected a positive integer"),
    (["--depths", "2,x"], "expected a positive integer"),
    (["--warmup", "-1"], "--warmup must be >= 0"),
])
def test_bad_arguments_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        fsdp2_memory.parse(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("module", [fsdp2_memory, microbatch, recompute, step_time])
def test_gpu_benchmark_without_torchrun_says_how_to_launch(module, monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as info:
        module.main(["--quick"])
    name = module.__name__.split(".")[-1]
    assert f"torchrun --nproc_per_node=2 -m benchmarks.{name} --quick" in str(info.value.code)
    assert "pip install -e '.[te,test,bench]'" in str(info.value.code)


# -- planning (pure) -------------------------------------------------------------------
def test_fsdp2_plan_covers_every_recipe_init_and_variant():
    args = fsdp2_memory.parse([])
    jobs = fsdp2_memory.plan(args, None, 2, 141.0)
    sizes = [j for j in jobs if j.meta["section"] == "sizes"]
    # per size: bf16 + 3 recipes x 2 inits x {stock, drop-in}
    assert len(sizes) == 2 * (1 + 3 * 2 * 2)
    realistic = {j.spec.layers for j in sizes if j.spec.size.name == "realistic"}
    assert realistic == {auto_layers(SIZES["realistic"], 2, 100.0, 141.0, 64)}
    pairs = {}
    for j in sizes:
        pairs.setdefault(j.meta["case"], []).append(j.spec.variant)
    assert all(sorted(v) in (["dropin", "stock"], ["bf16"]) for v in pairs.values())
    firsts = [v[0] for v in pairs.values() if len(v) == 2]
    assert "stock" in firsts and "dropin" in firsts  # the order alternates
    depth = [j for j in jobs if j.meta["section"] == "depth"]
    assert {j.spec.layers for j in depth} == {2, 4, 16}  # 8 layers is already a sizes case
    assert all(not j.spec.quantized_init for j in depth)
    assert sum(j.estimate_s for j in jobs) < 400


def test_auto_layers_fills_the_budget_with_margin():
    big = auto_layers(SIZES["realistic"], 2, 100.0, 141.0, 64)
    assert 20 <= big <= 64
    assert auto_layers(SIZES["realistic"], 2, 100.0, 40.0, 64) < big  # at most 80% of a smaller GPU
    assert auto_layers(SIZES["realistic"], 2, 100.0, 141.0, 8) == 8
    assert auto_layers(SIZES["realistic"], 2, 1.0, 141.0, 64) == 1


def test_other_plans():
    mb = microbatch.plan(microbatch.parse(["--quick"]), None, 2, 141.0)
    assert {j.meta["microbatches"] for j in mb} == {4, 8}
    assert all(not j.spec.reshard_after_forward and j.spec.variant != "bf16" for j in mb)
    # The microbatch benchmark measures the cache, an option off by default: pinned on the drop-ins only.
    assert {(j.spec.variant, j.spec.policy) for j in mb} == {("stock", None), ("dropin", "fsdp2_microbatch_cache")}
    rc = recompute.plan(recompute.parse([]), None, 2, 141.0)
    assert {j.spec.checkpoint for j in rc} == {"nonreentrant", "reentrant"}
    assert sum(j.spec.variant == "bf16" for j in rc) == 4  # per mode x size
    assert {j.spec.policy for j in rc} == {None}  # the drop-ins' defaults unless asked
    once = recompute.plan(recompute.parse(["--policy", "fsdp2_recompute_build_once"]), None, 2, 141.0)
    assert {j.spec.policy for j in once if j.spec.variant == "dropin"} == {"fsdp2_recompute_build_once"}
    assert {j.spec.policy for j in once if j.spec.variant != "dropin"} == {None}
    assert all(j.meta["case"].endswith("policy fsdp2_recompute_build_once") for j in once if j.spec.variant != "bf16")


# -- summaries and targets -----------------------------------------------------------
_JUDGED = {"peak allocated over baseline", "allocated after step over baseline", "forward increment per layer",
           "losses identical to stock"}


def _assert_every_target_judged_and_met(rows: list[dict]) -> None:
    """Every row with a target is judged and passes; a summary that judged
    nothing (every ok None) fails."""
    judged = [r for r in rows if r["ok"] is not None]
    assert _JUDGED <= {r["metric"] for r in judged}, "a row with a target was not judged"
    assert all((r["ok"] is None) == (not r["target"]) for r in rows), "ok is set exactly on rows with a target"
    assert all(r["ok"] is True for r in judged), [r["metric"] for r in judged if r["ok"] is not True]


def test_the_target_check_fails_when_nothing_is_judged_or_a_target_is_missed():
    args, samples = fsdp2_samples()
    rows = fsdp2_memory.summarize(samples, args)["rows"]
    unjudged = [{**r, "ok": None} for r in rows]
    with pytest.raises(AssertionError, match="was not judged"):
        _assert_every_target_judged_and_met(unjudged)
    missed = [{**r, "ok": False} if r["metric"] == "peak allocated over baseline" else r for r in rows]
    with pytest.raises(AssertionError, match="peak allocated over baseline"):
        _assert_every_target_judged_and_met(missed)


def test_fsdp2_summary_checks_every_target():
    args, samples = fsdp2_samples()
    summary = fsdp2_memory.summarize(samples, args)
    rows = summary["rows"]
    metrics = {r["metric"] for r in rows}
    assert {"peak allocated over baseline", "allocated after step over baseline", "forward increment per layer",
            "median step time", "losses identical to stock", "peak growth per layer"} <= metrics
    _assert_every_target_judged_and_met(rows)
    fwd = next(r for r in rows if r["metric"] == "forward increment per layer")
    assert fwd["target"].startswith("<= bf16 + 50 KiB") and fwd["bf16"] == 516.5
    assert [s["id"] for s in summary["series"]] == ["depth_peak", "depth_after_step"]
    labels = {line["label"] for line in summary["series"][0]["lines"]}
    assert labels == {"bf16", "Float8CurrentScaling stock", "Float8CurrentScaling drop-in"}
    assert {t["variant"] for t in summary["timings"]} == {"stock", "drop-in", "bf16"}


def test_misses_are_flagged_and_explained_with_numbers():
    args, samples = fsdp2_samples(peak_extra=0.5, slow=1.05)
    rows = fsdp2_memory.summarize(samples, args)["rows"]
    peak = next(r for r in rows if r["metric"] == "peak allocated over baseline")
    assert peak["ok"] is False and peak["ratio"] > 1.0
    text = h.explain_miss(peak)
    assert "delta +0.5 MiB" in text and "ratio 1.0" in text
    slow = next(r for r in rows if r["metric"] == "median step time")
    assert slow["ok"] is False and "IQR" in slow["spread"] and "ms per step" in slow["note"]


def test_ratio_and_time_rows():
    assert h.ratio_row("c", "m", "MiB", 10.0, 10.0)["ok"] is True
    assert h.ratio_row("c", "m", "MiB", 10.0, 10.001)["ok"] is False
    strict = h.ratio_row("c", "m", "", 32, 32, limit=1.0, strict=True)
    assert strict["ok"] is False and strict["target"] == "ratio < 1"
    assert h.ratio_row("c", "m", "", 0.0, 0.0)["ratio"] is None
    assert h.ratio_row("c", "m", "", 1.0, 2.0, limit=None)["ok"] is None
    row = h.time_row("c", [0.010] * 3, [0.0101] * 3)
    assert row["ok"] is True and "indicative" in row["note"]
    assert h.bound_row("c", "m", "MiB", 1.0, 1.0, "< 1 MiB", strict=True)["ok"] is False


def test_microbatch_summary_wants_fewer_quantizations_and_a_faster_step():
    args = microbatch.parse(["--quick", "--recipes", "Float8CurrentScaling", "--microbatches", "4"])
    rnd = random.Random(1)
    samples = [fake_measure(j, rnd, slow=0.9) for j in microbatch.plan(args, None, 2, 141.0)]
    summary = microbatch.summarize(samples, args)
    by_metric = {r["metric"]: r for r in summary["rows"]}
    assert by_metric["weight quantizations per step"]["ok"] is True
    assert by_metric["median step time"]["ok"] is True and by_metric["median step time"]["target"] == "ratio < 1"
    assert "FP8 workspace per weight" in by_metric["peak allocated over baseline"]["note"]
    assert summary["bars"][0]["groups"] == {"stock": [32.0], "drop-in": [8.0]}


def test_recompute_summary_compares_every_case_including_step_time():
    args = recompute.parse(["--quick", "--recipes", "Float8CurrentScaling"])
    rnd = random.Random(2)
    samples = [fake_measure(j, rnd, slow=1.2) for j in recompute.plan(args, None, 2, 141.0)]
    rows = recompute.summarize(samples, args)["rows"]
    cases = {r["case"] for r in rows}
    assert cases and all(any(r["case"] == c and r["metric"] == "median step time" for r in rows) for c in cases)
    times = [r for r in rows if r["metric"] == "median step time"]
    assert times and all(r["ok"] is False for r in times)  # 20% slower misses <= 1.01


# -- output ------------------------------------------------------------------------------
def test_json_has_config_env_samples_and_summary(tmp_path):
    args, samples = fsdp2_samples()
    result = result_with("fsdp2_memory", args, fsdp2_memory.summarize(samples, args), samples)
    json_path, md_path = h.write_result(result, tmp_path / "out", args.tag)
    assert json_path.name == "fsdp2_memory-quick.json" and md_path.name == "fsdp2_memory-quick.md"
    data = json.loads(json_path.read_text())
    assert data["schema"] == h.SCHEMA and data["benchmark"] == "fsdp2_memory"
    assert data["config"]["quick"] is True and data["config"]["recipes"] == list(h.RECIPES)
    env = data["env"]
    assert env["torch"] and env["python"] and env["commit"] and "gpus" in env and "te" in env
    assert len(data["samples"]) == len(samples) and data["samples"][0]["step_time_s"]
    assert data["summary"]["targets"] > 0 and data["summary"]["missed"] == 0
    assert h.load_result(json_path)["rows"] == data["rows"]


def test_a_run_replaces_the_benchmarks_result_and_a_tagged_run_only_its_tag(tmp_path):
    from benchmarks._runner import save

    for name in ("step_time.json", "step_time_depth.png", "step_time-x4.json", "step_time-x4.md", "recompute.json",
                 "step_timer.txt"):
        (tmp_path / name).write_text("an earlier run")
    result = h.new_result("step_time", {})
    save(result, tmp_path, "x4")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recompute.json", "step_time-x4.json", "step_time-x4.md",
                                                          "step_time.json", "step_time_depth.png", "step_timer.txt"]
    assert (tmp_path / "step_time-x4.md").read_text().startswith("# step_time")
    save(result, tmp_path)  # untagged: the benchmark's whole result, its tags and figures included
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recompute.json", "step_time.json", "step_time.md",
                                                          "step_timer.txt"]


def test_json_never_holds_nan(tmp_path):
    result = h.new_result("x", {"value": float("nan")})
    result["samples"] = [{"inf": float("inf")}]
    path, _ = h.write_result(result, tmp_path)
    data = json.loads(path.read_text())
    assert data["config"]["value"] is None and data["samples"][0]["inf"] is None


def test_markdown_table_has_the_ratio_rows():
    args, samples = fsdp2_samples(peak_extra=0.5)
    result = result_with("fsdp2_memory", args, fsdp2_memory.summarize(samples, args), samples)
    result["skipped"] = [{"what": "MXFP8BlockScaling", "why": "Device compute capability 10.0 or higher required"}]
    md = h.render_markdown(result)
    assert "| case | metric | stock | drop-in | bf16 | ratio drop-in/stock | target | met |" in md
    row = "| leak 8L Float8CurrentScaling bf16 params | peak allocated over baseline (MiB) | 74 | 74.5 | 74 | 1.0068 |"
    assert row in md
    assert "## Missed targets" in md and "**NO**" in md
    assert "## Skipped" in md and "compute capability 10.0" in md


def test_progress_prints_elapsed_and_eta():
    out = io.StringIO()
    progress = h.Progress(4.0, stream=out, budget_s=1e9)
    progress.start("first", 1.0)
    progress.done("(ok)")
    progress.start("second", 3.0)
    progress.done()
    lines = out.getvalue().splitlines()
    assert lines[0] == "[1] first ..."
    assert "25%" in lines[1] and "elapsed 0:00" in lines[1] and "ETA 0:00" in lines[1] and "(ok)" in lines[1]
    assert "100%" in lines[3]
    assert not progress.over_budget() and h.Progress(1.0, budget_s=-1.0).over_budget()


def test_statistics():
    s = h.spread([1.0, 2.0, 3.0, 4.0, 100.0])
    assert s["median"] == 3.0 and s["q1"] == 2.0 and s["q3"] == 4.0 and s["iqr"] == 2.0 and s["max"] == 100.0
    assert h.quantile([1.0, 2.0], 0.5) == 1.5
    assert h.slope([2, 4, 8], [10.0, 14.0, 22.0]) == pytest.approx(2.0)
    assert h.slope([8], [1.0]) is None


# -- plotting ------------------------------------------------------------------------------
@pytest.mark.skipif(not HAVE_MATPLOTLIB, reason="matplotlib is not installed here (it is not a CI dependency)")
def test_plot_writes_pngs_for_a_tiny_synthetic_result(tmp_path):
    args, samples = fsdp2_samples(peak_extra=0.5)
    result = result_with("fsdp2_memory", args, fsdp2_memory.summarize(samples, args), samples)
    json_path, _ = h.write_result(result, tmp_path, "synthetic")
    assert plot.main([str(json_path), "--out", str(tmp_path / "png")]) == 0
    pngs = sorted(p.name for p in (tmp_path / "png").glob("*.png"))
    assert "fsdp2_memory-synthetic_depth_peak.png" in pngs and "fsdp2_memory-synthetic_step_times.png" in pngs
    assert all((tmp_path / "png" / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)


def test_plot_without_matplotlib_says_so_and_writes_nothing(tmp_path):
    result = h.new_result("x", {})
    json_path, _ = h.write_result(result, tmp_path)
    code = ("import sys; sys.modules['matplotlib'] = None; from benchmarks import plot; "
            f"sys.exit(plot.main([{str(json_path)!r}]))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "matplotlib is not installed: no figures written" in done.stderr
    assert not list(tmp_path.glob("*.png"))


def test_plot_rejects_a_missing_file(capsys):
    with pytest.raises(SystemExit) as info:
        plot.main(["/nonexistent/result.json"])
    assert info.value.code == 2 and "no such result file" in capsys.readouterr().err


# -- the CPU benchmark end to end, and the runner ------------------------------------------
def test_policy_overhead_quick_end_to_end(tmp_path):
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "benchmarks.policy_overhead", "--quick", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert time.perf_counter() - t0 < 60
    data = json.loads((tmp_path / "policy_overhead-quick.json").read_text())
    cases = {(s["case"], s["contexts"]) for s in data["samples"]}
    assert ("no-op", "no recompute") in cases and ("select_policy(ctx).plan(ctx)", "recompute passes") in cases
    assert ("resolve_policy(ctx).plan(ctx)", "no recompute") in cases
    assert ("binding path: plan memoized per call shape (a tuple key)", "recompute passes") in cases
    assert ("attribution off: the seams' check per call", "no recompute") in cases
    assert all(len(s["ns_per_call"]) == 5 and min(s["ns_per_call"]) > 0 for s in data["samples"])
    md = (tmp_path / "policy_overhead-quick.md").read_text()
    assert "| select_policy(ctx).plan(ctx) | no recompute |" in md and "minus no-op ns" in md


def test_run_all_dry_run_lists_the_commands(capsys, tmp_path):
    assert run_all.main(["--quick", "--dry-run", "--out", str(tmp_path), "--", "--recipes", "DelayedScaling"]) == 0
    out = capsys.readouterr().out
    assert "-m benchmarks.policy_overhead" in out
    for name in ("step_time", "fsdp2_memory", "microbatch", "recompute", "moe_memory"):
        assert "-m torch.distributed.run --nproc_per_node=2" in out and f"-m benchmarks.{name}" in out
    assert out.count("--time-budget") == 5 and out.count("--recipes DelayedScaling") == 5
    assert f"--out {tmp_path / 'step_time'} " in out  # --out DIR: each result in DIR/<name>/
    run_all.main(["--quick", "--dry-run"])
    assert f"--out {h.RESULTS / 'recompute'} " in capsys.readouterr().out  # by default: its current result


# -- workspace attribution rows (issue 6) ------------------------------------------------------
def _attrib(fwd_total, ws_fwd, leftovers):
    return {"fwd_total_mib": fwd_total, "workspace_after_fwd_mib": ws_fwd, "leftover_workspaces": leftovers}


def test_attribution_rows_check_leftovers_and_split_the_forward_allocation():
    base = _attrib(10.0, 0.0, [0])
    st, dr = _attrib(9.5, 0.25, [0, 0]), _attrib(9.5, 0.0, [0, 0])
    ok, ws, rest = fsdp2_memory.attribution_rows("leak 8L x", st, dr, base)
    assert ok["ok"] is True and ok["metric"] == "workspaces the plan frees are gone after the step"
    assert (ws["stock"], ws["dropin"]) == (0.25, 0.0)
    assert (rest["stock"], rest["dropin"]) == (-0.75, -0.5)
    bad = fsdp2_memory.attribution_rows("leak 8L x", st, _attrib(9.5, 0.0, [0, 3]), base)[0]
    assert bad["ok"] is False and "[0, 3]" in bad["note"]
    assert fsdp2_memory.attribution_rows("x", st, {"fwd_total_mib": 1.0}, base) == []


# -- paired step time -------------------------------------------------------------------------
def _paired_sample(case, stock_ms, dropin_ms, again_ms, *, same_losses=True):
    losses = [1.0, 0.5]
    return {"case": case, "init": "bf16",
            "step_time_s": {"stock": [t / 1e3 for t in stock_ms], "dropin": [t / 1e3 for t in dropin_ms],
                            "stock_again": [t / 1e3 for t in again_ms]},
            "losses": {"stock": losses, "dropin": losses if same_losses else [1.0, 0.6], "stock_again": losses}}


def test_step_time_plans_one_paired_job_per_case():
    args = step_time.parse(["--quick"])
    jobs = step_time.plan(args, None, 2, 141.0)
    assert [j.meta["case"] for j in jobs] == [f"leak 8L {r} bf16 params" for r in h.RECIPES]
    full = step_time.plan(step_time.parse([]), None, 2, 141.0)
    assert len(full) == 2 * 3 * 2 and all(j.estimate_s > 0 for j in full)
    specs = step_time.case_specs("realistic", 8, "Float8CurrentScaling", "qinit")
    assert [s.variant for s in specs.values()] == ["stock", "dropin", "stock"]
    assert all(s.quantized_init and s.layers == 8 for s in specs.values())


def test_step_time_summary_reads_the_drop_in_against_stock_and_the_control():
    base = [100.0 + i % 5 for i in range(12)]
    ok = _paired_sample("leak a", base, [t + 0.5 for t in base], [t + 0.2 for t in base])
    slow = _paired_sample("leak b", base, [t + 5 for t in base], base, same_losses=False)
    rows = step_time.summarize([ok, slow])["rows"]
    by = {(r["case"], r["metric"]): r for r in rows}
    assert by[("leak a", "median step time")]["ok"] is True
    assert by[("leak a", "median step time, control: stock again / stock")]["ok"] is None
    assert by[("leak a", "median step time, control: stock again / stock")]["dropin"] == pytest.approx(101.7)
    assert by[("leak b", "median step time")]["ok"] is False
    assert by[("leak b", "losses identical (stock, drop-in, stock again)")]["ok"] is False
    timings = step_time.summarize([ok])["timings"]
    assert [t["variant"] for t in timings] == ["stock", "drop-in", "stock again"]


def _dropin_row(sample: dict) -> dict:
    return next(r for r in step_time.case_rows("c", sample) if r["metric"] == "median step time")


def test_step_time_microbatch_cases_keep_the_weights_and_want_stocks_step_by_default():
    args = step_time.parse(["--quick", "--microbatches", "1,4"])
    jobs = step_time.plan(args, None, 2, 141.0)
    cases = [j.meta["case"] for j in jobs]
    assert cases[:3] == [f"leak 8L {r} bf16 params" for r in h.RECIPES]
    assert cases[3:] == [f"leak 8L {r} bf16 params x4 microbatches" for r in h.RECIPES]
    assert [j.meta["microbatches"] for j in jobs] == [1, 1, 1, 4, 4, 4]
    assert {j.meta["policy"] for j in jobs} == {None} and {j.spec.policy for j in jobs} == {None}
    keep = step_time.case_specs("leak", 8, "Float8CurrentScaling", "bf16", micro=4)
    assert not any(s.reshard_after_forward for s in keep.values())
    assert all(s.reshard_after_forward for s in step_time.case_specs("leak", 8, "Float8CurrentScaling",
                                                                     "bf16").values())
    base = [100.0 + i % 5 for i in range(12)]
    # The defaults quantize as stock does (the microbatch cache is an option): <= 1.005 either way.
    for micro, ratio, expected in ((1, 1.004, True), (4, 1.004, True), (1, 1.008, False), (4, 1.02, False)):
        sample = {**_paired_sample("c", base, [t * ratio for t in base], base), "microbatches": micro}
        assert _dropin_row(sample)["ok"] is expected, (micro, ratio)


def test_step_time_pins_an_option_on_the_drop_in_and_wants_two_percent_from_it():
    args = step_time.parse(["--quick", "--microbatches", "4", "--policy", "fsdp2_microbatch_cache"])
    jobs = step_time.plan(args, None, 2, 141.0)
    assert [j.meta["case"] for j in jobs] == [
        f"leak 8L {r} bf16 params x4 microbatches policy fsdp2_microbatch_cache" for r in h.RECIPES]
    specs = step_time.case_specs("leak", 8, "Float8CurrentScaling", "bf16", micro=4, policy="fsdp2_microbatch_cache")
    assert [s.policy for s in specs.values()] == [None, "fsdp2_microbatch_cache", None]  # stock models stay stock
    assert {s.checkpoint for s in specs.values()} == {"none"}
    # A recompute option needs recompute passes: every model runs in te.checkpoint.
    once = step_time.parse(["--quick", "--policy", "fsdp2_recompute_build_once"])
    assert once.checkpoint == "nonreentrant"
    assert {j.spec.checkpoint for j in step_time.plan(once, None, 2, 141.0)} == {"nonreentrant"}
    assert step_time.parse(["--quick", "--policy", "fsdp2_recompute_build_once",
                            "--checkpoint", "reentrant"]).checkpoint == "reentrant"
    base = [100.0 + i % 5 for i in range(12)]
    for ratio, expected in ((0.99, False), (0.97, True)):
        sample = {**_paired_sample("c", base, [t * ratio for t in base], base), "policy": "fsdp2_microbatch_cache"}
        row = _dropin_row(sample)
        assert row["ok"] is expected and "fsdp2_microbatch_cache pinned" in row["note"], (ratio, row)


def test_step_time_reports_the_step_peak_beside_the_time_of_a_pinned_option():
    base = [100.0 + i % 5 for i in range(12)]
    sample = {**_paired_sample("c", base, base, base), "policy": "keep_for_backward",
              "step_peak_mib": {"stock": 500.0, "dropin": 640.0, "stock_again": 500.0}}
    [peak] = [r for r in step_time.case_rows("c", sample) if r["metric"].startswith("step peak")]
    assert (peak["stock"], peak["dropin"], peak["ratio"], peak["ok"]) == (500.0, 640.0, 1.28, None)


def test_step_time_refuses_a_policy_that_does_not_plan_fsdp2(capsys):
    with pytest.raises(SystemExit):
        step_time.parse(["--policy", "lean"])
    assert "invalid choice" in capsys.readouterr().err


def test_runner_progress_line_reads_paired_times():
    from benchmarks._runner import _short

    line = _short({"step_time_s": {"stock": [0.010, 0.012], "dropin": [0.011]}})
    assert "stock 11.00 ms" in line and "dropin 11.00 ms" in line


def test_the_readme_table_lists_every_benchmark_module():
    modules = {p.stem for p in (ROOT / "benchmarks").glob("*.py") if not p.stem.startswith("_")}
    listed = set(re.findall(r"^\| `(\w+)` \|", (ROOT / "benchmarks" / "README.md").read_text(), re.M))
    assert listed, "the table was not found"
    assert modules == listed


def test_a_ratio_target_prints_as_many_digits_as_it_has():
    row = h.ratio_row("c", "median step time", "ms", 100.0, 100.4, limit=1.005)
    assert row["target"] == "ratio <= 1.005" and row["ok"] is True
