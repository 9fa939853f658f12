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
    table = out.split("legend:")[0].splitlines()
    at = table.index("fsdp2_reshard train hp_weight")
    assert table[at + 1].split() == ["mb:none", "bypass", "row", "requant:col", "requant", "-", "-", "all"]
    assert "derived_col" in out


def _table_and_legend(out: str) -> tuple[list[str], dict[str, str]]:
    table, legend = out.split("\nlegend:\n")
    terms = {}
    for line in legend.splitlines():
        if line.startswith("  ") and not line.startswith("   "):
            term, _, meaning = line.strip().partition("  ")
            terms[term] = meaning.strip()
    return table.splitlines(), terms


def test_legend_explains_every_word_of_the_table_once_per_line(capsys):
    main(["explain", "--full"])
    table, terms = _table_and_legend(capsys.readouterr().out)
    assert all(terms.values())
    words = set()
    for line in table:
        if line.startswith("==") or set(line.strip()) <= {"-"} or not line.strip():
            continue
        for word in line.replace(",", " ").split():
            words.update([word] if word in terms else word.replace(":", " ").replace("+", " ").split())
    words -= {"dgrad", "col"} - set(terms)  # the "dgrad col" header is one term
    missing = {w for w in words if w not in terms and w not in {"dgrad", "col"}}
    assert not missing, f"not in the legend: {sorted(missing)}"
    for term in ("hp_weight", "qparam", "mb:first", "fsdp2_keep", "dgrad col", "saved_ws", "derived_col", "all"):
        assert term in terms, term


def test_recipe_names_stand_next_to_profile_names(capsys):
    main(["explain", "--policy", "fsdp2", "--recipe", "mxfp8blockscaling", "--quantizer", "float8_block_1d"])
    out = capsys.readouterr().out
    _, terms = _table_and_legend(out)
    assert "capability profile is mxfp8" in terms["MXFP8BlockScaling"]
    assert "no TE recipe" in terms["float8_block_1d"]
    main(["explain", "--json", "--recipe", "NVFP4BlockScaling"])
    rows = json.loads(capsys.readouterr().out)
    assert {(r["recipe"], r["quantizer"]) for r in rows} == {("NVFP4BlockScaling", "nvfp4_2d")}


def test_recipe_rejects_a_profile_name():
    result = subprocess.run([sys.executable, "-m", "workspace_manager", "explain", "--recipe", "mxfp8"],
                            capture_output=True, text=True)
    assert result.returncode == 2 and "MXFP8BlockScaling" in result.stderr


def test_why_prints_the_notes_in_text_mode(capsys):
    main(["explain", "--policy", "fsdp2", "--recipe", "Float8CurrentScaling"])
    plain = capsys.readouterr().out
    main(["explain", "--policy", "fsdp2", "--recipe", "Float8CurrentScaling", "--why"])
    why = capsys.readouterr().out
    assert "why:" not in plain
    assert "    why: FSDP2 reshards after forward: no cached copy per layer (TE#2681)" in why
    assert "why: columnwise derived from rowwise (Float8CurrentScaling allows it)" in why


def test_a_note_that_names_a_quantizer_names_only_those_it_applies_to(capsys):
    main(["explain", "--policy", "fsdp2", "--why", "--width", "400"])
    out = capsys.readouterr().out
    assert "why: DelayedScaling does not requantize exactly" in out
    assert "why: columnwise derived from rowwise (DelayedScaling, Float8CurrentScaling, Float8BlockScaling, " \
        "NVFP4BlockScaling allows it)" in out


def test_one_row_per_setting_when_quantizers_agree_else_groups_under_it(capsys):
    main(["explain", "--policy", "fsdp2", "--width", "400"])
    table, _ = _table_and_legend(capsys.readouterr().out)
    at = table.index("fsdp2_reshard train hp_weight")
    assert [l.split()[0] for l in table[at + 1:at + 4]] == ["mb:none", "mb:first", "mb:later"]
    assert all(l.endswith("  all") for l in table[at + 1:at + 4])
    at = table.index("fsdp2_reshard train qparam")
    first, second = table[at + 1], table[at + 2]
    assert first.split()[0] == "mb:none" and first.endswith(
        "DelayedScaling, Float8CurrentScaling, Float8BlockScaling, NVFP4BlockScaling")
    assert second.startswith("   ") and second.split()[-1] == "MXFP8BlockScaling" and "gathered" in second
    assert table[at + 3].split()[0] == "mb:first"
    # each setting's heading appears once per policy
    headings = [l for l in table if l and not l.startswith((" ", "=")) and not set(l) <= {"-"}]
    assert len(headings) == len(set(headings))


