"""Quantizer plugins: the ``workspace_manager.quantizers`` entry-point group.

Nothing is installed: the tests replace ``discover_entry_points``, the one
function through which the registry asks the environment.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

import workspace_manager._quantizer_registry as registry_module
from workspace_manager import DuplicateQuantizerError, QuantizerPluginError, UnknownQuantizerError, register_quantizer
from workspace_manager.extending import ENTRY_POINT_GROUP, QuantizerRegistry, default_registry

import _sample_plugin as plugin


@dataclass
class FakeEntryPoint:
    """What importlib.metadata.entry_points returns, with a distribution."""

    name: str
    value: str
    dist: object = None
    group: str = ENTRY_POINT_GROUP

    def load(self):
        return importlib.metadata.EntryPoint(name=self.name, value=self.value, group=self.group).load()


DIST = SimpleNamespace(name="vendor-fp8", version="1.2.0", metadata={"Name": "vendor-fp8"})


@pytest.fixture
def installed(monkeypatch):
    """installed(*entry_points): make those the group's entry points; returns the discovery calls."""
    calls: list[str] = []
    current: list = []

    def discover(group):
        calls.append(group)
        return list(current)

    monkeypatch.setattr(registry_module, "discover_entry_points", discover)

    def install(*eps):
        current[:] = eps
        return calls

    return install


def _registry() -> QuantizerRegistry:
    return QuantizerRegistry(entry_point_group=ENTRY_POINT_GROUP)


def test_callable_and_mapping_entry_points_register_their_quantizers(installed):
    installed(
        FakeEntryPoint("called", "_sample_plugin:register", DIST),
        FakeEntryPoint("mapped", "_sample_plugin:QUANTIZERS", DIST),
    )
    reg = _registry()
    assert reg.lookup(plugin.CalledQuantizer()) is plugin.CAPS
    assert reg.lookup(plugin.MappedQuantizer()) is plugin.CAPS
    assert "vendor_pkg.quantizers.NamedQuantizer" in set(reg)
    assert reg.loaded_entry_points == (
        "entry point 'called = _sample_plugin:register' of distribution vendor-fp8 1.2.0",
        "entry point 'mapped = _sample_plugin:QUANTIZERS' of distribution vendor-fp8 1.2.0",
    )


def test_a_real_entry_point_object_loads_too(installed):
    installed(importlib.metadata.EntryPoint(name="called", value="_sample_plugin:register", group=ENTRY_POINT_GROUP))
    reg = _registry()
    assert reg.lookup(plugin.CalledQuantizer) is plugin.CAPS
    assert reg.loaded_entry_points == ("entry point 'called = _sample_plugin:register' of an unknown distribution",)


def test_entry_points_load_lazily_and_once(installed):
    calls = installed(FakeEntryPoint("called", "_sample_plugin:register", DIST))
    reg = _registry()
    reg.register("user.code.Quantizer", plugin.CAPS)
    assert calls == []  # neither construction nor registration loads plugins
    reg.lookup(plugin.CalledQuantizer())
    reg.lookup(plugin.CalledQuantizer())
    assert plugin.CalledQuantizer in reg and len(reg) == 2
    assert calls == [ENTRY_POINT_GROUP]


def test_registrations_name_the_entry_point_and_distribution(installed):
    installed(FakeEntryPoint("called", "_sample_plugin:register", DIST))
    reg = _registry()
    reg.load_entry_points()
    with pytest.raises(DuplicateQuantizerError, match=r"registered by entry point 'called = _sample_plugin:register' "
                                                      r"of distribution vendor-fp8 1\.2\.0"):
        register_quantizer(plugin.CalledQuantizer, capabilities=plugin.CAPS, registry=reg)


def test_a_plain_registry_loads_no_entry_points(installed):
    calls = installed(FakeEntryPoint("called", "_sample_plugin:register", DIST))
    reg = QuantizerRegistry()
    assert plugin.CalledQuantizer not in reg
    assert calls == []


def test_the_default_registry_reads_the_group():
    assert default_registry.entry_point_group == ENTRY_POINT_GROUP == "workspace_manager.quantizers"


