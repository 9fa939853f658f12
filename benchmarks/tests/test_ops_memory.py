"""benchmarks.ops_memory on CPU: its plan and summary (pure), with made-up figures."""

from __future__ import annotations

from benchmarks import ops_memory


def _fake(model, recipe, init, variants, rise=12.0):
    out = {"model": model, "recipe": recipe, "init": init, "layers": 8, "world": 1}
    for v in variants:
        out[v] = {"rise_mib": 8.0 if v == "dropin" else rise, "peak_mib": 100.0 if v != "dropin" else 90.0,
                  "losses": [1.0, 0.5], "step_time_s": [0.01] * 12}
    return out


def test_plan_covers_every_model_recipe_and_init():
    args = ops_memory.parse(["--quick"])
    labels = [j.label for j in ops_memory.plan(args, None, 1, 141.0)]
    assert "ops_stack Float8CurrentScaling bf16" in labels and "ops_mlp bf16" in labels
    assert "linear_stack DelayedScaling bf16" in labels
    assert len(labels) == (2 + 1) * len(args.recipes) * len(args.inits) + 2


def test_summary_checks_the_issue_targets():
    samples = [_fake("ops_stack", "Float8CurrentScaling", "bf16", ("control", "stock", "dropin")),
               _fake("linear_stack", "Float8CurrentScaling", "bf16", ("stock",), rise=8.0),
               {"model": "ops_stack", "recipe": "bf16", "init": "bf16", "layers": 8, "world": 1,
                "bf16": {"rise_mib": 16.0, "peak_mib": 120.0, "losses": [1.0], "step_time_s": [0.01]}}]
    rows = ops_memory.summarize(samples)["rows"]
    by_metric = {r["metric"]: r for r in rows if "control" not in r["case"]}
    assert by_metric["losses identical to stock"]["ok"] is True
    assert by_metric["forward rise per block vs te.Linear stack"]["ok"] is True
    assert by_metric["peak allocated over baseline"]["ok"] is True
    assert by_metric["forward rise per block"]["bf16"] == 16.0
    assert any("control" in r["case"] and r["ok"] is None for r in rows)


def test_dry_run_lists_the_configurations_without_cuda_or_te(capsys):
    from benchmarks import ops_memory

    assert ops_memory.main(["--dry-run", "--recipes", "Float8CurrentScaling", "--inits", "bf16"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].startswith("5 configuration(s)"), lines  # ops stack and MLP: FP8 and bf16; te.Linear stack
    assert any(line.startswith("ops_stack Float8CurrentScaling bf16") for line in lines)