@pytest.mark.parametrize("width", [None, "100", "160"])
def test_text_fits_the_width(capsys, width):
    argv = ["explain", "--full", "--why", "--quantizer", "hybrid", "--quantizer", "nvfp4_1d", "--recipe",
            "DelayedScaling"] + (["--width", width] if width else [])
    main(argv)
    lines = capsys.readouterr().out.splitlines()
    limit = int(width or 120)
    assert max(len(l) for l in lines) <= limit
    if limit <= 120:  # the width is used for wrapping, not just respected
        assert max(len(l) for l in lines) > limit - 10


def test_width_below_the_minimum_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(["explain", "--width", "40"])
    assert info.value.code == 2 and "at least 100 columns, received 40" in capsys.readouterr().err


def test_repeated_options_are_deduplicated(capsys):
    main(["explain", "--json", "--policy", "plain"])
    once = json.loads(capsys.readouterr().out)
    main(["explain", "--json", "--policy", "plain", "--policy", "PLAIN", "--quantizer", "mxfp8", "--quantizer",
          "MXFP8BlockScaling", "--recipe", "mxfp8blockscaling", "--quantizer", "nvfp4_2d"])
    rows = json.loads(capsys.readouterr().out)
    mx = [r for r in rows if r["quantizer"] == "mxfp8"]
    assert len(mx) == len([r for r in once if r["quantizer"] == "mxfp8"])
    assert [r["quantizer"] for r in rows][:1] == ["mxfp8"] and {r["quantizer"] for r in rows} == {"mxfp8", "nvfp4_2d"}


def test_names_are_case_insensitive(capsys):
    main(["explain", "--json", "--policy", "FSDP2", "--quantizer", "MxFp8", "--recipe", "float8currentscaling"])
    rows = json.loads(capsys.readouterr().out)
    assert {r["policy"] for r in rows} == {"fsdp2"}
    assert {r["quantizer"] for r in rows} == {"mxfp8", "float8_current_scaling"}


def test_bad_choice_exits_with_usage_error():
    result = subprocess.run(
        [sys.executable, "-m", "workspace_manager", "explain", "--policy", "nope"], capture_output=True, text=True
    )
    assert result.returncode == 2 and "invalid choice" in result.stderr


def test_no_command_is_a_usage_error():
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2


def _rows(capsys, *policies: str) -> list[dict]:
    argv = ["explain", "--json", "--recipe", "Float8CurrentScaling", "--recipe", "DelayedScaling"]
    for policy in policies:
        argv += ["--policy", policy]
    main(argv)
    return json.loads(capsys.readouterr().out)


def _plans(rows: list[dict], policy: str, **context) -> dict[str, dict]:
    """Quantizer -> plan of the rows of ``policy`` whose context has ``context``."""
    return {r["quantizer"]: r["plan"] for r in rows
            if r["policy"] == policy and all(r["context"][k] == v for k, v in context.items())}


def test_the_options_show_as_policies_of_their_own(capsys):
    """The microbatch cache (D4) and the recompute pass's copy (D3) are off
    in the default policies and on in the entries named after them."""
    rows = _rows(capsys, "fsdp2", "fsdp2_microbatch_cache", "fsdp2_recompute", "fsdp2_recompute_build_once")
    mb = dict(sharding="fsdp2_keep", recompute="none", grad_enabled=True, weight="high_precision", microbatch="first")
    assert {p["cache"] for p in _plans(rows, "fsdp2", **mb).values()} == {"bypass"}
    cached = _plans(rows, "fsdp2_microbatch_cache", **mb)
    assert cached["float8_current_scaling"]["cache"] == "fill" and cached["float8_delayed_scaling"]["cache"] == "bypass"
    rp = dict(sharding="fsdp2_reshard", recompute="recompute", recompute_scope="region", weight="high_precision",
              microbatch="none", input_requires_grad=True)
    assert {p["backward_source"] for p in _plans(rows, "fsdp2_recompute", **rp).values()} == {"requantize"}
    once = _plans(rows, "fsdp2_recompute_build_once", **rp)
    assert once["float8_current_scaling"]["backward_source"] == "saved_workspace"
    assert once["float8_delayed_scaling"]["backward_source"] == "requantize"


def test_the_default_tables_name_the_option_that_would_differ(capsys):
    main(["explain", "--policy", "fsdp2", "--policy", "fsdp2_recompute", "--recipe", "Float8CurrentScaling", "--why"])
    out = " ".join(capsys.readouterr().out.split())
    assert "MicrobatchCache.EXACT_FORMATS caches instead" in out
    assert "RecomputeCopy.BUILD_ONCE saves one instead" in out