@pytest.mark.parametrize(
    "value, problem",
    [
        ("_sample_plugin_that_is_not_installed:register", "ModuleNotFoundError: No module named '_sample_plugin_that"),
        ("_sample_plugin:half_then_fail", "RuntimeError: the vendor library is not configured"),
        ("_sample_plugin:NOT_A_PLUGIN", "it loaded 42 (int); an entry point of this group must load a function"),
        ("_sample_plugin:CalledQuantizer", "must load a function register(registry) or a mapping"),
    ],
    ids=["import-error", "raises", "not-a-plugin", "a-class"],
)
def test_a_failing_plugin_raises_naming_entry_point_and_distribution(installed, value, problem):
    installed(FakeEntryPoint("good", "_sample_plugin:register", DIST), FakeEntryPoint("bad", value, DIST))
    reg = _registry()
    with pytest.raises(QuantizerPluginError) as info:
        reg.lookup(plugin.CalledQuantizer())
    msg = str(info.value)
    assert f"entry point 'bad = {value}' of distribution vendor-fp8 1.2.0" in msg
    assert problem in msg and ENTRY_POINT_GROUP in msg and "Fix or uninstall" in msg
    assert isinstance(info.value, ValueError)
    # the good plugin stays registered; the bad one left nothing behind
    installed()  # uninstalled: the next read completes the loading
    assert set(reg) == {"_sample_plugin.CalledQuantizer"}


def test_a_failed_plugin_is_retried_so_the_error_is_never_silent(installed):
    installed(FakeEntryPoint("bad", "_sample_plugin:half_then_fail", DIST))
    reg = _registry()
    for _ in range(2):
        with pytest.raises(QuantizerPluginError, match="half_then_fail"):
            reg.lookup(plugin.CalledQuantizer())
    installed(FakeEntryPoint("called", "_sample_plugin:register", DIST))  # the user fixed or uninstalled it
    assert reg.lookup(plugin.CalledQuantizer()) is plugin.CAPS


def test_a_plugin_that_registers_a_class_user_code_registered_fails_clearly(installed):
    installed(FakeEntryPoint("called", "_sample_plugin:register", DIST))
    reg = _registry()
    reg.register(plugin.CalledQuantizer, plugin.CAPS)
    with pytest.raises(QuantizerPluginError, match=r"DuplicateQuantizerError: .*registered by user code"):
        reg.lookup(plugin.CalledQuantizer)


def test_a_plugin_may_read_the_registry_while_it_registers(installed):
    installed(FakeEntryPoint("reader", "_sample_plugin:reads_the_registry", DIST))
    assert "vendor_pkg.quantizers.ReaderQuantizer" in set(_registry())


def test_discovery_errors_are_reported(monkeypatch):
    def broken(group):
        raise OSError("unreadable site-packages")

    monkeypatch.setattr(registry_module, "discover_entry_points", broken)
    with pytest.raises(QuantizerPluginError, match="Could not list .*workspace_manager.quantizers.*unreadable"):
        _registry().lookup(plugin.CalledQuantizer)


def test_unknown_quantizer_error_lists_loaded_entry_points(installed):
    installed(FakeEntryPoint("called", "_sample_plugin:register", DIST))
    with pytest.raises(UnknownQuantizerError, match="Entry points of group 'workspace_manager.quantizers' loaded: "
                                                    "entry point 'called"):
        _registry().lookup(plugin.MappedQuantizer())
    installed()
    with pytest.raises(UnknownQuantizerError, match="loaded: none installed"):
        _registry().lookup(plugin.MappedQuantizer())


def test_importing_the_package_lists_no_entry_points_and_the_first_lookup_does():
    code = textwrap.dedent(
        """
        import importlib.metadata
        calls = []
        real = importlib.metadata.entry_points
        importlib.metadata.entry_points = lambda **kw: (kw.get("group") == "workspace_manager.quantizers" and calls.append(kw)) or real(**kw)
        import workspace_manager, workspace_manager.testing
        assert calls == [], calls
        workspace_manager.extending.default_registry.lookup(type("Q", (), {"__module__": "transformer_engine.pytorch.tensor.mxfp8_tensor", "__qualname__": "MXFP8Quantizer"}))
        assert calls == [{"group": "workspace_manager.quantizers"}], calls
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
