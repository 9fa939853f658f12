"""tests.te_suite on CPU: JUnit parsing, the stock/drop-in comparison,
its summary, the selection and the argument errors, the plugin's swap, and
whole runs of the harness over a tiny TE stand-in written to disk (no TE,
no CUDA): a drop-in that changes one test's outcome, a test that hangs past
the timeout, and drop-ins that cannot replace TE's classes. The
GroupedLinear swap and its selections are in ``test_te_suite_grouped.py``,
over the same stand-in."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.te_suite import harness, plugin, report  # noqa: E402

CaseResult, Outcome, Run, RunStatus = report.CaseResult, report.Outcome, report.Run, report.RunStatus
Variant, Verdict, EXAMPLES = report.Variant, report.Verdict, report.EXAMPLES
P, F, E, S, XF = Outcome.PASSED, Outcome.FAILED, Outcome.ERROR, Outcome.SKIPPED, Outcome.XFAILED
SWAPPED = {"rebound": [{"module": "transformer_engine.pytorch", "name": "Linear", "before": "te.Linear",
                        "after": "te_integration.Linear"}], "test_modules": {"checked": 1, "bound": {"Linear": 1}},
           "constructed": {"Linear": 3}}


# -- JUnit ---------------------------------------------------------------------------
JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites name="pytest tests"><testsuite name="pytest" tests="8">
 <testcase classname="test_a" name="test_pass" time="0.5" />
 <testcase classname="test_a" name="test_fail[x-1]" time="1.0"><failure message="AssertionError: 1 != 2">trace</failure></testcase>
 <testcase classname="test_a" name="test_setup_error"><error message="failed on setup with &quot;boom&quot;">t</error></testcase>
 <testcase classname="test_a" name="test_skip"><skipped type="pytest.skip" message="needs sm_100">f.py:3: needs sm_100</skipped></testcase>
 <testcase classname="test_a" name="test_xfail"><skipped type="pytest.xfail" message="known issue" /></testcase>
 <testcase classname="test_a" name="test_xpass"><skipped message="xfail-marked test passes unexpectedly" /></testcase>
 <testcase classname="dir.test_b.TestC" name="test_fail_and_teardown"><failure message="bad" /><error message="td" /></testcase>
 <testcase time="0.000" />
</testsuite></testsuites>
"""


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_junit_outcomes_messages_and_times(tmp_path):
    results = report.parse_junit(_write(tmp_path / "j.xml", JUNIT))
    assert {k: r.outcome for k, r in results.items()} == {
        "test_a::test_pass": P, "test_a::test_fail[x-1]": F, "test_a::test_setup_error": E,
        "test_a::test_skip": S, "test_a::test_xfail": XF, "test_a::test_xpass": Outcome.XPASSED,
        "dir.test_b.TestC::test_fail_and_teardown": F,  # the call failed; its teardown error does not hide that
    }  # the nameless <testcase/> an interrupted run leaves is not a test
    assert results["test_a::test_fail[x-1]"] == CaseResult(F, "AssertionError: 1 != 2", 1.0)
    assert results["test_a::test_skip"].message == "needs sm_100"
    assert results["test_a::test_xfail"].message == "known issue"


def test_junit_bare_testsuite_root_and_repeated_ids(tmp_path):
    xml = ('<testsuite><testcase classname="m" name="t" /><testcase classname="m" name="t">'
           '<failure message="second" /></testcase></testsuite>')
    assert report.parse_junit(_write(tmp_path / "j.xml", xml)) == {"m::t": CaseResult(F, "second")}


def test_junit_rejects_what_is_not_junit(tmp_path):
    with pytest.raises(ValueError, match="not valid XML"):
        report.parse_junit(_write(tmp_path / "cut.xml", "<testsuites><testsuite><testcase"))
    with pytest.raises(ValueError, match="root is <html>"):
        report.parse_junit(_write(tmp_path / "page.xml", "<html/>"))


@pytest.mark.parametrize(("nodeid", "case"), [
    ("test_numerics.py::test_linear[a-b]", "test_numerics::test_linear[a-b]"),
    ("layernorm_mlp/test_sac.py::TestC::test_x[p::q/r.py]", "layernorm_mlp.test_sac.TestC::test_x[p::q/r.py]"),
])
def test_node_ids_map_to_junit_ids(nodeid, case):
    assert report.case_id_of_node(nodeid) == case


