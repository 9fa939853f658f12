"""The quantizer registry: quantizer class -> :class:`QuantizerCapabilities`.

Library developers register their quantizers here instead of editing
control flow (TE's ``_is_weight_workspace_valid`` is an ``isinstance``
ladder). Lookup walks the class hierarchy, so a subclass inherits its base's
entry unless it registers its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar, Union, overload

from ._context import QuantizerCapabilities
from ._errors import DuplicateQuantizerError, InvalidCapabilitiesError, UnknownQuantizerError
from ._profiles import TE_QUANTIZER_PROFILES

__all__ = [
    "CapabilitySource",
    "QuantizerRegistry",
    "default_registry",
    "register_quantizer",
    "quantizer_capabilities",
]

#: Either fixed capabilities, or a function of the quantizer instance (for
#: quantizers whose capabilities depend on their configuration, such as
#: TE's Float8BlockQuantizer with 1D or 2D scales).
CapabilitySource = Union[QuantizerCapabilities, Callable[[Any], QuantizerCapabilities]]

T = TypeVar("T", bound=type)

_HOW_TO_REGISTER = (
    "Register it with workspace_manager.register_quantizer({cls}, capabilities=QuantizerCapabilities("
    "name=..., columnwise_derivable=..., derived_caches=..., requantization_safe=...)), "
    "or decorate the class with @register_quantizer(capabilities=...)."
)


def qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


@dataclass(frozen=True)
class _Entry:
    key: str
    source: CapabilitySource
    origin: str


class QuantizerRegistry:
    """Maps quantizer classes (or their qualified names) to capabilities."""

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}

    def register(
        self,
        quantizer: type | str,
        capabilities: CapabilitySource,
        *,
        override: bool = False,
        origin: str | None = None,
    ) -> None:
        """Register ``quantizer`` (a class, or its qualified name when the
        class cannot be imported here). A second registration of the same
        class raises :class:`DuplicateQuantizerError` unless ``override=True``."""
        key = _key_of(quantizer)
        _check_source(key, capabilities)
        existing = self._entries.get(key)
        if existing is not None and not override:
            raise DuplicateQuantizerError(
                f"Quantizer {key} already has capabilities (registered by {existing.origin}). "
                "Pass override=True to replace them."
            )
        self._entries[key] = _Entry(key, capabilities, origin or "user code")

    def unregister(self, quantizer: type | str) -> None:
        key = _key_of(quantizer)
        if key not in self._entries:
            raise UnknownQuantizerError(f"Quantizer {key} is not registered; nothing to unregister.")
        del self._entries[key]

    def lookup(self, quantizer: Any) -> QuantizerCapabilities:
        """Capabilities of a quantizer instance (or class), walking its MRO."""
        cls = quantizer if isinstance(quantizer, type) else type(quantizer)
        for base in cls.__mro__:
            if base is object:
                continue
            entry = self._entries.get(qualified_name(base))
            if entry is not None:
                return _resolve(entry, quantizer)
        raise UnknownQuantizerError(self._miss_message(cls))

    def __contains__(self, quantizer: object) -> bool:
        try:
            cls = quantizer if isinstance(quantizer, type) else type(quantizer)
            return any(qualified_name(b) in self._entries for b in cls.__mro__ if b is not object)
        except TypeError:
            return False

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def _miss_message(self, cls: type) -> str:
        bases = [qualified_name(b) for b in cls.__mro__[1:] if b is not object]
        registered = ", ".join(sorted(self._entries)) or "(none)"
        return (
            f"No workspace capabilities are registered for quantizer class {qualified_name(cls)}"
            + (f" or its bases ({', '.join(bases)})" if bases else "")
            + f". Registered: {registered}. "
            + _HOW_TO_REGISTER.format(cls=cls.__name__)
        )


def _key_of(quantizer: type | str) -> str:
    if isinstance(quantizer, type):
        return qualified_name(quantizer)
    if isinstance(quantizer, str) and quantizer.count(".") >= 1 and quantizer.strip() == quantizer:
        return quantizer
    raise InvalidCapabilitiesError(
        "register expects a quantizer class or its qualified name ('package.module.ClassName'); "
        f"received {quantizer!r} ({type(quantizer).__name__})"
    )


def _check_source(key: str, capabilities: object) -> None:
    if isinstance(capabilities, QuantizerCapabilities) or callable(capabilities):
        return
    raise InvalidCapabilitiesError(
        f"capabilities for {key} must be a QuantizerCapabilities or a function of the quantizer "
        f"returning one; received {capabilities!r} ({type(capabilities).__name__})"
    )


def _resolve(entry: _Entry, quantizer: Any) -> QuantizerCapabilities:
    if isinstance(entry.source, QuantizerCapabilities):
        return entry.source
    if isinstance(quantizer, type):
        raise InvalidCapabilitiesError(
            f"Capabilities of {entry.key} depend on the quantizer's configuration; "
            "look them up with a quantizer instance, not the class."
        )
    result = entry.source(quantizer)
    if not isinstance(result, QuantizerCapabilities):
        raise InvalidCapabilitiesError(
            f"The capabilities function registered for {entry.key} ({entry.source!r}) returned "
            f"{result!r} ({type(result).__name__}); it must return a QuantizerCapabilities."
        )
    return result


def _with_te_profiles() -> QuantizerRegistry:
    registry = QuantizerRegistry()
    for name, source in TE_QUANTIZER_PROFILES.items():
        registry.register(name, source, origin="workspace_manager's built-in TE profiles")
    return registry


#: The registry bindings consult by default; preloaded with TE's quantizers.
default_registry: QuantizerRegistry = _with_te_profiles()


@overload
def register_quantizer(
    quantizer: None = None, /, *, capabilities: CapabilitySource, override: bool = ..., registry: QuantizerRegistry | None = ...
) -> Callable[[T], T]: ...


@overload
def register_quantizer(
    quantizer: type | str, /, *, capabilities: CapabilitySource, override: bool = ..., registry: QuantizerRegistry | None = ...
) -> None: ...


def register_quantizer(
    quantizer: type | str | None = None,
    /,
    *,
    capabilities: CapabilitySource,
    override: bool = False,
    registry: QuantizerRegistry | None = None,
) -> Any:
    """Register a quantizer class's capabilities, as a call or a decorator::

        register_quantizer(MyQuantizer, capabilities=MY_CAPS)

        @register_quantizer(capabilities=MY_CAPS)
        class MyQuantizer: ...

    The decorator returns the class unchanged.
    """
    target = registry if registry is not None else default_registry
    origin = "user code"
    if quantizer is None:

        def decorate(cls: T) -> T:
            target.register(cls, capabilities, override=override, origin=f"@register_quantizer in {cls.__module__}")
            return cls

        _check_source("the decorated class", capabilities)
        return decorate
    target.register(quantizer, capabilities, override=override, origin=origin)
    return None


def quantizer_capabilities(quantizer: Any, *, registry: QuantizerRegistry | None = None) -> QuantizerCapabilities:
    """Look up a quantizer's capabilities in ``registry`` (default: the default registry)."""
    return (registry if registry is not None else default_registry).lookup(quantizer)
