"""``python -m workspace_manager explain``: the decision table."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from workspace_manager.__main__ import main

RECIPES = {"float8_delayed_scaling", "float8_current_scaling", "float8_block_2d", "mxfp8", "nvfp4_2d"}


def test_json_covers_every_policy_setting_and_recipe(capsys):
    assert main(["explain", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["quantizer"] for r in rows} == RECIPES
    seen = {(r["policy"], r["context"]["sharding"], r["context"]["recompute"], r["context"]["grad_enabled"]) for r in rows}
    for needed in [
        ("plain", "none", "none", True),
        ("plain", "none", "none", False),  # inference
        ("fsdp2", "fsdp2_reshard", "none", True),
        ("fsdp2", "fsdp2_keep", "none", True),
        ("recompute", "none", "first", False),
        ("recompute", "none", "recompute", True),
        ("fsdp2_recompute", "fsdp2_reshard", "recompute", True),
        ("distributed_weight", "distributed_weight", "none", True),
    ]:
        assert needed in seen, needed
    one = rows[0]["plan"]
    assert set(one) == {"cache", "forward_usage", "backward_source", "backward_usage", "columnwise_source", "release",
                        "parameter_keeps", "notes"}
    sharded_fp8 = [r for r in rows if r["policy"] == "fsdp2" and r["context"]["weight"] == "quantized_param"
                   and r["quantizer"] == "float8_current_scaling"]
    assert sharded_fp8 and {r["plan"]["parameter_keeps"] for r in sharded_fp8} == {"rowwise"}


def test_options_narrow_the_table(capsys):
    main(["explain", "--json", "--policy", "fsdp2", "--quantizer", "MXFP8BlockScaling"])
    rows = json.loads(capsys.readouterr().out)
    assert rows and {r["policy"] for r in rows} == {"fsdp2"} and {r["quantizer"] for r in rows} == {"mxfp8"}


def test_full_adds_overrides_and_no_dgrad(capsys):
    main(["explain", "--json", "--policy", "plain", "--quantizer", "mxfp8", "--full"])
    rows = json.loads(capsys.readouterr().out)
    assert {r["context"]["backward_override"] for r in rows} == {"none", "high_precision", "dequantized"}
    assert {r["context"]["input_requires_grad"] for r in rows} == {True, False}


def test_text_table_is_readable(capsys):
    main(["explain", "--policy", "fsdp2", "--quantizer", "DelayedScaling"])
    out = capsys.readouterr().out
    assert out.startswith("== policy: fsdp2 ==")
    assert "fsdp2_reshard train hp_weight mb:none" in out and "requantize (columnwise)" in out
    assert "derived_columnwise" in out


def test_bad_choice_exits_with_usage_error():
    result = subprocess.run(
        [sys.executable, "-m", "workspace_manager", "explain", "--policy", "nope"], capture_output=True, text=True
    )
    assert result.returncode == 2 and "invalid choice" in result.stderr


def test_no_command_is_a_usage_error():
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2