def test_ranks_merge_with_any_failure_winning():
    merged = report.merge_ranks([{"t": CaseResult(P), "u": CaseResult(S, "r")},
                          {"t": CaseResult(F, "rank 1"), "v": CaseResult(P)}])
    assert merged == {"t": CaseResult(F, "rank 1"), "u": CaseResult(S, "r"), "v": CaseResult(P)}


# -- comparison ------------------------------------------------------------------------
def _run(variant: Variant, outcomes: dict, status: RunStatus = RunStatus.COMPLETED, group: str = "test_a.py",
         record: dict | None = None, **kw) -> Run:
    results = {t: o if isinstance(o, CaseResult) else CaseResult(o) for t, o in outcomes.items()}
    if record is None and variant is Variant.DROPIN:
        record = SWAPPED
    return Run(group=group, variant=variant, status=status, results=results, record=record, **kw)


def _pair(stock: dict, dropin: dict, **kw) -> tuple[Run, Run]:
    return _run(Variant.STOCK, stock), _run(Variant.DROPIN, dropin, **kw)


def test_identical_outcomes_including_common_failures_are_identical():
    same = {"t1": P, "t2": F, "t3": CaseResult(S, "needs sm_100")}
    comparison = report.compare([_pair(same, same)])
    assert comparison.verdict is Verdict.IDENTICAL and comparison.verdict.value == 0
    assert comparison.totals(Variant.DROPIN) == {"passed": 1, "failed": 1, "error": 0, "skipped": 1,
                                                 "xfailed": 0, "xpassed": 0}


@pytest.mark.parametrize(("stock", "dropin"), [(P, F), (F, P), (P, S), (XF, F), (P, E)])
def test_any_changed_outcome_is_a_difference(stock, dropin):
    comparison = report.compare([_pair({"t": P, "u": stock}, {"t": P, "u": dropin})])
    assert comparison.verdict is Verdict.DIFFERENT and comparison.verdict.value == 1
    [diff] = comparison.differences
    assert (diff.test, diff.stock.outcome, diff.dropin.outcome) == ("u", stock, dropin)


def test_a_test_only_one_complete_run_has_is_a_difference():
    comparison = report.compare([_pair({"t": P, "gone": P}, {"t": P})])
    [diff] = comparison.differences
    assert (diff.test, diff.stock.outcome, diff.dropin) == ("gone", P, None)


def test_tests_missing_from_a_timed_out_run_make_it_incomplete_not_different():
    comparison = report.compare([_pair({"t": P, "later": P}, {"t": P}, status=RunStatus.TIMED_OUT, interrupted="x::y")])
    assert comparison.verdict is Verdict.INCOMPLETE and comparison.verdict.value == 3
    assert [d.test for d in comparison.unmatched] == ["later"] and not comparison.differences
    assert comparison.problems == ("test_a.py (dropin): timed out, stopped in x::y",)


@pytest.mark.parametrize(("record", "why"), [
    ({}, "no name rebound"), ({"error": "SwapError: nope", "rebound": []}, "the swap failed: SwapError: nope"),
])
def test_a_drop_in_run_without_a_proven_swap_is_incomplete(record, why):
    stock, dropin = _pair({"t": P}, {"t": P})
    comparison = report.compare([(stock, Run(**{**dropin.__dict__, "record": record}))])
    assert comparison.verdict is Verdict.INCOMPLETE
    assert any(why in p for p in comparison.problems), comparison.problems


def test_a_drop_in_run_without_record_and_an_empty_run_are_incomplete():
    stock, dropin = _pair({"t": P}, {"t": P})
    no_record = Run(**{**dropin.__dict__, "record": None})
    assert "left no record" in report.compare([(stock, no_record)]).problems[0]
    assert report.compare([_pair({}, {})]).problems == ("no test ran in either variant",)


