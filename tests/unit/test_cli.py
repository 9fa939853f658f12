"""``python -m workspace_manager explain``: the decision table."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from workspace_manager import RECIPE_PROFILES
from workspace_manager.__main__ import main
from workspace_manager._explain import POLICY_CHOICES

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
                        "parameter_keeps", "workspace_origin", "notes"}
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
    main(["explain", "--policy", "fsdp2"])
    out = capsys.readouterr().out
    assert out.startswith("== policy: fsdp2 ==\n  FSDP2WorkspacePolicy()\n  for:")
    table = out.split("legend:")[0].splitlines()
    at = table.index("fsdp2_any train hp_weight")
    assert table[at + 1].split() == ["mb:any", "bypass", "row", "requant:col", "requant", "-", "-"]
    assert "derived_col" in out


def _legend(text: str) -> dict[str, str]:
    """Term -> meaning of the legend (the text after ``legend:``): one
    paragraph per category, ``term: meaning`` joined by ``; ``; a list of
    terms (``A, B: ...``) gives each the meaning. The modules paragraph is prose."""
    terms = {}
    for paragraph in re.split(r"\n(?=  \S)", text.strip("\n")):
        category, _, entries = " ".join(line.strip() for line in paragraph.splitlines()).partition("  ")
        if category == "modules":
            continue
        for entry in entries.split("; "):
            names, _, meaning = entry.partition(": ")
            assert meaning, f"{category}: no meaning in {entry!r}"
            terms.update(dict.fromkeys(names.split(", "), meaning))
    return terms


def _parse(out: str) -> tuple[dict[str, tuple[list[str], list[str]]], dict[str, str]]:
    """(per policy: summary lines, table lines), and the one legend."""
    body, found, legend = out.rstrip("\n").rpartition("\n\nlegend:\n")
    assert found, out[-400:]
    blocks = {}
    for block in body.split("\n\n== policy: "):
        name, _, rest = block.removeprefix("== policy: ").partition(" ==\n")
        summary, _, table = rest.partition("\n\n")
        blocks[name] = (summary.splitlines(), table.splitlines())
    return blocks, _legend(legend)


def _policy_blocks(out: str) -> dict[str, tuple[list[str], list[str]]]:
    return _parse(out)[0]


def _table_and_legend(out: str) -> tuple[list[str], dict[str, str]]:
    """The one policy's table lines and the legend."""
    blocks, terms = _parse(out)
    (_, table), = blocks.values()
    return table, terms


def _table_words(table: list[str]) -> set[str]:
    words = set()
    for line in table[1:]:  # below the column header
        line = line.replace("all but ", "all_but ")
        for word in line.replace(",", " ").split():
            words.update([word] if word != "all_but" else ["all but"])
    return words


@pytest.mark.parametrize("argv", [[], ["--full"], ["--why", "--width", "120"]])
def test_one_legend_explains_every_word_of_every_table(capsys, argv):
    main(["explain", *argv])
    out = capsys.readouterr().out
    assert out.count("legend:") == 1 and "\nlegend:\n" in out  # one legend per output, after the last table
    blocks, terms = _parse(out)
    assert list(blocks) == list(POLICY_CHOICES) and all(terms.values())
    for policy, (_, table) in blocks.items():
        # the reasons are prose: "why: ..." and its continuation lines
        words = _table_words([l for l in table if not l.lstrip().startswith("why:") and not l.startswith(" " * 11)])
        missing = {w for w in words if w not in terms
                   and not all(p in terms for p in w.replace(":", " ").replace("+", " ").split())}
        assert not missing, f"{policy}: not in the legend: {sorted(missing)}"
        header = table[0].split()
        assert header[:4] == ["cache", "forward", "backward", "dgrad"] and "dgrad col" in terms
    for term in ("hp_weight", "qparam", "mb:first", "saved_ws") if argv == ["--full"] else ():
        assert term in terms, term


def test_the_legend_has_no_term_no_table_uses(capsys):
    """``--policy fsdp2`` has no recompute rows: the legend says nothing of
    them, nor of the module's own recompute (LayerNormMLP(checkpoint=True))."""
    main(["explain", "--policy", "fsdp2"])
    out = capsys.readouterr().out
    _, terms = _table_and_legend(out)
    assert not any("recompute" in t for t in terms) and "checkpoint" not in out
    main(["explain", "--policy", "recompute"])
    out = capsys.readouterr().out
    table, terms = _table_and_legend(out)
    assert any("(own)" in l for l in table) and "recompute:recompute(own)" in terms
    assert "LayerNormMLP(checkpoint=True)" in terms["recompute:recompute(own)"]


