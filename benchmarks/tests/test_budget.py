"""benchmarks.budget on CPU: its arguments, plan and summary, on synthetic figures."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import _harness as h  # noqa: E402
from benchmarks import budget  # noqa: E402


def _sample(recipe: str, keep_ms: dict[int, float], *, stock_ms: float = 100.0, again_ms: float = 100.0,
            same_losses: bool = True, steps: int = 12) -> dict:
    """A paired sample: per variant, steps at its time with +-0.2 ms of alternating jitter."""
    labels = {"stock": stock_ms, **{f"keep_{p}": ms for p, ms in keep_ms.items()}, "stock_again": again_ms}
    times = {k: [(ms + (0.2 if i % 2 else -0.2)) / 1e3 for i in range(steps)] for k, ms in labels.items()}
    losses = {k: [1.0, 0.5] for k in labels}
    if not same_losses:
        losses["keep_100"] = [1.0, 0.6]
    peaks = {k: 1000.0 + (p if k.startswith("keep") else 0) for k, p in
             zip(labels, [0, *keep_ms, 0])}
    return {"case": f"4L seq 1024 {recipe}", "recipe": recipe, "step_time_s": times, "step_peak_mib": peaks,
            "losses": losses, "kept_mib": {f"keep_{p}": p * 1.92 for p in keep_ms}, "full_copy_mib": 192.0}


def test_defaults_quick_and_bad_budgets(capsys):
    full, quick = budget.parse([]), budget.parse(["--quick"])
    assert full.budgets == [0, 25, 50, 100] and full.layers == 4 and full.seq == 1024 and full.steps >= 30
    assert quick.budgets == [0, 100] and quick.tag == "quick"
    assert budget.parse(["--budgets", "50,0,50"]).budgets == [0, 50]
    for bad in ("101", "x", ""):
        with pytest.raises(SystemExit):
            budget.parse(["--budgets", bad])
        assert "percentages from 0 to 100" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        budget.parse(["--sizes", "leak"])
    assert "--sizes does not apply" in capsys.readouterr().err


def test_one_paired_job_per_recipe_with_stock_budgets_and_the_control():
    args = budget.parse([])
    jobs = budget.plan(args, None, 1, 141.0)
    assert [j.meta["recipe"] for j in jobs] == list(h.RECIPES)
    specs = budget.case_specs(args, "Float8CurrentScaling")
    assert list(specs) == ["stock", "keep_0", "keep_25", "keep_50", "keep_100", "stock_again"]
    assert [f for _, f in specs.values()] == [None, 0.0, 0.25, 0.5, 1.0, None]
    assert [s.managed for s, _ in specs.values()] == [False, True, True, True, True, False]
    spec = specs["keep_25"][0]
    assert (spec.size.hidden, spec.size.ffn, spec.size.heads, spec.size.seq, spec.size.batch, spec.layers) == (
        2048, 8192, 16, 1024, 2, 4)
    assert all(s.reshard_after_forward and not s.quantized_init for s, _ in specs.values())
    assert sum(j.estimate_s for j in jobs) < 200  # the default run stays well inside 4 minutes


def test_the_verdict_says_where_it_pays_off_against_the_default_and_the_noise():
    pays = budget.verdict(_sample("Float8CurrentScaling", {0: 100.0, 25: 99.0, 50: 98.0, 100: 97.0}))
    assert pays.startswith("Float8CurrentScaling: pays off. A 100% budget gives -3.0% in step time")
    assert "+100 MiB of peak" in pays
    noise = budget.verdict(_sample("Float8BlockScaling", {0: 100.0, 100: 99.9}, again_ms=101.0))
    assert noise.startswith("Float8BlockScaling: does not pay off here. The best budget (100%) gives -0.1%")
    assert noise.endswith("within the noise.")
    delayed = budget.verdict(_sample("DelayedScaling", {0: 100.0, 100: 99.0}))
    assert delayed.startswith("DelayedScaling: no change expected.")


def test_rows_compare_every_budget_and_the_control_with_stock_and_check_the_losses():
    ok = budget.case_rows(_sample("Float8CurrentScaling", {0: 101.0, 100: 99.0}))
    by = {(r["case"], r["metric"]): r for r in ok}
    case = "4L seq 1024 Float8CurrentScaling"
    assert by[(case, "losses identical (stock, every budget, stock again)")]["ok"] is True
    assert by[(f"{case}, keep 100%", "median step time")]["ratio"] == pytest.approx(0.99)
    assert by[(f"{case}, keep 0%", "median step time")]["note"] == "keep policy pinned on 0.0 of 192.0 MiB of weights"
    assert by[(f"{case}, stock again", "median step time")]["note"] == "control: the noise floor"
    assert by[(f"{case}, keep 100%", "step peak over its start")]["ratio"] == pytest.approx(1.1)
    assert len(ok) == 1 + 2 * 3 and all(r["ok"] is None for r in ok[1:])  # reported, no target
    bad = budget.case_rows(_sample("Float8CurrentScaling", {0: 101.0, 100: 99.0}, same_losses=False))
    assert bad[0]["ok"] is False and "differ" in bad[0]["note"]


def test_the_summary_has_the_payoff_table_and_one_time_against_peak_series():
    samples = [_sample(r, {0: 100.0, 25: 99.5, 50: 99.0, 100: 98.0}) for r in h.RECIPES]
    summary = budget.summarize(samples)
    table = summary["tables"][0]
    assert len(table["rows"]) == 3 * 4 and table["note"].count("\n- ") == 2
    assert table["rows"][3][:2] == ["DelayedScaling", "100%"] and table["rows"][3][5] == "0.9800"
    (series,) = summary["series"]
    assert series["id"] == "time_vs_peak" and len(series["lines"]) == 2 * 3
    line = series["lines"][0]
    assert line["label"] == "DelayedScaling budgets 0-100%" and line["x"] == [1000.0, 1025.0, 1050.0, 1100.0]
    assert line["y"] == pytest.approx([100.0, 99.5, 99.0, 98.0])
    text = h.render_markdown({**h.new_result("budget", {}), **summary, "wall_s": 1.0})
    assert "## Where the budget pays off" in text and "Float8BlockScaling: pays off" in text


def test_without_torchrun_it_says_how_to_launch(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as info:
        budget.main(["--quick"])
    assert "torchrun --nproc_per_node=2 -m benchmarks.budget --quick" in str(info.value.code)


# -- benchmarks.saved_workspace: the lean policy, unsharded ---------------------------
def _row(stack: str, recipe: str, held: dict, *, ms: dict | None = None, params: int = 8 * 2**20) -> dict:
    ms = ms or {}
    row = {"stack": stack, "recipe": recipe, "params": params, "identical": True, "lean_identical": True}
    for label in ("stock", "dropin", "lean", "stock_again"):
        row[f"{label}_held_mib"] = held.get(label, held["stock"])
        row[f"{label}_peak_mib"] = held.get(label, held["stock"]) + 100.0
        row[f"{label}_step_ms"] = ms.get(label, 10.0)
    return row


def test_saved_workspace_defaults_and_quick():
    from benchmarks import saved_workspace as sw

    full, quick = sw.parse([]), sw.parse(["--quick"])
    assert full.stacks == ["linear", "transformer", "transformer_4096"] and full.timed == 20
    assert quick.stacks == ["transformer"] and quick.timed == 5
    big = sw.STACKS["transformer_4096"]
    assert (big.hidden, big.ffn, big.heads, big.seq, big.batch, big.layers) == (4096, 16384, 32, 1024, 2, 8)
    with pytest.raises(SystemExit):
        sw.parse(["--stacks", "huge"])


def test_saved_workspace_says_plainly_whether_lean_holds_less_than_bf16():
    from benchmarks import saved_workspace as sw

    bf16 = _row("transformer", "bf16", {"stock": 1025.0})
    lean = _row("transformer", "Float8CurrentScaling", {"stock": 1665.0, "dropin": 1281.0, "lean": 897.0},
                ms={"stock": 10.0, "dropin": 10.1, "lean": 10.4, "stock_again": 9.9})
    sentence = sw.lean_sentence(lean, bf16)
    assert sentence.startswith("transformer Float8CurrentScaling: LESS than bf16: lean holds 897.0 MiB")
    assert "against bf16's 1025.0" in sentence and "lean/stock 1.040" in sentence and "stock again/stock 0.990" in sentence
    delayed = _row("transformer", "DelayedScaling", {"stock": 1665.0, "dropin": 1281.0, "lean": 1281.0})
    assert sw.lean_sentence(delayed, bf16).startswith("transformer DelayedScaling: NOT less than bf16 (lean plans")
    text = sw.summary([bf16, lean, delayed])
    assert text.splitlines()[1].split()[:2] == ["transformer", "bf16"] and "baseline" in text.splitlines()[1]
    assert text.splitlines()[2].endswith("met") and text.count("than bf16") == 2


def test_saved_workspace_target_is_one_byte_per_parameter_less_than_stock():
    from benchmarks import saved_workspace as sw

    met = _row("linear", "Float8CurrentScaling", {"stock": 320.0, "dropin": 312.0})
    assert sw.verdict(met) == "met"  # 8 Mi parameters: 8 MiB less is enough
    missed = _row("linear", "Float8CurrentScaling", {"stock": 320.0, "dropin": 313.0})
    assert sw.verdict(missed).startswith("MISSED (target: 8 MiB less)")


def test_the_saved_tensor_recorder_counts_each_saved_storage_once_under_its_module_and_skips_parameters():
    import torch

    from benchmarks import _saved_tensors as st

    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(8, 16, bias=False), torch.nn.Sigmoid())
    model = torch.nn.Sequential(layer, torch.nn.Linear(16, 4, bias=False))
    x = torch.randn(5, 8, requires_grad=True)
    table = st.record_saved(layer, lambda: model(x).sum().backward())
    # Linear saves its input (the weight is a parameter); Sigmoid saves its output.
    # The second Linear is outside ``layer``, so its saved input is not counted.
    assert table == {"0": {"float32 (5, 8)": 5 * 8 * 4}, "1": {"float32 (5, 16)": 5 * 16 * 4}}
    assert st.total(table) == (5 * 8 + 5 * 16) * 4
    assert all(not h for h in (layer[0]._forward_pre_hooks, layer[0]._forward_hooks))  # hooks removed


def test_the_saved_tensor_difference_says_where_one_table_keeps_more():
    from benchmarks import _saved_tensors as st

    mib = 2**20
    block = {"mlp": {"uint8 (1024, 8192)": 8 * mib, "uint8 (8192, 1024)": 8 * mib, "float32 (8, 1024)": mib // 4},
             "qkv": {"uint8 (1024, 2048)": 2 * mib}}
    current = {"mlp": {"uint8 (8192, 1024)": 8 * mib}, "qkv": {"uint8 (1024, 2048)": 2 * mib}}
    assert st.difference(block, current) == [("mlp", "uint8 (1024, 8192)", 8 * mib),
                                             ("mlp", "float32 (8, 1024)", mib // 4)]
    lines = st.describe("block", block, "current", current, limit=1)
    assert lines == ["block keeps 18.25 MiB, current 10.00 MiB (difference +8.25 MiB):",
                     "     +8.00 MiB  mlp: uint8 (1024, 8192)", "     +0.25 MiB  in 1 more entries"]


def test_the_saved_workspace_summary_breaks_down_lean_against_bf16_and_block_against_current():
    from benchmarks import saved_workspace as sw

    mib = 2**20
    act = {"mlp": {"bfloat16 (1024, 8192)": 16 * mib}}
    rows = [_row("transformer", "bf16", {"stock": 1025.0}),
            _row("transformer", "Float8CurrentScaling", {"stock": 1665.0, "dropin": 1281.0, "lean": 897.0}),
            _row("transformer", "Float8BlockScaling", {"stock": 1805.0, "dropin": 1421.0, "lean": 1037.0})]
    rows[0]["layer_saved"] = {"stock": act}
    rows[1]["layer_saved"] = {k: {"mlp": {"uint8 (1024, 8192)": 8 * mib}} for k in ("stock", "dropin", "lean")}
    rows[2]["layer_saved"] = {k: {"mlp": {"uint8 (1024, 8192)": 8 * mib, "uint8 (8192, 1024)": 8 * mib}}
                                    for k in ("stock", "dropin", "lean")}
    text = sw.summary(rows)
    assert "transformer Float8CurrentScaling, lean keeps 8.00 MiB, bf16 16.00 MiB (difference -8.00 MiB):" in text
    assert "transformer, Block scaling lean keeps 16.00 MiB, current scaling lean 8.00 MiB (difference +8.00 MiB):" \
        in text
    assert "     +8.00 MiB  mlp: uint8 (8192, 1024)" in text
    assert "What the second layer keeps" not in sw.summary([_row("linear", "bf16", {"stock": 1.0})])


def test_a_failed_breakdown_is_reported_and_keeps_the_memory_figures(capsys):
    from benchmarks import saved_workspace as sw

    class Broken(dict):
        def __getitem__(self, key):
            raise RuntimeError("no layer here")

    assert sw.breakdown(Broken(stock=None), sw.STACKS["transformer"], None) == {"error": "RuntimeError: no layer here"}
    assert "breakdown not measured for transformer: RuntimeError" in capsys.readouterr().out
    row = _row("transformer", "bf16", {"stock": 1025.0})
    row["layer_saved"] = {"error": "RuntimeError: no layer here"}
    assert "transformer bf16: not measured, RuntimeError: no layer here" in sw.summary([row])
