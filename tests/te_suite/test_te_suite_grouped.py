"""tests.te_suite and GroupedLinear, on CPU over the TE stand-in of
``test_te_suite.py``: the plugin swaps ``GroupedLinear`` where TE binds it
(and leaves ``te.ops.GroupedLinear`` alone), ``--swap`` names fewer classes
and the record says which, a drop-in run that did not rebind a name it was
to swap proves nothing, and TE's grouped test files can be selected
(``--grouped``, ``--files test_grouped_linear.py``, ``test_sanity.py -k grouped``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.te_suite import harness, plugin, report  # noqa: E402
from tests.te_suite.test_te_suite import _FAKE, _harness, _plan, _tests_dir, _tree  # noqa: E402

Variant = report.Variant
_GROUPED_TESTS = {
    "test_grouped.py": """
        from transformer_engine.pytorch import GroupedLinear
        import transformer_engine.pytorch as te
        def test_experts():
            assert GroupedLinear(4).num_gemms == 4
        def test_kind():
            assert GroupedLinear(2).kind == "stock"
        def test_public_name_is_the_imported_one():
            assert te.GroupedLinear is GroupedLinear
        def test_the_fusible_op_is_never_swapped():
            assert te.ops.GroupedLinear.kind == "op"
    """,
}


@pytest.fixture(scope="module")
def grouped_standin(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("te_suite_grouped")
    return _tree(root / "fake", _FAKE), _tree(root / "tests", _GROUPED_TESTS)


def test_the_drop_in_run_swaps_grouped_linear_where_te_binds_it(grouped_standin, tmp_path):
    result, data = _harness(grouped_standin, tmp_path / "out", "--files", "test_grouped.py",
                            "--dropins", "fake_dropins")
    assert result.returncode == 1, result.stdout + result.stderr
    assert [(d["test"], d["stock"]["outcome"], d["dropin"]["outcome"]) for d in data["differences"]] == [
        ("test_grouped::test_kind", "passed", "failed")]  # the others pass in both
    stock, dropin = data["runs"]
    pt = "transformer_engine.pytorch"
    grouped = {(r["module"], r["after"]) for r in dropin["record"]["rebound"] if r["name"] == "GroupedLinear"}
    assert grouped == {(pt, "fake_dropins.GroupedLinear"), (f"{pt}.module", "fake_dropins.GroupedLinear")}
    assert dropin["record"]["swap"] == list(plugin.CLASS_HOMES)
    assert dropin["record"]["constructed"] == {"GroupedLinear": 2}
    assert dropin["record"]["test_modules"] == {"checked": 1, "bound": {"GroupedLinear": 1}}
    assert stock["record"]["rebound"] == [] and "swap" not in stock["record"]


def test_swap_leaves_the_names_it_does_not_name_to_te(grouped_standin, tmp_path):
    dense = "Linear,LayerNormLinear,LayerNormMLP"
    result, data = _harness(grouped_standin, tmp_path / "out", "--files", "test_grouped.py",
                            "--dropins", "fake_dropins", "--swap", dense)
    assert result.returncode == 0, result.stdout + result.stderr
    assert data["verdict"] == "IDENTICAL"
    dropin = data["runs"][1]["record"]
    assert dropin["swap"] == dense.split(",")
    assert "GroupedLinear" not in {r["name"] for r in dropin["rebound"]}
    assert dropin["test_modules"]["bound"] == {"GroupedLinear": 1}  # TE's own class, as expected
    assert data["swap"] == dense and "--swap" in data["command"]


def test_swap_names_are_checked_and_put_in_table_order():
    assert plugin.swap_names("GroupedLinear, Linear") == ("Linear", "GroupedLinear")
    with pytest.raises(plugin.SwapError, match="choose from"):
        plugin.swap_names("Linear,Conv")
    with pytest.raises(plugin.SwapError):
        plugin.swap_names(" , ")


def test_a_drop_in_run_that_did_not_rebind_a_name_it_swaps_proves_nothing():
    record = {"swap": ["Linear", "GroupedLinear"], "test_modules": {"checked": 1, "bound": {}},
              "rebound": [{"module": "transformer_engine.pytorch", "name": "Linear", "before": "a", "after": "b"}]}
    stock = report.Run(group="g.py", variant=Variant.STOCK, status=report.RunStatus.COMPLETED,
                       results={"t": report.CaseResult(report.Outcome.PASSED)})
    dropin = report.Run(**{**stock.__dict__, "variant": Variant.DROPIN, "record": record})
    comparison = report.compare([(stock, dropin)])
    assert comparison.verdict is report.Verdict.INCOMPLETE
    assert comparison.problems == ("g.py: the drop-in run's record shows GroupedLinear not rebound",)


# -- selecting TE's grouped tests ---------------------------------------------------------
def _folder(tmp_path: Path) -> list[str]:
    names = {e.path if e.path.endswith(".py") else f"{e.path}/test_x.py" for e in (*harness.FULL, *harness.GROUPED)}
    return ["--out", str(tmp_path / "o"), "--tests-dir", str(_tests_dir(tmp_path / "t", sorted(names)))]


def test_grouped_selects_the_grouped_linear_file_and_the_grouped_cases(tmp_path):
    entries = _plan([*_folder(tmp_path), "--grouped"]).entries
    assert entries == harness.GROUPED
    assert [(e.path, e.select) for e in entries[:2]] == [("test_grouped_linear.py", ""), ("test_sanity.py", "grouped")]


def test_the_grouped_files_can_be_chosen_one_by_one(tmp_path):
    out = _folder(tmp_path)
    [whole] = _plan([*out, "--files", "test_grouped_linear.py"]).entries
    assert (whole.path, whole.select, whole.launcher) == ("test_grouped_linear.py", "", harness.Launcher.PYTEST)
    [sanity] = _plan([*out, "--files", "test_sanity.py", "-k", "grouped"]).entries
    assert (sanity.path, sanity.select) == ("test_sanity.py", "grouped")
    [by_table] = _plan([*out, "--grouped", "--files", "test_sanity.py"]).entries
    assert by_table.select == "grouped"  # the chosen table's selection wins
    assert any(e.path == "test_grouped_linear.py" for e in harness.FULL)


@pytest.mark.parametrize(("extra", "message"), [
    (["--swap", "Linear,Conv"], "choose from Linear"),
    (["--quick", "--grouped"], "not allowed with argument"),
])
def test_bad_swaps_and_two_tables_are_usage_errors(tmp_path, capsys, extra, message):
    with pytest.raises(SystemExit) as exc:
        _plan([*_folder(tmp_path), *extra])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_the_pytest_command_passes_the_swap_on_only_when_given(tmp_path):
    entry = harness.Entry("test_grouped_linear.py")
    plain = harness.pytest_command(entry, Variant.DROPIN, tmp_path, tmp_path, "te_integration")
    assert "--te-suite-swap" not in plain
    named = harness.pytest_command(entry, Variant.DROPIN, tmp_path, tmp_path, "te_integration", swap="GroupedLinear")
    assert named[named.index("--te-suite-swap") + 1] == "GroupedLinear"