def test_legend_meanings_never_hold_the_separator():
    from workspace_manager._explain_layout import LEGEND

    assert not [term for term, meaning in LEGEND.items() if "; " in meaning or ": " in term]


def test_recipe_names_stand_next_to_profile_names(capsys):
    main(["explain", "--policy", "fsdp2", "--recipe", "mxfp8blockscaling", "--quantizer", "float8_block_1d"])
    out = capsys.readouterr().out
    _, terms = _table_and_legend(out)
    # named quantizers: the legend gives their capabilities, a recipe summary at a glance
    assert terms["MXFP8BlockScaling"] == "TE recipe, profile mxfp8, with requantization_safe"
    assert "no TE recipe" in terms["float8_block_1d"]
    assert " ".join(out.split()).count("requantization_safe") == 2
    main(["explain", "--policy", "fsdp2"])
    _, terms = _table_and_legend(capsys.readouterr().out)
    assert terms["MXFP8BlockScaling"] == terms["DelayedScaling"] == "TE recipes (see --recipe)"
    main(["explain", "--json", "--recipe", "NVFP4BlockScaling"])
    rows = json.loads(capsys.readouterr().out)
    assert {(r["recipe"], r["quantizer"]) for r in rows} == {("NVFP4BlockScaling", "nvfp4_2d")}


def test_recipe_rejects_a_profile_name():
    result = subprocess.run([sys.executable, "-m", "workspace_manager", "explain", "--recipe", "mxfp8"],
                            capture_output=True, text=True)
    assert result.returncode == 2 and "MXFP8BlockScaling" in result.stderr


def test_why_prints_the_notes_in_text_mode(capsys):
    main(["explain", "--policy", "fsdp2", "--recipe", "Float8CurrentScaling", "--width", "120", "--full"])
    plain = capsys.readouterr().out
    main(["explain", "--policy", "fsdp2", "--recipe", "Float8CurrentScaling", "--why", "--width", "120", "--full"])
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


def test_full_has_one_row_per_position_and_groups_under_it(capsys):
    main(["explain", "--policy", "fsdp2", "--width", "400", "--full"])
    table, _ = _table_and_legend(capsys.readouterr().out)
    at = table.index("fsdp2_reshard train hp_weight")
    assert [l.split()[0] for l in table[at + 1:at + 4]] == ["mb:none", "mb:first", "mb:later"]
    assert all(len(l.split()) == 7 for l in table[at + 1:at + 4])  # every quantizer agrees: none named
    at = table.index("fsdp2_reshard train qparam")
    first, second = table[at + 1], table[at + 2]
    assert first.split()[0] == "mb:none" and first.endswith(
        "DelayedScaling, Float8CurrentScaling, Float8BlockScaling, NVFP4BlockScaling")
    assert second.startswith("   ") and second.split()[-1] == "MXFP8BlockScaling" and "gathered" in second
    assert table[at + 3].split()[0] == "mb:first"
    assert not any("mb:any" in l or "_any" in l or "(any)" in l for l in table)
    # each setting's heading appears once per policy
    headings = [l for l in table[1:] if l and not l.startswith(" ")]
    assert len(headings) == len(set(headings))


def _expand(heading: str, key: str, unmerged: dict[str, list[str]]) -> set[tuple[str, str]]:
    """The (heading, key) pairs of the unmerged table a merged row stands for."""
    headings = {heading}
    for merged, words in [("fsdp2_any", ("fsdp2_reshard", "fsdp2_keep")),
                          ("recompute:first(any)", ("recompute:first", "recompute:first(own)")),
                          ("recompute:recompute(any)", ("recompute:recompute", "recompute:recompute(own)"))]:
        headings = {h.replace(merged, w) if merged in h.split() else h for h in headings for w in words}
    return {(h, k) for h in headings for k in (unmerged[h] if key == "mb:any" else [key])}