def test_skips_and_xfails_are_grouped_by_reason_with_counts():
    stock = {f"s{i}": CaseResult(S, "needs sm_100") for i in range(EXAMPLES + 5)}
    stock |= {"x": CaseResult(XF, "known"), "y": CaseResult(S, "no artifact")}
    dropin = {**stock, "y": CaseResult(P)}
    rows = report.reasons(report.compare([_pair(stock, dropin)]))
    assert [(r["kind"], r["reason"], r["stock"], r["dropin"]) for r in rows] == [
        ("skipped", "needs sm_100", EXAMPLES + 5, EXAMPLES + 5), ("xfailed", "known", 1, 1),
        ("skipped", "no artifact", 1, 0)]
    assert len(rows[0]["examples"]) == EXAMPLES


def test_failures_shared_by_both_variants_are_grouped_by_their_first_line():
    cuda = "RuntimeError: rtc.cpp:137: CUDA Error: invalid device context\n  more detail"
    stock = {"a": CaseResult(F, cuda), "b": CaseResult(F, cuda), "c": CaseResult(P)}
    rows = report.reasons(report.compare([_pair(stock, dict(stock))]))
    assert [(r["kind"], r["reason"], r["stock"], r["dropin"]) for r in rows] == [
        ("failed", "RuntimeError: rtc.cpp:137: CUDA Error: invalid device context", 2, 2)]


def test_summary_and_json_say_what_differs_and_why_tests_skipped():
    skip = CaseResult(S, "needs sm_100")
    failed = CaseResult(F, "Tensor-likes are not equal")
    comparison = report.compare([_pair({"t": P, "s": skip}, {"t": failed, "s": skip})])
    meta = {"command": "python3 -m tests.te_suite --tests-dir DIR", "environment": {"te": "2.20.2"}}
    summary = report.render_summary(comparison, meta)
    assert "**Verdict: DIFFERENT**" in summary
    assert "| test_a.py | t | passed | failed: Tensor-likes are not equal |" in summary
    assert "| skipped | needs sm_100 | 1 | 1 | s |" in summary
    assert "te_integration.Linear" in summary  # the swap's record
    data = json.loads(json.dumps(report.comparison_json(comparison, meta)))
    assert (data["verdict"], data["exit_status"]) == ("DIFFERENT", 1)
    assert data["differences"] == [{"group": "test_a.py", "test": "t", "stock": {"outcome": "passed", "message": ""},
                                    "dropin": {"outcome": "failed", "message": "Tensor-likes are not equal"}}]
    assert data["totals"]["stock"]["skipped"] == 1


# -- selection and arguments -------------------------------------------------------
def _tests_dir(root: Path, names=("test_sanity.py", "test_numerics.py")) -> Path:
    for name in names:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("")
    return root


def _plan(argv: list[str]) -> harness.Plan:
    parser = harness.build_parser()
    return harness.plan_from_args(parser, parser.parse_args(argv))


