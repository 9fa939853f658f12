"""The te.ops part of the TE-suite swap (``--ops``, ``--te-suite-ops``), on CPU:
the harness's selection and command, and the rebinding against stand-in
te.ops modules."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.te_suite import harness, ops_swap, plugin, report  # noqa: E402

_OPS = "transformer_engine.pytorch.ops"


def _plan(argv: list[str]) -> harness.Plan:
    parser = harness.build_parser()
    return harness.plan_from_args(parser, parser.parse_args(argv))


def test_ops_selects_the_fusible_ops_files_with_the_ops_swapped(tmp_path):
    for name in ("test_fusible_ops.py", "test_grouped_mlp.py"):
        (tmp_path / name).write_text("")
    out = ["--out", str(tmp_path / "o"), "--tests-dir", str(tmp_path)]
    assert _plan([*out, "--ops"]).entries == harness.OPS
    assert all(e.ops for e in harness.OPS)
    [fusible] = _plan([*out, "--files", "test_fusible_ops.py", "-k", "basic_linear"]).entries
    assert (fusible.select, fusible.ops) == ("basic_linear", True)
    cmd = harness.pytest_command(fusible, report.Variant.DROPIN, tmp_path / "run", tmp_path / "pytorch",
                                 "te_integration")
    assert "--te-suite-ops" in cmd and cmd[-2:] == ["-k", "basic_linear"]
    modules = harness.Entry("test_numerics.py", "linear")
    assert "--te-suite-ops" not in harness.pytest_command(modules, report.Variant.DROPIN, tmp_path, tmp_path, "x")


@pytest.fixture
def fake_ops(monkeypatch):
    """Stand-in te.ops modules holding TE's two classes, and a provider of drop-ins."""
    basic_linear = type("BasicLinear", (), {"__module__": f"{_OPS}.basic.basic_linear"})
    grouped = type("GroupedLinear", (), {"__module__": f"{_OPS}.basic.grouped_linear"})
    homes = {f"{_OPS}.basic.basic_linear": {"BasicLinear": basic_linear},
             f"{_OPS}.basic.grouped_linear": {"GroupedLinear": grouped},
             _OPS: {"BasicLinear": basic_linear, "GroupedLinear": grouped},
             f"{_OPS}.basic": {"BasicLinear": basic_linear, "GroupedLinear": grouped},
             f"{_OPS}.linear": {"BasicLinear": basic_linear}}
    for name, attrs in homes.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, module)
    provider = types.ModuleType("fake_ops_dropins")
    provider.OpsBasicLinear = type("OpsBasicLinear", (basic_linear,), {})
    provider.OpsGroupedLinear = type("OpsGroupedLinear", (grouped,), {})
    monkeypatch.setitem(sys.modules, "fake_ops_dropins", provider)
    return provider


def test_the_ops_names_are_rebound_where_tests_and_te_look_them_up(fake_ops):
    assert ops_swap.swap_ops(None)[0] == []  # stock: checked, nothing changed
    rebound, classes = ops_swap.swap_ops("fake_ops_dropins")
    assert {(r.module, r.name) for r in rebound} == {
        (_OPS, "BasicLinear"), (f"{_OPS}.basic", "BasicLinear"), (f"{_OPS}.linear", "BasicLinear"),
        (_OPS, "GroupedLinear"), (f"{_OPS}.basic", "GroupedLinear")}
    assert sys.modules[f"{_OPS}.linear"].BasicLinear is fake_ops.OpsBasicLinear
    assert classes == {"BasicLinear": fake_ops.OpsBasicLinear, "GroupedLinear": fake_ops.OpsGroupedLinear}
    with pytest.raises(plugin.SwapError, match="expected"):  # stock's check now fails: the names moved
        ops_swap.swap_ops(None)


def test_a_drop_in_that_is_not_a_subclass_is_refused(fake_ops, monkeypatch):
    monkeypatch.setattr(fake_ops, "OpsGroupedLinear", type("Other", (), {}))
    with pytest.raises(plugin.SwapError, match="not a subclass"):
        ops_swap.swap_ops("fake_ops_dropins")
    assert sys.modules[_OPS].BasicLinear.__name__ == "BasicLinear"  # nothing changed