@pytest.mark.parametrize("why", [False, True])
def test_merged_rows_stand_for_rows_that_print_the_same(why):
    from workspace_manager._explain import decision_table
    from workspace_manager._explain_layout import _shown, setting_blocks

    rows = decision_table(list(RECIPE_PROFILES.values()))
    merged, plain = setting_blocks(rows, why=why), setting_blocks(rows, merge=False, why=why)
    merges = 0
    for policy, blocks in plain.items():
        shown = {(b.heading, k): _shown(g, why) for b in blocks for k, g in b.rows}
        keys = {b.heading: [k for k, _ in b.rows] for b in blocks}
        covered = []
        for block in merged[policy]:
            for key, groups in block.rows:
                stands_for = _expand(block.heading, key, keys)
                merges += len(stands_for) - 1
                assert all(shown[s] == _shown(groups, why) for s in stands_for), (policy, block.heading, key)
                covered += stands_for
        assert sorted(covered) == sorted(shown), policy  # every row once, none invented
    assert merges > 100


def test_microbatch_positions_that_agree_are_one_row(capsys):
    main(["explain", "--policy", "fsdp2"])
    table, terms = _table_and_legend(capsys.readouterr().out)
    keys = [l.split()[0] for l in table[1:] if l.startswith("  mb:")]
    assert keys and set(keys) == {"mb:any"} and "mb:any" in terms and "mb:none" not in terms
    assert any(l.startswith("fsdp2_any ") for l in table) and "fsdp2_any" in terms
    main(["explain", "--policy", "fsdp2_microbatch_cache", "--recipe", "Float8CurrentScaling"])
    table, _ = _table_and_legend(capsys.readouterr().out)
    at = table.index("fsdp2_keep train hp_weight")  # the cache: the positions differ
    assert [l.split()[:2] for l in table[at + 1:at + 4]] == [["mb:none", "bypass"], ["mb:first", "fill"],
                                                             ["mb:later", "reuse"]]


