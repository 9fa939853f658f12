"""The quantizer registry: quantizer class -> :class:`QuantizerCapabilities`.

Library developers register their quantizers here instead of editing
control flow (TE's ``_is_weight_workspace_valid`` is an ``isinstance``
ladder). Lookup walks the class hierarchy, so a subclass inherits its base's
entry unless it registers its own.

Installed packages register theirs through the ``workspace_manager.quantizers``
entry-point group (:data:`ENTRY_POINT_GROUP`). The default registry loads that
group lazily: on its first read (lookup, ``in``, iteration, ``len``), not at
import. A plugin that fails raises :class:`QuantizerPluginError` naming the
entry point and its distribution; it is retried on the next read, so the
error repeats until the plugin is fixed or uninstalled.
"""

from __future__ import annotations

import importlib.metadata
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar, Union, overload

from ._context import QuantizerCapabilities
from ._errors import (
    DuplicateQuantizerError,
    InvalidCapabilitiesError,
    QuantizerPluginError,
    UnknownQuantizerError,
)
from ._profiles import TE_QUANTIZER_PROFILES

__all__ = [
    "CapabilitySource",
    "ENTRY_POINT_GROUP",
    "QuantizerRegistry",
    "default_registry",
    "discover_entry_points",
    "register_quantizer",
    "quantizer_capabilities",
]

#: The entry-point group through which installed packages register quantizers.
#: Each entry point loads a ``register(registry)`` callable or a mapping
#: ``{quantizer class or qualified name: capabilities}``.
ENTRY_POINT_GROUP = "workspace_manager.quantizers"

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


def discover_entry_points(group: str) -> Iterable[Any]:
    """The installed entry points of ``group`` (``importlib.metadata``).

    The one place the registry asks the environment; tests replace it to
    simulate installed plugins."""
    return importlib.metadata.entry_points(group=group)


@dataclass(frozen=True)
class _Entry:
    key: str
    source: CapabilitySource
    origin: str


class QuantizerRegistry:
    """Maps quantizer classes (or their qualified names) to capabilities.

    With ``entry_point_group`` (the default registry passes
    :data:`ENTRY_POINT_GROUP`), the group's entry points are loaded on the
    first read; a plain ``QuantizerRegistry()`` loads none.
    """

    def __init__(self, *, entry_point_group: str | None = None) -> None:
        self._entries: dict[str, _Entry] = {}
        #: class -> its entry, found by the MRO walk. Bindings look up the
        #: same few classes on every module call; any change of the entries
        #: empties it.
        self._by_class: dict[type, _Entry] = {}
        #: Bumped by every change of the entries, so that a binding's memo
        #: of plans per quantizer class knows when to forget them.
        self.generation = 0
        self.entry_point_group = entry_point_group
        self._plugins_pending = entry_point_group is not None
        self._plugins_loaded: list[str] = []
        self._lock = threading.RLock()
        self._loading = False
        self._origin = "user code"

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
        with self._lock:  # not while another thread loads plugins
            existing = self._entries.get(key)
            if existing is not None and not override:
                raise DuplicateQuantizerError(
                    f"Quantizer {key} already has capabilities (registered by {existing.origin}). "
                    "Pass override=True to replace them."
                )
            self._entries[key] = _Entry(key, capabilities, origin or self._origin)
            self._by_class.clear()
            self.generation += 1

    def unregister(self, quantizer: type | str) -> None:
        self.load_entry_points()
        key = _key_of(quantizer)
        if key not in self._entries:
            raise UnknownQuantizerError(f"Quantizer {key} is not registered; nothing to unregister.")
        del self._entries[key]
        self._by_class.clear()
        self.generation += 1

    def lookup(self, quantizer: Any) -> QuantizerCapabilities:
        """Capabilities of a quantizer instance (or class), walking its MRO."""
        self.load_entry_points()
        cls = quantizer if isinstance(quantizer, type) else type(quantizer)
        entry = self._by_class.get(cls)
        if entry is None:
            entry = self._walk(cls)
            self._by_class[cls] = entry
        return _resolve(entry, quantizer)

    def capabilities_key(self, quantizer: Any) -> Any:
        """What the capabilities of ``quantizer`` depend on: its class when
        the class was registered with fixed capabilities, else the
        capabilities computed from the instance. Memos of per-call plans key
        on this (and on :attr:`generation`) instead of hashing the
        capabilities on every call."""
        self.load_entry_points()
        cls = type(quantizer)
        entry = self._by_class.get(cls)
        if entry is None:
            entry = self._walk(cls)
            self._by_class[cls] = entry
        return cls if isinstance(entry.source, QuantizerCapabilities) else _resolve(entry, quantizer)

    def _walk(self, cls: type) -> _Entry:
        for base in cls.__mro__:
            if base is object:
                continue
            entry = self._entries.get(qualified_name(base))
            if entry is not None:
                return entry
        raise UnknownQuantizerError(self._miss_message(cls))

    def __contains__(self, quantizer: object) -> bool:
        self.load_entry_points()
        try:
            cls = quantizer if isinstance(quantizer, type) else type(quantizer)
            return any(qualified_name(b) in self._entries for b in cls.__mro__ if b is not object)
        except TypeError:
            return False

    def __iter__(self) -> Iterator[str]:
        self.load_entry_points()
        return iter(sorted(self._entries))

    def __len__(self) -> int:
        self.load_entry_points()
        return len(self._entries)

    # -- entry points --------------------------------------------------------
    @property
    def loaded_entry_points(self) -> tuple[str, ...]:
        """The entry points loaded so far, described with their distributions."""
        return tuple(self._plugins_loaded)

    def load_entry_points(self) -> None:
        """Load the entry-point group's plugins now, if not done yet (every
        read does it lazily). Raises :class:`QuantizerPluginError` naming
        each entry point that failed; those that loaded stay registered, and
        the failed ones are tried again on the next call."""
        if not self._plugins_pending:
            return
        with self._lock:  # other threads wait here until loading is done
            if not self._plugins_pending or self._loading:  # done, or a plugin reading the registry
                return
            self._loading = True
            try:
                self._load_group()
            finally:
                self._loading = False

    def _load_group(self) -> None:
        group = self.entry_point_group
        try:
            found = list(discover_entry_points(group))
        except Exception as err:
            raise QuantizerPluginError(
                f"Could not list the installed entry points of group {group!r}: {type(err).__name__}: {err}"
            ) from err
        failures: list[tuple[str, BaseException]] = []
        for ep in found:
            label = _describe_entry_point(ep)
            if label in self._plugins_loaded:
                continue
            try:
                self._load_one(ep, label)
            except Exception as err:
                failures.append((label, err))
            else:
                self._plugins_loaded.append(label)
        if failures:
            raise QuantizerPluginError(_plugin_failure_message(group, failures)) from failures[0][1]
        self._plugins_pending = False

    def _load_one(self, ep: Any, label: str) -> None:
        """Load one entry point; on failure leave the registry as it was."""
        snapshot = dict(self._entries)
        try:
            target = ep.load()
            if isinstance(target, Mapping):
                for quantizer, capabilities in target.items():
                    self.register(quantizer, capabilities, origin=label)
            elif callable(target) and not isinstance(target, type):
                with self._registering_as(label):
                    target(self)
            else:
                raise InvalidCapabilitiesError(
                    f"it loaded {target!r} ({type(target).__name__}); an entry point of this group must load "
                    "a function register(registry) or a mapping {quantizer class or qualified name: capabilities}"
                )
        except BaseException:
            self._entries = snapshot
            self._by_class.clear()
            raise

    @contextmanager
    def _registering_as(self, origin: str) -> Iterator[None]:
        previous, self._origin = self._origin, origin
        try:
            yield
        finally:
            self._origin = previous

    def _miss_message(self, cls: type) -> str:
        bases = [qualified_name(b) for b in cls.__mro__[1:] if b is not object]
        registered = ", ".join(sorted(self._entries)) or "(none)"
        plugins = ""
        if self.entry_point_group is not None:
            loaded = "; ".join(self._plugins_loaded) or "none installed"
            plugins = f" Entry points of group {self.entry_point_group!r} loaded: {loaded}."
        return (
            f"No workspace capabilities are registered for quantizer class {qualified_name(cls)}"
            + (f" or its bases ({', '.join(bases)})" if bases else "")
            + f". Registered: {registered}.{plugins} "
            + _HOW_TO_REGISTER.format(cls=cls.__name__)
        )


