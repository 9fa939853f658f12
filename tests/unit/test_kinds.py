"""The one registry of module kinds (``te_integration._kinds``): every kind
registers once, and conversion, install, construction and the budget take
their lists from it."""

from __future__ import annotations

import pytest
from _fake_te import load_full_binding


@pytest.fixture
def ti(monkeypatch):
    binding = load_full_binding(monkeypatch)
    import sys

    binding.kinds = sys.modules["te_integration._kinds"]
    return binding


def test_every_module_kind_is_registered_once_with_a_drop_in_of_its_kind(ti):
    entries = ti.kinds.entries()
    assert {e.kind for e in entries} == set(ti.state.ModuleKind)
    for entry in entries:
        assert entry.drop_in._wm_kind is entry.kind and issubclass(entry.drop_in, entry.te_class)
        assert ti.kinds.entry_for(entry.kind) is entry
    assert ti.kinds.drop_ins() == {e.te_class: e.drop_in for e in entries}


def test_conversion_install_and_construction_take_their_lists_from_the_registry(ti, monkeypatch):
    construction = __import__("sys").modules["te_integration._construction"]
    targets = construction._construction_targets()
    assert {(id(m), n, cls) for m, n, cls in targets} == {
        (id(m), n, e.drop_in) for e in ti.kinds.entries() for m, n in e.construction}
    names = ti.install._seamed_names()
    listed = [(id(s.module), s.name) for e in ti.kinds.entries() for s in e.seams()]
    assert sorted(set(listed)) == sorted((id(s.module), s.name) for s in names)  # te.ops's shared seams once
    assert len(names) == len(set(listed)) < len(listed)
    # A kind's entry is the one place conversion and attribution look: without it, its TE class
    # is neither converted nor inspected.
    from _fake_te import TELinear

    attribution = __import__("sys").modules["te_integration._attribution"]
    model = TELinear(8, 8)
    assert [m for _, m in attribution.te_modules(model)] == [model]
    entry = next(e for e in ti.kinds.entries() if e.kind is ti.state.ModuleKind.LINEAR)
    monkeypatch.delitem(ti.kinds._ENTRIES, entry.kind)
    assert ti.modules._managed_class_for(entry.te_class) is None
    assert attribution.te_modules(model) == []


def test_the_budget_counts_each_kinds_gemm_weights(ti):
    kind = ti.state.ModuleKind
    assert ti.kinds.entry_for(kind.LAYERNORM_MLP).gemm_weights(object()) == ("fc1_weight", "fc2_weight")
    assert ti.kinds.entry_for(kind.LINEAR).gemm_weights(object()) == ("weight",)


def test_a_second_entry_for_a_kind_and_an_unknown_kind_are_refused_with_what_to_do(ti):
    entry = ti.kinds.entries()[0]
    ti.kinds.register(entry)  # the same entry again changes nothing
    with pytest.raises(ValueError, match="already registered.*under a ModuleKind of its own"):
        ti.kinds.register(ti.kinds.KindEntry(entry.kind, entry.te_class, type("Other", (entry.drop_in,), {}),
                                             entry.seams))
    with pytest.raises(TypeError, match="expected a KindEntry, received dict"):
        ti.kinds.register({})
    ti.kinds._ENTRIES.pop(entry.kind)
    try:
        with pytest.raises(LookupError, match=f"no module kind .*{entry.kind.name}.* is registered"):
            ti.kinds.entry_for(entry.kind)
    finally:
        ti.kinds.register(entry)


def test_explain_is_told_every_kind_and_refused_while_one_has_no_entry(ti, monkeypatch):
    import workspace_manager._explain as data

    monkeypatch.setattr(data, "_MODULE_KINDS", {})
    entry = ti.kinds.entry_for(ti.state.ModuleKind.GROUPED_LINEAR)
    monkeypatch.delitem(ti.kinds._ENTRIES, entry.kind)
    with pytest.raises(RuntimeError, match="module kinds without a registry entry: GROUPED_LINEAR"):
        ti.kinds.register_with_explain()
    assert data.registered_module_kinds() == ()  # refused before naming any
    monkeypatch.setitem(ti.kinds._ENTRIES, entry.kind, entry)
    ti.kinds.register_with_explain()
    named = {k.name: k.note for k in data.registered_module_kinds()}
    assert named["GroupedLinear"] == named["te.ops.GroupedLinear"] == "one plan for all experts"
    assert len(named) == len(ti.state.ModuleKind)