def test_one_policy_fits_one_screen(capsys):
    main(["explain", "--policy", "fsdp2"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) <= 40 and max(map(len, lines)) <= 80


def test_recipe_shows_the_recipes_plans(capsys):
    """``--recipe`` narrows the table to that recipe's plans, every setting
    of them: the rows are the recipe's own, as ``--json`` gives them."""
    main(["explain", "--policy", "plain", "--recipe", "Float8CurrentScaling"])
    out = capsys.readouterr().out
    table, _ = _table_and_legend(out)
    headings = [l for l in table[1:] if l and not l.startswith(" ")]
    assert headings == ["unsharded train hp_weight", "unsharded no_grad hp_weight", "unsharded train qparam",
                        "unsharded no_grad qparam"]
    at = table.index("unsharded train hp_weight")
    assert [l.split() for l in table[at + 1:at + 4]] == [
        ["mb:none", "bypass", "row+col", "saved_ws:col", "fwd", "-", "-"],
        ["mb:first", "fill", "row+col", "saved_ws:col", "fwd", "-", "-"],
        ["mb:later", "reuse", "row+col", "saved_ws:col", "fwd", "-", "-"]]
    assert "more setting" not in out and "MXFP8BlockScaling" not in out
    main(["explain", "--json", "--policy", "plain", "--recipe", "Float8CurrentScaling"])
    rows = json.loads(capsys.readouterr().out)
    cached = [r for r in rows if r["context"]["microbatch"] == "later" and r["context"]["grad_enabled"]
              and r["context"]["weight"] == "high_precision"]
    assert [r["plan"]["cache"] for r in cached] == ["reuse"]
    # every policy shows the recipe's plans, also where every recipe gets the same ones
    main(["explain", "--recipe", "Float8CurrentScaling"])
    blocks, _ = _parse(capsys.readouterr().out)
    assert list(blocks) == list(POLICY_CHOICES) and all(len(table) > 2 for _, table in blocks.values())


@pytest.mark.parametrize("argv", [[], ["--width", "200"], ["--recipe", "MXFP8BlockScaling"],
                                  ["--recipe", "MXFP8BlockScaling", "--width", "200"]])
def test_the_legend_describes_the_columns_the_headers_show_and_no_other(capsys, argv):
    main(["explain", "--policy", "fsdp2", *argv])
    table, terms = _table_and_legend(capsys.readouterr().out)
    columns = ["cache", "forward", "backward", "dgrad col", "release", "param", "quantizers"]
    shown = [c for c in columns if c in table[0]]
    assert shown[:6] == columns[:6]
    assert [c for c in columns if c in terms] == shown


def test_each_policy_opens_with_its_constructor_and_summary(capsys):
    import workspace_manager
    from workspace_manager import named_policy

    main(["explain"])
    blocks = _policy_blocks(capsys.readouterr().out)
    for policy, (summary, _) in blocks.items():
        at = next(i for i, l in enumerate(summary) if l.startswith("  for:"))
        construct = " ".join(l.strip() for l in summary[:at])
        assert eval(construct, vars(workspace_manager)) == named_policy(policy), policy
        assert [l.split(":")[0].strip() for l in summary[at:] if not l.startswith("    ")] == [
            "for", "keeps", "trade-off"]
    assert "option, off by default (docs/decisions.md, D4)" in " ".join(blocks["fsdp2_microbatch_cache"][0])


def test_the_longest_list_of_quantizers_names_the_others(capsys):
    main(["explain", "--policy", "lean"])
    table, terms = _table_and_legend(capsys.readouterr().out)
    assert any(l.strip() == "for all but DelayedScaling:" for l in table) and "all but" in terms
    main(["explain", "--policy", "lean", "--width", "200"])
    table, terms = _table_and_legend(capsys.readouterr().out)
    assert not any("all but" in l for l in table) and "all but" not in terms


def _labelled_rows(table: list[str]) -> list[tuple[str, list[str]]]:
    """(the quantizers a ``for ...:`` line names, the cells of the row after it)."""
    out = []
    for at, line in enumerate(table):
        if line.strip().startswith("for ") and line.endswith(":"):
            out.append((line.strip()[4:-1], table[at + 1].split()[-6:]))
    return out


def test_a_rows_quantizers_stand_on_a_line_above_it_that_says_so_where_they_do_not_fit_beside(capsys):
    """At 80 columns the quantizers do not fit beside the plans: each group
    of quantizers is named on a ``for ...:`` line right above its row (not
    under it, where it read as the heading of the next row), the table has
    no quantizers column and the legend describes none; at 200 columns they
    stand beside their rows, under the column's name."""
    main(["explain", "--policy", "fsdp2"])
    table, terms = _table_and_legend(capsys.readouterr().out)
    at = table.index("fsdp2_any train qparam")
    assert table[at + 1:at + 5] == [
        "          for all but MXFP8BlockScaling:",
        "  mb:any  bypass  row      saved_param:col  derived    derived_col  row",
        "          for MXFP8BlockScaling:",
        "          bypass  row      saved_param:col  gathered   -            row+col"]
    assert "quantizers" not in table[0] and "quantizers" not in terms
    assert terms["for"] == "the quantizers of the row below (none: all)"
    # every labelled row is the plan of the quantizers its line names, as --json says
    main(["explain", "--json", "--policy", "fsdp2"])
    rows = json.loads(capsys.readouterr().out)
    qparam = {r["recipe"]: r["plan"] for r in rows if r["context"]["weight"] == "quantized_param"
              and r["context"]["grad_enabled"] and r["context"]["microbatch"] == "none"
              and r["context"]["sharding"] == "fsdp2_reshard"}
    assert qparam["MXFP8BlockScaling"]["columnwise_source"] == "gathered"
    assert {qparam[r]["columnwise_source"] for r in qparam if r != "MXFP8BlockScaling"} == {"derived"}
    for policy in POLICY_CHOICES:
        main(["explain", "--policy", policy])
        table, terms = _table_and_legend(capsys.readouterr().out)
        for names, cells in _labelled_rows(table):
            assert len(cells) == 6 and not cells[0].startswith("for"), (policy, names, cells)
        assert ("for" in terms) == bool(_labelled_rows(table)), policy
    main(["explain", "--policy", "fsdp2", "--width", "200"])
    table, terms = _table_and_legend(capsys.readouterr().out)
    assert _labelled_rows(table) == [] and table[0].endswith("quantizers") and "quantizers" in terms
    assert table[at + 2].split()[-1] == "MXFP8BlockScaling" and "for" not in terms


@pytest.mark.parametrize("width", [None, "80", "100", "160"])
def test_text_fits_the_width(capsys, width):
    argv = ["explain", "--full", "--why", "--quantizer", "hybrid", "--quantizer", "nvfp4_1d", "--recipe",
            "DelayedScaling"] + (["--width", width] if width else [])
    main(argv)
    lines = capsys.readouterr().out.splitlines()
    limit = int(width or 80)
    assert max(len(l) for l in lines) <= limit
    if limit <= 120:  # the width is used for wrapping, not just respected
        assert max(len(l) for l in lines) > limit - 10


def test_default_output_fits_80_columns(capsys):
    main(["explain"])
    assert max(len(l) for l in capsys.readouterr().out.splitlines()) <= 80


def test_width_below_the_minimum_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(["explain", "--width", "40"])
    assert info.value.code == 2 and "at least 80 columns, received 40" in capsys.readouterr().err
    assert main(["explain", "--width", "80", "--policy", "plain"]) == 0


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


def test_no_command_is_a_usage_error_naming_the_subcommands(capsys):
    with pytest.raises(SystemExit) as info:
        main([])
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert "choose a subcommand: explain" in err and "the following arguments are required" not in err
    assert err.startswith("usage: python -m workspace_manager [-h] COMMAND ...")


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
    main(["explain", "--policy", "fsdp2", "--policy", "fsdp2_recompute", "--recipe", "Float8CurrentScaling", "--why",
          "--full"])
    out = " ".join(capsys.readouterr().out.split())
    assert "MicrobatchCache.EXACT_FORMATS caches instead" in out
    assert "RecomputeCopy.BUILD_ONCE saves one instead" in out


# -- when stdout goes away --------------------------------------------------------------------------
def _explain_into(stdout, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "workspace_manager", "explain", *args], stdout=stdout,
                          stderr=subprocess.PIPE, text=True, timeout=120)