@pytest.mark.parametrize(("argv", "message"), [
    (["--tests-dir", "{missing}"], "no such folder"),
    (["--tests-dir", "{dir}"], "lacks test_grouped_linear.py, test_cuda_graphs.py"),  # the full table, two files
    (["--tests-dir", "{dir}", "--files", "../test_x.py"], "paths inside --tests-dir"),
    (["--tests-dir", "{dir}", "--files", "test_sanity.py", "--nproc", "0"], "--nproc must be >= 1"),
    (["--tests-dir", "{dir}", "--files", "test_sanity.py", "--max-minutes", "0"], "must be positive"),
])
def test_argument_errors_exit_2_with_a_clear_message(tmp_path, capsys, argv, message):
    folder = _tests_dir(tmp_path / "tests")
    argv = [a.format(missing=tmp_path / "nowhere", dir=folder) for a in argv] + ["--out", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as exc:
        _plan(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_out_is_required(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        harness.build_parser().parse_args(["--tests-dir", str(tmp_path)])
    assert exc.value.code == 2 and "--out" in capsys.readouterr().err


def test_selection_table_files_and_k(tmp_path):
    folder = _tests_dir(tmp_path / "t", [e.path if e.path.endswith(".py") else f"{e.path}/test_x.py"
                                          for e in harness.FULL])
    out = ["--out", str(tmp_path / "o"), "--tests-dir", str(folder)]
    assert _plan(out).entries == harness.FULL
    assert _plan([*out, "--quick"]).entries == harness.QUICK
    sanity, numerics = _plan([*out, "--files", "test_sanity.py", "test_numerics.py", "--quick"]).entries
    assert sanity.select == "(linear or mlp) and not grouped"  # not in QUICK: the full table's
    assert numerics == next(e for e in harness.QUICK if e.path == "test_numerics.py")
    chosen = _plan([*out, "--files", "test_sanity.py", "layernorm_mlp/", "-k", "fp8"]).entries
    assert [(e.path, e.select) for e in chosen] == [("test_sanity.py", "fp8"), ("layernorm_mlp", "fp8")]
    (folder / "fsdp2" / "run_other.py").write_text("")
    [other] = _plan([*out, "--files", "fsdp2/run_other.py"]).entries
    assert other.launcher is harness.Launcher.TORCHRUN and other.select == ""


def test_quick_is_a_subset_of_the_files_the_full_run_covers():
    full = {e.path for e in harness.FULL}
    assert {e.path for e in harness.QUICK} <= full
    assert [e for e in harness.FULL if e.launcher is harness.Launcher.TORCHRUN] == [
        harness.Entry("fsdp2/run_fsdp2_mem_leak.py", "", harness.Launcher.TORCHRUN)]


def test_pytest_command_isolates_the_copy_and_loads_the_plugin(tmp_path):
    entry = harness.Entry("test_numerics.py", "linear and not grouped")
    cmd = harness.pytest_command(entry, Variant.DROPIN, tmp_path / "run", tmp_path / "pytorch", "te_integration")
    assert cmd[:4] == [sys.executable, "-m", "pytest", "test_numerics.py"]
    joined = " ".join(cmd)
    for part in ("-p tests.te_suite.plugin", "--te-suite-variant dropin", f"-c {tmp_path}/pytorch/pytest.ini",
                 f"--rootdir {tmp_path}/pytorch", f"--junitxml {tmp_path}/run/junit.xml"):
        assert part in joined
    assert cmd[-2:] == ["-k", "linear and not grouped"]
    fsdp2 = harness.Entry("fsdp2/run_fsdp2_mem_leak.py", launcher=harness.Launcher.TORCHRUN)
    cmd = harness.pytest_command(fsdp2, Variant.STOCK, tmp_path, tmp_path, "te_integration", nproc=2)
    assert cmd[1:7] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "pytest"]
    assert "-k" not in cmd


def test_child_env_has_the_repository_and_no_outside_pytest_options(monkeypatch):
    monkeypatch.setenv("PYTEST_ADDOPTS", "-x")
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    env = harness.child_env()
    assert "PYTEST_ADDOPTS" not in env
    assert env["PYTHONPATH"].split(":") == [str(ROOT), "/elsewhere"]


@pytest.mark.parametrize("form", ["split", "joined"])
def test_the_recorded_command_names_no_local_path(form):
    argv = (["--tests-dir", "/home/me/te/tests/pytorch", "--out", "/tmp/o", "--quick"] if form == "split"
            else ["--tests-dir=/home/me/te/tests/pytorch", "--out=/tmp/o", "--quick"])
    command = harness.redacted_command(argv)
    assert "/home/me" not in command and "/tmp/o" not in command
    assert command.endswith("--quick") and "DIR" in command and "OUT" in command


def test_the_copy_is_writable_and_has_its_own_config(tmp_path):
    src = _tests_dir(tmp_path / "src", ["test_a.py", "sub/test_b.py"])
    for path in (src / "sub/test_b.py", src / "test_a.py", src / "sub", src):
        path.chmod(0o555 if path.is_dir() else 0o444)
    copy = harness.make_copy(src, tmp_path / "w")
    assert copy.name == "pytorch" and (copy / "sub" / "test_b.py").exists()
    (copy / "sub" / "written_by_a_test.pt").write_text("x")  # would raise on a read-only copy
    assert (copy / "pytest.ini").read_text().startswith("[pytest]")
    for path in (src, src / "sub"):
        path.chmod(0o755)


def test_the_budget_cuts_timeouts_and_stops_starting():
    assert harness._Clock(None).allowance(100.0, 0.5) == 100.0
    roomy = harness._Clock(1000.0).allowance(100.0, 0.5)
    assert roomy == 100.0
    tight = harness._Clock(harness.GRACE_S + 100.0).allowance(1000.0, 0.5)
    assert tight is not None and 45.0 < tight <= 50.0
    assert harness._Clock(harness.GRACE_S + 10.0).allowance(1000.0, 1.0) is None


# -- the plugin's swap --------------------------------------------------------------
class _Stock:
    pass


class _Other:
    pass


def _namespaces(**extra) -> dict[str, types.ModuleType]:
    public, mha, empty = types.ModuleType("tep"), types.ModuleType("mha"), types.ModuleType("empty")
    public.Linear = mha.Linear = _Stock
    for name, value in extra.items():
        setattr(mha, name, value)
    return {"tep": public, "empty": empty, "mha": mha}


def test_rebind_points_every_namespace_holding_the_stock_class_at_the_drop_in():
    class DropIn(_Stock):
        pass

    namespaces = _namespaces()
    done = plugin.rebind(namespaces, {"Linear": _Stock}, {"Linear": DropIn})
    assert [(r.module, r.name) for r in done] == [("tep", "Linear"), ("mha", "Linear")]
    assert namespaces["tep"].Linear is DropIn and namespaces["mha"].Linear is DropIn
    assert not hasattr(namespaces["empty"], "Linear")
    plugin.check_bound(namespaces, {"Linear": DropIn})
    with pytest.raises(plugin.SwapError, match="expected"):
        plugin.check_bound(namespaces, {"Linear": _Stock})


@pytest.mark.parametrize(("namespaces", "dropin", "message"), [
    (_namespaces(), _Other, "is not a subclass"),
    (_namespaces(Linear=_Other), type("DropIn", (_Stock,), {}), "mha.Linear is"),
])
def test_rebind_refuses_and_changes_nothing(namespaces, dropin, message):
    with pytest.raises(plugin.SwapError, match=message):
        plugin.rebind(namespaces, {"Linear": _Stock}, {"Linear": dropin})
    assert namespaces["tep"].Linear is _Stock


def test_a_test_module_that_bound_the_stock_class_is_caught():
    class DropIn(_Stock):
        pass

    early, late, unrelated = (types.ModuleType(n) for n in ("early", "late", "unrelated"))
    early.Linear, late.Linear, unrelated.Linear = _Stock, DropIn, _Other
    assert plugin.check_test_modules([late, unrelated], {"Linear": DropIn}, {"Linear": _Stock}) == {"Linear": 1}
    with pytest.raises(plugin.SwapError, match="test module early bound Linear"):
        plugin.check_test_modules([late, early], {"Linear": DropIn}, {"Linear": _Stock})


# -- whole runs over a TE stand-in ---------------------------------------------------
_FAKE = {
    "transformer_engine/__init__.py": "__version__ = '2.20.0'\n",
    "transformer_engine/pytorch/__init__.py": """
        from transformer_engine.pytorch.module import Linear, LayerNormLinear, LayerNormMLP, GroupedLinear
        from transformer_engine.pytorch import transformer, ops
        from transformer_engine.pytorch.attention import multi_head_attention
    """,
    "transformer_engine/pytorch/module/__init__.py": """
        from .linear import Linear
        from .layernorm_linear import LayerNormLinear
        from .layernorm_mlp import LayerNormMLP
        from .grouped_linear import GroupedLinear
    """,
    "transformer_engine/pytorch/module/grouped_linear.py": """
        class GroupedLinear:
            kind = "stock"
            def __init__(self, num_gemms=1):
                self.num_gemms = num_gemms
    """,
    "transformer_engine/pytorch/ops/__init__.py": """
        class GroupedLinear:  # the fusible operation: another class, never swapped
            kind = "op"
    """,
    "transformer_engine/pytorch/module/linear.py": """
        class Linear:
            kind = "stock"
            def __init__(self, n=1):
                self.n = n
    """,
    "transformer_engine/pytorch/module/layernorm_linear.py": "class LayerNormLinear:\n    pass\n",
    "transformer_engine/pytorch/module/layernorm_mlp.py": "class LayerNormMLP:\n    pass\n",
    "transformer_engine/pytorch/transformer.py": "from transformer_engine.pytorch.module import LayerNormMLP\n",
    "transformer_engine/pytorch/attention/__init__.py": "",
    "transformer_engine/pytorch/attention/multi_head_attention.py":
        "from transformer_engine.pytorch.module import LayerNormLinear, Linear\n",
    "fake_dropins.py": """
        from transformer_engine.pytorch.module import grouped_linear, layernorm_linear, layernorm_mlp, linear
        class Linear(linear.Linear):
            kind = "dropin"
        class GroupedLinear(grouped_linear.GroupedLinear):
            kind = "dropin"
        class LayerNormLinear(layernorm_linear.LayerNormLinear):
            pass
        class LayerNormMLP(layernorm_mlp.LayerNormMLP):
            pass
    """,
    "bad_dropins.py": """
        class Linear:
            pass
        LayerNormLinear = LayerNormMLP = GroupedLinear = Linear
    """,
}
_TESTS = {
    "test_alpha.py": """
        import pytest
        from transformer_engine.pytorch import Linear
        def test_same():
            assert Linear(3).n == 3
        def test_kind():
            assert Linear().kind == "stock"
        @pytest.mark.skip(reason="needs sm_100")
        def test_skipped():
            pass
    """,
    "test_slow.py": """
        import time
        def test_fast():
            pass
        def test_hang():
            time.sleep(600)
    """,
}


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip("\n"))
    return root


@pytest.fixture(scope="module")
def standin(tmp_path_factory) -> tuple[Path, Path]:
    """(folder on PYTHONPATH with the fake TE and drop-ins, tests folder)."""
    root = tmp_path_factory.mktemp("te_suite")
    return _tree(root / "fake", _FAKE), _tree(root / "tests", _TESTS)


def _harness(standin, out: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    fake, tests = standin
    env = {"PYTHONPATH": str(fake), "PATH": "/usr/bin:/bin", "HOME": str(out.parent)}
    result = subprocess.run([sys.executable, "-m", "tests.te_suite", "--tests-dir", str(tests), "--out", str(out),
                             *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    data = json.loads((out / "comparison.json").read_text()) if (out / "comparison.json").exists() else {}
    return result, data


def test_a_run_finds_the_test_whose_outcome_the_drop_in_changes(standin, tmp_path):
    stale = tmp_path / "out" / "runs" / "00-test_alpha" / "dropin"  # an earlier run's rank-1 file: not read
    stale.mkdir(parents=True)
    (stale / "junit.rank1.xml").write_text('<testsuite><testcase classname="old" name="t"><failure/></testcase></testsuite>')
    result, data = _harness(standin, tmp_path / "out", "--files", "test_alpha.py", "--dropins", "fake_dropins")
    assert result.returncode == 1, result.stdout + result.stderr
    assert data["verdict"] == "DIFFERENT"
    assert [(d["test"], d["stock"]["outcome"], d["dropin"]["outcome"]) for d in data["differences"]] == [
        ("test_alpha::test_kind", "passed", "failed")]
    assert data["totals"]["stock"] == {"passed": 2, "failed": 0, "error": 0, "skipped": 1, "xfailed": 0, "xpassed": 0}
    stock, dropin = data["runs"]
    assert stock["record"]["variant"] == "stock" and stock["record"]["rebound"] == []
    pt = "transformer_engine.pytorch"
    assert {(r["module"], r["name"]) for r in dropin["record"]["rebound"]} == {
        (pt, "Linear"), (f"{pt}.module", "Linear"), (f"{pt}.attention.multi_head_attention", "Linear"),
        (pt, "LayerNormLinear"), (f"{pt}.module", "LayerNormLinear"),
        (f"{pt}.attention.multi_head_attention", "LayerNormLinear"),
        (pt, "LayerNormMLP"), (f"{pt}.module", "LayerNormMLP"), (f"{pt}.transformer", "LayerNormMLP"),
        (pt, "GroupedLinear"), (f"{pt}.module", "GroupedLinear")}
    assert dropin["record"]["test_modules"] == {"checked": 1, "bound": {"Linear": 1}}
    assert dropin["record"]["constructed"] == {"Linear": 2}
    assert data["skip_reasons"][0]["reason"] == "needs sm_100"
    assert "**Verdict: DIFFERENT**" in (tmp_path / "out" / "summary.md").read_text()
    assert str(standin[1]) not in (tmp_path / "out" / "summary.md").read_text()
    log = (tmp_path / "out" / "runs" / "00-test_alpha" / "dropin" / "pytest.log").read_text()
    assert "te_suite dropin: 11 names rebound to fake_dropins's classes" in log


#: Long enough for a pytest of the stand-in (no torch: about half a second)
#: to pass its first test and start the hanging one on a loaded machine.
_HANG_TIMEOUT_S = 6


def test_a_hanging_test_times_out_and_the_rest_still_counts(standin, tmp_path):
    # Both variants at once (--parallel): the test waits one timeout, not two.
    result, data = _harness(standin, tmp_path / "out", "--files", "test_slow.py", "--dropins", "fake_dropins",
                            "--timeout", str(_HANG_TIMEOUT_S), "--parallel")
    assert result.returncode == 3, result.stdout + result.stderr
    assert data["verdict"] == "INCOMPLETE" and not data["differences"]
    for run in data["runs"]:
        assert (run["status"], run["interrupted"], run["counts"]) == ("timed out", "test_slow.py::test_hang",
                                                                       {"passed": 1})
        assert _HANG_TIMEOUT_S <= run["seconds"] < _HANG_TIMEOUT_S + harness.GRACE_S


def test_drop_ins_that_cannot_replace_te_fail_the_run_loudly(standin, tmp_path):
    result, data = _harness(standin, tmp_path / "out", "--files", "test_alpha.py", "--dropins", "bad_dropins")
    assert result.returncode == 3, result.stdout + result.stderr
    stock, dropin = data["runs"]
    assert stock["status"] == "completed" and dropin["status"] == "crashed"
    assert "is not a subclass" in dropin["record"]["error"]
    assert any("the swap failed" in p for p in data["problems"])
    log = (tmp_path / "out" / "runs" / "00-test_alpha" / "dropin" / "pytest.log").read_text()
    assert "te_suite dropin" in log and "is not a subclass" in log


def test_under_torchrun_each_rank_writes_its_own_files(standin, tmp_path, monkeypatch):
    fake, tests = standin
    monkeypatch.setenv("PYTHONPATH", str(fake))
    monkeypatch.setenv("RANK", "0")
    entry = harness.Entry("test_alpha.py")
    copy = harness.make_copy(tests, tmp_path / "w")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cmd = harness.pytest_command(entry, Variant.DROPIN, run_dir, copy, "fake_dropins")
    rc, seconds, timed_out = harness.run_process(cmd, copy, run_dir / "pytest.log", 120)
    assert (rc, timed_out) == (0, False)  # a test failed (exit 1), but torchrun must not stop the other ranks
    assert {p.name for p in run_dir.iterdir()} == {"junit.rank0.xml", "record.rank0.json", "started.rank0.txt",
                                                   "pytest.log"}
    run = harness.collect_run(entry, Variant.DROPIN, run_dir, rc, seconds, timed_out, ranks=1)
    assert run.status is RunStatus.COMPLETED and run.record["rank"] == "0" and run.record["exitstatus"] == 1
    assert run.results["test_alpha::test_kind"].outcome is F


def test_parallel_gives_the_sequential_comparison(standin, tmp_path):
    result, data = _harness(standin, tmp_path / "out", "--files", "test_alpha.py", "--dropins", "fake_dropins",
                            "--parallel")
    assert result.returncode == 1, result.stdout + result.stderr
    assert [(d["test"], d["stock"]["outcome"], d["dropin"]["outcome"]) for d in data["differences"]] == [
        ("test_alpha::test_kind", "passed", "failed")]


def test_parallel_starts_the_drop_in_run_before_the_stock_run_ends(monkeypatch, tmp_path):
    """Each variant waits for the other to have started: run one after the
    other, the barrier times out and the test fails."""
    import threading

    barrier = threading.Barrier(2, timeout=10)

    def run_variant(plan, index, entry, variant, copy, ranks, timeout):
        barrier.wait()
        return harness._not_run(entry, variant, "stand-in")

    monkeypatch.setattr(harness, "_run_variant", run_variant)
    entry = harness.Entry("test_alpha.py")
    plan = harness.Plan(tmp_path, (entry,), tmp_path / "out", 60.0, None, None, "x", parallel=True)
    stock, dropin = harness.run_entry(plan, 0, entry, {v: tmp_path for v in harness.Variant}, 0,
                                      harness._Clock(None))
    assert (stock.variant, dropin.variant) == (harness.Variant.STOCK, harness.Variant.DROPIN)
