"""benchmarks.fp8_params on CPU: its options and summary (pure), with made-up figures."""

from __future__ import annotations

import pytest

from benchmarks import fp8_params


def _losses(dropin_equals_reference: bool) -> dict:
    reference = [0.17, 0.12, 0.07]
    return {"stock": [0.17, 0.165, 0.16], "reference": reference,
            "dropin": list(reference) if dropin_equals_reference else [0.17, 0.12, 0.0700001],
            "bf16": [0.17, 0.11, 0.06]}


def _times() -> dict:
    return {"stock": [0.0064] * 12, "dropin": [0.0066] * 12, "again": [0.0063] * 12}


def test_defaults_and_quick_run():
    full, quick = fp8_params.parse([]), fp8_params.parse(["--quick"])
    assert (full.steps, full.timed, full.recipes) == (300, 100, list(fp8_params.RECIPES))
    assert (quick.steps, quick.timed, quick.tag) == (40, 20, "quick")
    with pytest.raises(SystemExit):
        fp8_params.parse(["--recipes", "MXFP8BlockScaling"])  # not a recipe of this benchmark


@pytest.mark.parametrize("equal", [True, False])
def test_the_loss_check_holds_only_where_the_drop_in_equals_the_reference(equal):
    rows = fp8_params.rows_for("DelayedScaling", _losses(equal), _times(), (64e-6, 6))
    check = next(r for r in rows if r["metric"] == "drop-in loss curve equals the reference's")
    task = next(r for r in rows if r["metric"].startswith("step task"))
    assert task["dropin"] == pytest.approx(64.0) and "6 weights, 10.7 us each; 1.00% of stock's" in task["note"]
    assert check["ok"] is equal
    final = next(r for r in rows if r["metric"] == "final loss")
    assert (final["stock"], final["bf16"]) == (0.16, 0.06)
    assert any("control" in r["metric"] and r["ok"] is None for r in rows)


def test_the_series_draws_every_variant_per_step():
    series = fp8_params.series_for("Float8CurrentScaling", _losses(True))
    assert [line["x"] for line in series["lines"]] == [[0, 1, 2]] * 4
    assert {line["label"] for line in series["lines"]} >= {"stock TE", "drop-in", "bf16 parameters"}