@pytest.mark.parametrize("args", [(), ("--json",)])
def test_a_closed_pipe_ends_quietly_as_sigpipe_would(args):
    """``explain | true``: the reader is gone before the first write (its end
    closed up front, so the write always fails, as it does when ``true`` exits
    first): status 141, no traceback."""
    read, write = os.pipe()
    os.close(read)
    try:
        result = _explain_into(write, *args)
    finally:
        os.close(write)
    assert (result.returncode, result.stderr) == (141, "")


def test_a_full_disk_ends_with_one_line_and_status_1():
    """``explain > /dev/full``: every write fails with ENOSPC."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    with open("/dev/full", "w") as full:
        result = _explain_into(full)
    assert result.returncode == 1
    assert result.stderr == "python -m workspace_manager: could not write the output: No space left on device\n"


def test_a_closed_stdout_ends_with_one_line_and_status_1():
    """``explain >&-``: Python starts with no sys.stdout."""
    result = subprocess.run(["sh", "-c", 'exec "$0" -m workspace_manager explain >&-', sys.executable],
                            stderr=subprocess.PIPE, text=True, timeout=120)
    assert (result.returncode, result.stderr) == (
        1, "python -m workspace_manager: stdout is closed; nothing was written\n")


# -- the module kinds the legend names -------------------------------------------------------
@pytest.fixture
def no_kinds(monkeypatch):
    """The core's registry of module kinds, empty for the test (put back after it)."""
    import workspace_manager._explain as data

    monkeypatch.setattr(data, "_MODULE_KINDS", {})
    return data


def _modules_line(out: str) -> str:
    legend = out.rpartition("\nlegend:\n")[2]
    return " ".join(legend.partition("  modules  ")[2].split())


def test_without_a_binding_the_legend_says_no_module_kind_was_registered(capsys, no_kinds):
    main(["explain", "--policy", "fsdp2"])
    assert _modules_line(capsys.readouterr().out) == (
        "every module call alike: a plan depends on the call, not on the module kind (no binding has registered "
        "its module kinds in this process)")


def test_the_legend_names_the_module_kinds_the_binding_registers(capsys, monkeypatch, no_kinds):
    """te_integration registers every kind it manages when imported, te.ops's included."""
    from _binding_standin import load_binding
    from _fake_te import compat

    kinds = load_binding(monkeypatch, compat(), "runtime._kind_registry", "kinds")["runtime._kind_registry"]
    kinds.register_with_explain()  # as te_integration's __init__ does, once every kind registered
    assert [k.name for k in no_kinds.registered_module_kinds()] == [
        "Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear", "te.ops.BasicLinear", "te.ops.GroupedLinear"]
    main(["explain", "--policy", "fsdp2"])
    out = capsys.readouterr().out
    assert _modules_line(out) == (
        "Linear, LayerNormLinear, LayerNormMLP, GroupedLinear, te.ops.BasicLinear and te.ops.GroupedLinear calls "
        "alike (GroupedLinear and te.ops.GroupedLinear: one plan for all experts)")
    lines = out.splitlines()
    assert len(lines) <= 40 and max(map(len, lines)) <= 80  # still one screen


