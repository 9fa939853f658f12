"""The one registry of module kinds (``te_integration.runtime._kind_registry``):
every kind's file registers one ``Adapter``, and conversion, install,
construction, the budget, attribution, explain's legend and the package's
drop-in names take their lists from it."""

from __future__ import annotations

import copy
import pickle

import pytest
from _fake_te import load_full_binding


@pytest.fixture
def ti(monkeypatch):
    return load_full_binding(monkeypatch)


def test_every_kind_made_is_registered_once_with_a_drop_in_of_its_kind(ti):
    adapters = ti.kind_registry.adapters()
    assert {a.kind for a in adapters} == set(ti.kind_registry.ModuleKind.made())
    for adapter in adapters:
        assert adapter.drop_in._wm_kind is adapter.kind and issubclass(adapter.drop_in, adapter.te_class)
        assert ti.kind_registry.adapter_for(adapter.kind) is adapter
        assert (adapter.function is None) != (adapter.op is None)  # a TE module kind or a te.ops kind
    assert ti.kind_registry.drop_ins() == {a.te_class: a.drop_in for a in adapters}
    assert set(ti.kind_registry.OP_HOOKS) == {a.kind for a in adapters if a.op is not None}
    # The package's drop-in names are the kinds' files' own, in the kinds' order.
    assert ti.kinds.__all__ == ["Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear", "OpsBasicLinear",
                                "OpsLinear", "OpsGroupedLinear"]


def test_a_kind_is_one_object_by_its_name_copied_or_pickled_too(ti):
    kind = ti.kind_registry.ModuleKind
    linear = kind("linear")
    assert kind("linear") is linear is ti.kinds.Linear._wm_kind
    assert copy.deepcopy(linear) is linear and pickle.loads(pickle.dumps(linear)) is linear
    state = ti.state.ModuleWorkspaceState(linear)
    assert copy.deepcopy(state).kind is linear
    with pytest.raises(TypeError, match="non-empty str"):
        kind("")
    # The enum it replaced named its members so; a kind not made is no attribute.
    assert kind.LINEAR is linear and kind.OPS_GROUPED_LINEAR is ti.kinds.OpsGroupedLinear._wm_kind
    with pytest.raises(AttributeError, match="no kind of that name was made"):
        kind.NOT_A_KIND


def test_conversion_install_and_construction_take_their_lists_from_the_registry(ti, monkeypatch):
    targets = ti.construction._construction_targets()
    assert {(id(m), n, cls) for m, n, cls in targets} == {
        (id(m), n, a.drop_in) for a in ti.kind_registry.adapters() for m, n in a.construction}
    names = ti.install._seamed_names()
    listed = [(id(s.module), s.name) for a in ti.kind_registry.adapters() for s in ti.install.seams_of(a)]
    assert sorted(set(listed)) == sorted((id(s.module), s.name) for s in names)  # te.ops's shared seams once
    assert len(names) == len(set(listed)) < len(listed)
    # A kind's adapter is the one place conversion and attribution look: without it, its TE class
    # is neither converted nor inspected.
    from _fake_te import TELinear

    model = TELinear(8, 8)
    assert [m for _, m in ti.attribution.te_modules(model)] == [model]
    adapter = ti.kind_registry.adapter_for(ti.kind_registry.ModuleKind("linear"))
    monkeypatch.delitem(ti.kind_registry._ADAPTERS, adapter.kind)
    assert ti.modules._managed_class_for(adapter.te_class) is None
    assert ti.attribution.te_modules(model) == []


def test_the_budget_counts_each_kinds_gemm_weights(ti):
    kind = ti.kind_registry.ModuleKind
    assert ti.kind_registry.adapter_for(kind("layernorm_mlp")).gemm_weights(object()) == ("fc1_weight", "fc2_weight")
    assert ti.kind_registry.adapter_for(kind("linear")).gemm_weights(object()) == ("weight",)


def test_a_second_adapter_for_a_kind_an_unknown_kind_and_a_malformed_adapter_are_refused(ti):
    adapter = ti.kind_registry.adapters()[0]
    ti.kind_registry.register(adapter)  # the same adapter again changes nothing
    other = type("Other", (adapter.drop_in,), {})
    with pytest.raises(ValueError, match="already registered.*under a ModuleKind of its own"):
        ti.kind_registry.register(ti.kind_registry.Adapter(adapter.kind, adapter.te_class, other, function=adapter.function))
    with pytest.raises(TypeError, match="expected an Adapter, received dict"):
        ti.kind_registry.register({})
    with pytest.raises(TypeError, match="exactly one of function"):
        ti.kind_registry.Adapter(adapter.kind, adapter.te_class, other)
    with pytest.raises(TypeError, match="set _wm_kind to the adapter's kind"):
        ti.kind_registry.Adapter(ti.kind_registry.ModuleKind("another"), adapter.te_class, other, function=adapter.function)
    ti.kind_registry._ADAPTERS.pop(adapter.kind)
    try:
        with pytest.raises(LookupError, match=f"no module kind .*{adapter.kind.name}.* is registered"):
            ti.kind_registry.adapter_for(adapter.kind)
    finally:
        ti.kind_registry.register(adapter)


def test_explain_is_told_every_kind_and_refused_while_one_has_no_adapter(ti, monkeypatch):
    import workspace_manager._explain as data

    monkeypatch.setattr(data, "_MODULE_KINDS", {})
    adapter = ti.kind_registry.adapter_for(ti.kind_registry.ModuleKind("grouped_linear"))
    monkeypatch.delitem(ti.kind_registry._ADAPTERS, adapter.kind)
    with pytest.raises(RuntimeError, match="module kinds without a registered adapter: grouped_linear"):
        ti.kind_registry.register_with_explain()
    assert data.registered_module_kinds() == ()  # refused before naming any
    monkeypatch.setitem(ti.kind_registry._ADAPTERS, adapter.kind, adapter)
    ti.kind_registry.register_with_explain()
    named = {k.name: k.note for k in data.registered_module_kinds()}
    assert named["GroupedLinear"] == named["te.ops.GroupedLinear"] == "one plan for all experts"
    assert len(named) == len(ti.kind_registry.ModuleKind.made())


def test_the_package_import_registers_every_kind_file_and_exports_its_drop_ins(tmp_path):
    """``import te_integration`` itself (not the stand-in loader): ``kinds/__init__``
    imports every kind's file, the legend names them in order, and the
    package exports each file's drop-ins. Against a stand-in TE on disk, in
    a fresh interpreter."""
    import json
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    from _te_standin_ops_tree import write_te_ops_tree
    from _te_standin_tree import QUANTIZER_STUBS, write_te_tree

    root = write_te_ops_tree(write_te_tree(tmp_path))
    code = textwrap.dedent("""
        import json
        from workspace_manager.extending import registered_module_kinds
        import te_integration as ti
        print(json.dumps([ti.__all__[:7], [k.name for k in registered_module_kinds()],
                          ti.Linear is ti.kinds.linear.Linear]))
    """)
    code = code.replace("import te_integration as ti", QUANTIZER_STUBS + "import te_integration as ti", 1)
    repo = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={"PYTHONPATH": f"{root}:{repo}", "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == [
        ["Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear", "OpsBasicLinear", "OpsLinear",
         "OpsGroupedLinear"],
        ["Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear", "te.ops.BasicLinear", "te.ops.GroupedLinear"],
        True]