def _describe_entry_point(ep: Any) -> str:
    """``entry point 'name = module:attr' of distribution NAME VERSION``."""
    dist = getattr(ep, "dist", None)
    if dist is not None:
        name = getattr(dist, "name", None) or dist.metadata["Name"]
        where = f"distribution {name} {dist.version}"
    else:
        where = "an unknown distribution"
    return f"entry point '{ep.name} = {ep.value}' of {where}"


def _plugin_failure_message(group: str, failures: list[tuple[str, BaseException]]) -> str:
    lines = [f"{len(failures)} quantizer plugin(s) of entry-point group {group!r} failed to load:"]
    lines += [f"  - {label}: {type(err).__name__}: {err}" for label, err in failures]
    lines.append(
        "Fix or uninstall the distribution named above. Quantizers of the other entry points are registered; "
        "the failed ones are tried again on the next lookup."
    )
    return "\n".join(lines)


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
    registry = QuantizerRegistry(entry_point_group=ENTRY_POINT_GROUP)
    for name, source in TE_QUANTIZER_PROFILES.items():
        registry.register(name, source, origin="workspace_manager's built-in TE profiles")
    return registry


#: The registry bindings consult by default; preloaded with TE's quantizers,
#: and with installed plugins (entry points) on its first read.
default_registry: QuantizerRegistry = _with_te_profiles()


@overload
def register_quantizer(
    *, capabilities: CapabilitySource, override: bool = ..., registry: QuantizerRegistry | None = ...
) -> Callable[[T], T]: ...


@overload
def register_quantizer(
    quantizer: type | str, /, *, capabilities: CapabilitySource, override: bool = ..., registry: QuantizerRegistry | None = ...
) -> None: ...


#: ``register_quantizer``'s default: used as a decorator. A sentinel, not
#: None, so that ``register_quantizer(None, ...)`` (a variable that held no
#: class) is refused instead of returning a decorator nobody applies.
_AS_DECORATOR: Any = object()


def register_quantizer(
    quantizer: type | str = _AS_DECORATOR,
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
    if quantizer is _AS_DECORATOR:

        def decorate(cls: T) -> T:
            target.register(cls, capabilities, override=override, origin=f"@register_quantizer in {cls.__module__}")
            return cls

        _check_source("the decorated class", capabilities)
        return decorate
    if quantizer is None:
        raise InvalidCapabilitiesError(
            "register_quantizer received None for the quantizer, and registered nothing; pass the quantizer class "
            "or its qualified name ('package.module.ClassName'), or decorate the class with "
            "@register_quantizer(capabilities=...) (no positional argument)"
        )
    target.register(quantizer, capabilities, override=override)
    return None


def quantizer_capabilities(quantizer: Any, *, registry: QuantizerRegistry | None = None) -> QuantizerCapabilities:
    """Look up a quantizer's capabilities in ``registry`` (default: the default registry)."""
    return (registry if registry is not None else default_registry).lookup(quantizer)