def test_registering_a_module_kind_again_replaces_its_note_in_its_place(no_kinds):
    from workspace_manager import ContextTypeError
    from workspace_manager.extending import ModuleKindEntry, register_module_kind, registered_module_kinds

    register_module_kind("A")
    register_module_kind("B", "two weights")
    register_module_kind("A", "one plan")
    assert registered_module_kinds() == (ModuleKindEntry("A", "one plan"), ModuleKindEntry("B", "two weights"))
    for bad in [dict(name=""), dict(name=3), dict(name="C", note=None)]:
        with pytest.raises(ContextTypeError, match="register_module_kind"):
            register_module_kind(**bad)


def test_a_policy_shows_the_recompute_passes_it_plans_whatever_its_label():
    """The table's settings follow ``recompute_passes``, not the label."""
    from dataclasses import dataclass

    from workspace_manager import RecomputePass, RecomputeWorkspacePolicy, WorkspacePolicy
    from workspace_manager._explain import _contexts

    @dataclass(frozen=True)
    class Relabelled(RecomputeWorkspacePolicy):
        label = "renamed"

    @dataclass(frozen=True)
    class Misleading(WorkspacePolicy):
        label = "recompute"

    caps = RECIPE_PROFILES["Float8CurrentScaling"]
    assert {c.recompute for c in _contexts(Relabelled(), caps, False)} == {RecomputePass.FIRST, RecomputePass.RECOMPUTE}
    assert {c.recompute for c in _contexts(Misleading(), caps, False)} == {RecomputePass.NONE}


def test_explain_in_python_prints_what_the_command_prints(capsys):
    """``workspace_manager.explain`` is the command's table, from Python: the
    same options (names in any case, one or several), the same text."""
    from workspace_manager import explain

    main(["explain", "--policy", "fsdp2", "--policy", "lean", "--recipe", "MXFP8BlockScaling", "--why", "--width", "100"])
    assert explain(["FSDP2", "lean"], "mxfp8blockscaling", why=True, width=100) == capsys.readouterr().out
    main(["explain", "--json", "--quantizer", "float8_block_1d", "--full"])
    assert explain(quantizer="FLOAT8_BLOCK_1D", full=True, as_json=True) == capsys.readouterr().out
    main(["explain"])
    assert explain() == capsys.readouterr().out


def test_explain_in_python_refuses_unknown_names_with_the_packages_errors():
    from workspace_manager import UnknownPolicyError, UnknownRecipeError, explain
    from workspace_manager.extending import UnknownProfileError

    with pytest.raises(UnknownPolicyError, match="no shipped policy is named 'fsdp3'.*did you mean 'fsdp2'"):
        explain("fsdp3")
    with pytest.raises(UnknownRecipeError, match="'mxfp8' is no TE recipe; choose from DelayedScaling"):
        explain(recipe="mxfp8")  # a profile's name, not a recipe's
    with pytest.raises(UnknownProfileError, match="'fp8' is no capability profile or TE recipe; choose from "):
        explain(quantizer="fp8")
    with pytest.raises(TypeError, match=r"explain: recipe must be a name or names \(str\); received 3 \(int\)"):
        explain(recipe=[3])
    with pytest.raises(ValueError, match="width must be an int of at least 80 columns; received 79"):
        explain(width=79)


@pytest.mark.parametrize("argv0, prog", [
    ("/venv/bin/workspace-manager", "workspace-manager"),
    ("/src/workspace_manager/__main__.py", "python -m workspace_manager"),
])
def test_errors_name_the_program_as_it_was_started(argv0, prog):
    """The console script's errors and usage say ``workspace-manager``, not
    ``python -m workspace_manager``. Run as the script runs: ``main()``
    with ``sys.argv[0]`` the script's path."""
    code = ("import sys; sys.argv[0] = sys.argv.pop(1); "
            "from workspace_manager.__main__ import main; sys.exit(main())")
    bad = subprocess.run([sys.executable, "-c", code, argv0, "explain", "--policy", "nope"], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.splitlines()[-1].startswith(
        f"{prog} explain: error: argument --policy: invalid choice: 'nope' is no policy")
    assert bad.stderr.startswith(f"usage: {prog} explain [-h]")
    none = subprocess.run([sys.executable, "-c", code, argv0], capture_output=True, text=True, timeout=120)
    assert none.stderr.splitlines()[-1] == f"{prog}: error: choose a subcommand: explain (e.g. '{prog} explain')"


def test_the_console_script_is_main():
    from pathlib import Path

    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    scripts = pyproject.split("\n[project.scripts]\n", 1)[1].split("\n[", 1)[0]
    assert scripts.strip() == 'workspace-manager = "workspace_manager.__main__:main"'
