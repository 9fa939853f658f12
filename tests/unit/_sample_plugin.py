"""A stand-in for an installed package's quantizer plugin (see test_entry_points.py)."""

from workspace_manager import QuantizerCapabilities

CAPS = QuantizerCapabilities(name="plugin_fp8", columnwise_derivable=True, derived_caches=True, requantization_safe=True)


class CalledQuantizer:
    """Registered by the callable form."""


class MappedQuantizer:
    """Registered by the mapping form."""


def register(registry):
    registry.register(CalledQuantizer, CAPS)


QUANTIZERS = {MappedQuantizer: CAPS, "vendor_pkg.quantizers.NamedQuantizer": CAPS}


def half_then_fail(registry):
    registry.register("vendor_pkg.quantizers.HalfQuantizer", CAPS)
    raise RuntimeError("the vendor library is not configured")


def reads_the_registry(registry):
    registry.register("vendor_pkg.quantizers.ReaderQuantizer", CAPS)
    assert "vendor_pkg.quantizers.ReaderQuantizer" in set(registry)


NOT_A_PLUGIN = 42
