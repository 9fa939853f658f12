"""``benchmarks.saved_workspace`` on CPU: its arguments, D11's target, the
plain sentence on the lean policy, and the result it writes, on synthetic rows."""

from __future__ import annotations

import pytest

from benchmarks import _harness as h

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


def test_the_result_judges_each_recipe_against_stock_and_shows_the_summary():
    from benchmarks import saved_workspace as sw

    rows = [_row("linear", "bf16", {"stock": 128.0}),
            _row("linear", "Float8CurrentScaling", {"stock": 320.0, "dropin": 192.0, "lean": 80.0}),
            {**_row("linear", "DelayedScaling", {"stock": 320.0, "dropin": 315.0}), "lean_identical": False}]
    judged = sw.target_rows(rows)
    assert {r["case"] for r in judged} == {"linear Float8CurrentScaling", "linear DelayedScaling"}
    missed = sorted(r["metric"] for r in judged if r["ok"] is False)
    assert missed == ["held from the end of forward, drop-in", "outputs and gradients identical to stock: lean",
                      "peak over the step's start, drop-in"]
    result = {**h.new_result("saved_workspace", {}), "samples": rows, "rows": judged, "text": sw.summary(rows)}
    md = h.render_markdown(result)
    assert "Targets met: 5 of 8." in md and "```\nstack" in md and "lean holds 80.0 MiB" in md
