"""The quantizer registry: registration, hierarchy lookup, and its errors."""

from __future__ import annotations

import pytest

from workspace_manager import (
    DuplicateQuantizerError,
    InvalidCapabilitiesError,
    QuantizerCapabilities,
    UnknownQuantizerError,
    register_quantizer,
)
from workspace_manager.extending import PROFILES, QuantizerRegistry, default_registry, quantizer_capabilities
from workspace_manager._profiles import (
    FLOAT8_BLOCK_1D,
    FLOAT8_BLOCK_2D,
    FLOAT8_DELAYED_SCALING,
    NVFP4_1D,
    NVFP4_2D,
    RECIPE_PROFILES,
    TE_QUANTIZER_PROFILES,
)

CAPS = QuantizerCapabilities(name="mine", columnwise_derivable=True, derived_caches=False, requantization_safe=True)


class Base:
    pass


class Child(Base):
    pass


def test_lookup_walks_the_class_hierarchy():
    reg = QuantizerRegistry()
    reg.register(Base, CAPS)
    assert reg.lookup(Child()) is CAPS
    assert reg.lookup(Child) is CAPS
    assert Child() in reg and object() not in reg


def test_a_subclass_entry_wins_over_its_base():
    reg = QuantizerRegistry()
    other = QuantizerCapabilities(name="child", columnwise_derivable=False, derived_caches=False,
                                  requantization_safe=False)
    reg.register(Base, CAPS)
    reg.register(Child, other)
    assert reg.lookup(Child()) is other and reg.lookup(Base()) is CAPS


def test_the_lookup_memo_follows_every_change_of_the_entries():
    """Lookups are memoized per class; registering, overriding or removing
    an entry after a lookup must still change what the next lookup says."""
    reg = QuantizerRegistry()
    other = QuantizerCapabilities(name="child", columnwise_derivable=False, derived_caches=False,
                                  requantization_safe=False)
    reg.register(Base, CAPS)
    assert reg.lookup(Child()) is CAPS  # memoized: Child -> Base's entry
    reg.register(Child, other)
    assert reg.lookup(Child()) is other
    reg.register(Child, CAPS, override=True)
    assert reg.lookup(Child()) is CAPS
    reg.unregister(Child)
    reg.unregister(Base)
    with pytest.raises(UnknownQuantizerError):
        reg.lookup(Child())


def test_unknown_quantizer_error_names_class_bases_registered_and_the_fix():
    reg = QuantizerRegistry()
    reg.register("some.module.Registered", CAPS)
    with pytest.raises(UnknownQuantizerError) as info:
        reg.lookup(Child())
    msg = str(info.value)
    assert f"{__name__}.Child" in msg and f"{__name__}.Base" in msg
    assert "some.module.Registered" in msg
    assert "register_quantizer(Child, capabilities=QuantizerCapabilities(" in msg
    assert isinstance(info.value, TypeError)


def test_duplicates_are_refused_unless_overridden():
    reg = QuantizerRegistry()
    reg.register(Base, CAPS)
    with pytest.raises(DuplicateQuantizerError, match="override=True") as info:
        reg.register(Base, CAPS)
    assert isinstance(info.value, ValueError)
    other = QuantizerCapabilities(name="new", columnwise_derivable=False, derived_caches=False,
                                  requantization_safe=True)
    reg.register(Base, other, override=True)
    assert reg.lookup(Base()) is other


def test_a_class_and_its_qualified_name_are_the_same_entry():
    reg = QuantizerRegistry()
    reg.register(f"{__name__}.Base", CAPS)
    with pytest.raises(DuplicateQuantizerError):
        reg.register(Base, CAPS)
    assert reg.lookup(Child()) is CAPS


def test_decorator_returns_the_class_unchanged_and_registers_it():
    reg = QuantizerRegistry()

    @register_quantizer(capabilities=CAPS, registry=reg)
    class Decorated:
        pass

    assert isinstance(Decorated, type) and Decorated.__name__ == "Decorated"
    assert quantizer_capabilities(Decorated(), registry=reg) is CAPS


def test_call_form_registers():
    reg = QuantizerRegistry()
    assert register_quantizer(Base, capabilities=CAPS, registry=reg) is None
    assert reg.lookup(Base()) is CAPS


def test_capabilities_may_depend_on_the_instance():
    reg = QuantizerRegistry()

    class Configurable:
        def __init__(self, dims):
            self.dims = dims

    reg.register(Configurable, lambda q: FLOAT8_BLOCK_2D if q.dims == 2 else FLOAT8_BLOCK_1D)
    assert reg.lookup(Configurable(2)) is FLOAT8_BLOCK_2D
    assert reg.lookup(Configurable(1)) is FLOAT8_BLOCK_1D
    with pytest.raises(InvalidCapabilitiesError, match="instance"):
        reg.lookup(Configurable)


def test_a_capabilities_function_must_return_capabilities():
    reg = QuantizerRegistry()
    reg.register(Base, lambda q: {"columnwise_derivable": True})
    with pytest.raises(InvalidCapabilitiesError, match="must return a QuantizerCapabilities"):
        reg.lookup(Base())


@pytest.mark.parametrize("bad", [None, 3, {"name": "x"}, "not a caps"])
def test_registration_rejects_what_is_not_capabilities(bad):
    with pytest.raises(InvalidCapabilitiesError, match="must be a QuantizerCapabilities"):
        QuantizerRegistry().register(Base, bad)


@pytest.mark.parametrize("bad", [3, "NoDots", " padded.Name", None])
def test_registration_rejects_what_is_not_a_class_or_name(bad):
    with pytest.raises(InvalidCapabilitiesError, match="quantizer class or its qualified name"):
        QuantizerRegistry().register(bad, CAPS)


def test_unregister():
    reg = QuantizerRegistry()
    reg.register(Base, CAPS)
    reg.unregister(Base)
    assert Base() not in reg
    with pytest.raises(UnknownQuantizerError):
        reg.unregister(Base)


def test_default_registry_knows_te_quantizers_by_name_without_te():
    assert set(TE_QUANTIZER_PROFILES) <= set(default_registry)
    # A stand-in with TE's qualified name resolves through the name entry.
    Fake = type("Float8Quantizer", (), {"__module__": "transformer_engine.pytorch.tensor.float8_tensor"})
    assert quantizer_capabilities(Fake()) is FLOAT8_DELAYED_SCALING


def test_te_instance_dependent_profiles():
    nv = type("NVFP4Quantizer", (), {"__module__": "transformer_engine.pytorch.tensor.nvfp4_tensor"})
    q = nv()
    q.with_2d_quantization, q.stochastic_rounding = True, False
    assert quantizer_capabilities(q) is NVFP4_2D
    q.with_2d_quantization = False
    assert quantizer_capabilities(q) is NVFP4_1D
    q.stochastic_rounding = True
    caps = quantizer_capabilities(q)
    assert not caps.requantization_safe and not caps.columnwise_derivable


def test_recipe_profiles_cover_the_five_recipes():
    assert set(RECIPE_PROFILES) == {
        "DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling", "MXFP8BlockScaling", "NVFP4BlockScaling"
    }
    assert not RECIPE_PROFILES["MXFP8BlockScaling"].columnwise_derivable
    assert all(p.name in PROFILES for p in RECIPE_PROFILES.values())
