"""pytest plugin for ``tests.te_suite``: runs TE's own tests with the
drop-ins in place of ``Linear``, ``LayerNormLinear``, ``LayerNormMLP`` and
``GroupedLinear``.

Loaded with ``-p tests.te_suite.plugin --te-suite-variant stock|dropin
--te-suite-record DIR``. In ``pytest_configure``, before any test module is
imported, the ``dropin`` variant rebinds the names wherever TE exports
them (:data:`NAMESPACES`) to the classes of ``--te-suite-dropins`` (default
``te_integration``); ``--te-suite-swap`` names which (default all four).
TE's own module files (``module/linear.py`` ...) keep their classes: the
drop-ins subclass them. The ``stock`` variant checks that all four names are
TE's own classes and changes nothing. ``te.ops.GroupedLinear``, a fusible
operation and another class, is not touched.

Either way it fails the run loudly when the check does not hold, also after
collection (a test module that bound a stock class would run stock TE), and
writes what it did to ``DIR/record[.rankN].json``: the names rebound, the
classes each collected test module bound, and how many drop-ins the tests
constructed. ``DIR/started[.rankN].txt`` lists each test as it starts, so
a run killed mid-test still names the test that was running.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

__all__ = ["NAMESPACES", "CLASS_HOMES", "Rebinding", "SwapError", "rebind", "check_bound", "check_test_modules",
           "swap_names"]

_PT = "transformer_engine.pytorch"
#: Where TE 2.20 binds the public names that its users and its own composite
#: modules (MultiheadAttention, TransformerLayer) look up (GroupedLinear: the
#: first two only).
NAMESPACES = (_PT, f"{_PT}.module", f"{_PT}.transformer", f"{_PT}.attention.multi_head_attention")
#: The module each stock class is defined in.
CLASS_HOMES = {"Linear": f"{_PT}.module.linear", "LayerNormLinear": f"{_PT}.module.layernorm_linear",
               "LayerNormMLP": f"{_PT}.module.layernorm_mlp", "GroupedLinear": f"{_PT}.module.grouped_linear"}


class SwapError(RuntimeError):
    """The names do not hold the classes the variant needs."""


@dataclass(frozen=True)
class Rebinding:
    """``module.name`` was ``before`` and is ``after`` (qualified class names)."""

    module: str
    name: str
    before: str
    after: str


def qualname(cls: Any) -> str:
    return f"{getattr(cls, '__module__', '?')}.{getattr(cls, '__qualname__', repr(cls))}"


def rebind(namespaces: dict[str, ModuleType], stock: dict[str, type], dropins: dict[str, type]) -> list[Rebinding]:
    """Point every ``namespace.name`` that holds ``stock[name]`` at
    ``dropins[name]``. Raises SwapError, changing nothing, if a drop-in is
    not a subclass of its stock class, a namespace holds something else
    under the name, or the first namespace (TE's public one) lacks a name."""
    plan, first = [], next(iter(namespaces))
    for name, cls in stock.items():
        if not (isinstance(dropins[name], type) and issubclass(dropins[name], cls)):
            raise SwapError(f"{qualname(dropins[name])} is not a subclass of {qualname(cls)}")
        for mod_name, module in namespaces.items():
            if not hasattr(module, name):
                if mod_name == first:
                    raise SwapError(f"{mod_name} has no {name}")
                continue  # this namespace does not export the name
            held = getattr(module, name)
            if held is not cls:
                raise SwapError(f"{mod_name}.{name} is {qualname(held)}, not TE's {qualname(cls)}")
            plan.append((module, mod_name, name, cls, dropins[name]))
    for module, _, name, _, new in plan:
        setattr(module, name, new)
    return [Rebinding(mod_name, name, qualname(old), qualname(new)) for _, mod_name, name, old, new in plan]


def check_bound(namespaces: dict[str, ModuleType], expected: dict[str, type]) -> None:
    """SwapError unless every exported ``namespace.name`` is ``expected[name]``."""
    wrong = [f"{mod_name}.{name} is {qualname(getattr(module, name))}, expected {qualname(cls)}"
             for mod_name, module in namespaces.items() for name, cls in expected.items()
             if hasattr(module, name) and getattr(module, name) is not cls]
    if wrong:
        raise SwapError("; ".join(wrong))


def check_test_modules(modules: list[ModuleType], expected: dict[str, type],
                       forbidden: dict[str, type]) -> dict[str, int]:
    """How many test modules bound each name to ``expected[name]``; SwapError
    naming any module that bound ``forbidden[name]`` (the other variant's class)."""
    bound: Counter = Counter()
    for module in modules:
        for name, cls in expected.items():
            held = vars(module).get(name)
            if held is cls:
                bound[name] += 1
            elif held is not None and held is forbidden.get(name):
                raise SwapError(f"test module {module.__name__} bound {name} = {qualname(held)}, "
                                f"not {qualname(cls)}: it was imported before the swap")
    return dict(bound)


# -- the plugin ----------------------------------------------------------------
class _Session:
    """What this process's plugin did, written to the record file."""

    def __init__(self, variant: str, record_dir: Path, dropins_module: str) -> None:
        rank = os.environ.get("RANK")
        self.suffix = f".rank{rank}" if rank is not None else ""
        self.variant, self.dir, self.dropins_module = variant, record_dir, dropins_module
        self.expected: dict[str, type] = {}
        self.forbidden: dict[str, type] = {}
        self.namespaces: dict[str, ModuleType] = {}
        self.record: dict[str, Any] = {"variant": variant, "rank": rank, "rebound": [], "test_modules": None,
                                       "constructed": None}
        self.constructed: Counter = Counter()
        self.restore: list[tuple[type, object]] = []
        self.started = None
        #: Whether te.ops's names are swapped (or checked) too (``--te-suite-ops``).
        self.ops = False

    def write(self) -> None:
        if self.variant == "dropin":
            self.record["constructed"] = dict(self.constructed)
        path = self.dir / f"record{self.suffix}.json"
        path.write_text(json.dumps(self.record, indent=1, sort_keys=True) + "\n")


_STATE: _Session | None = None


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("te-suite", "tests.te_suite: stock TE or the drop-ins")
    group.addoption("--te-suite-variant", choices=("stock", "dropin"), default=None,
                    help="stock: check TE's classes are its own; dropin: put the drop-ins in their place")
    group.addoption("--te-suite-record", default=None, help="folder for the record of what was done")
    group.addoption("--te-suite-dropins", default="te_integration",
                    help="module whose Linear, LayerNormLinear, LayerNormMLP and GroupedLinear replace TE's")
    group.addoption("--te-suite-swap", default=",".join(CLASS_HOMES),
                    help=f"comma-separated names the dropin variant swaps (default: {','.join(CLASS_HOMES)})")
    group.addoption("--te-suite-ops", action="store_true", default=False,
                    help="also te.ops.BasicLinear and te.ops.GroupedLinear (tests.te_suite.ops_swap)")


def _count_constructions(state: _Session, cls: type, name: str) -> None:
    """Count each construction of ``cls`` (its own ``__init__`` runs unchanged)."""
    original = cls.__init__

    @functools.wraps(original)
    def counted(self: Any, *args: Any, **kwargs: Any) -> None:
        state.constructed[name] += 1
        original(self, *args, **kwargs)

    state.restore.append((cls, cls.__dict__.get("__init__")))
    cls.__init__ = counted


def swap_names(text: str) -> tuple[str, ...]:
    """The names ``--te-suite-swap`` gives, in :data:`CLASS_HOMES` order; SwapError for an unknown one."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in CLASS_HOMES]
    if unknown or not names:
        raise SwapError(f"--te-suite-swap {text!r}: choose from {', '.join(CLASS_HOMES)}")
    return tuple(n for n in CLASS_HOMES if n in names)


def _configure(state: _Session, swap: tuple[str, ...]) -> None:
    import transformer_engine

    state.namespaces = {name: importlib.import_module(name) for name in NAMESPACES}
    stock = {name: getattr(importlib.import_module(home), name) for name, home in CLASS_HOMES.items()}
    state.record["te_version"] = str(getattr(transformer_engine, "__version__", "unknown"))
    if state.ops:
        from .ops_swap import swap_ops

        rebound, ops_classes = swap_ops(state.dropins_module if state.variant == "dropin" else None)
        state.record["rebound"] += [asdict(r) for r in rebound]
        if state.variant == "dropin":
            for name, cls in ops_classes.items():
                _count_constructions(state, cls, name)
    if state.variant == "stock":
        check_bound(state.namespaces, stock)
        state.expected = stock
        return
    state.record["swap"] = list(swap)
    provider = importlib.import_module(state.dropins_module)
    dropins = {name: getattr(provider, name) for name in swap}
    swapped = {name: stock[name] for name in swap}
    state.record["rebound"] = [asdict(r) for r in rebind(state.namespaces, swapped, dropins)] + state.record["rebound"]
    state.expected = {**stock, **dropins}  # the names left out stay TE's own
    check_bound(state.namespaces, state.expected)
    state.forbidden = swapped
    for name, cls in dropins.items():
        _count_constructions(state, cls, name)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """Swap (or check) before collection imports any test module; under
    torchrun give each rank its own JUnit file (runs before junitxml's hook)."""
    global _STATE
    variant = config.getoption("te_suite_variant")
    if variant is None:
        return
    record = config.getoption("te_suite_record")
    if not record:
        raise pytest.UsageError("--te-suite-variant needs --te-suite-record DIR")
    state = _Session(variant, Path(record), config.getoption("te_suite_dropins"))
    state.ops = bool(config.getoption("te_suite_ops"))
    state.dir.mkdir(parents=True, exist_ok=True)
    xmlpath = config.option.xmlpath
    if xmlpath and state.suffix:
        path = Path(xmlpath)
        config.option.xmlpath = str(path.with_name(f"{path.stem}{state.suffix}{path.suffix}"))
    try:
        _configure(state, swap_names(config.getoption("te_suite_swap")))
    except (SwapError, ImportError, AttributeError) as err:
        state.record["error"] = f"{type(err).__name__}: {err}"
        state.write()
        raise pytest.UsageError(f"te_suite {variant}: {err}") from err
    state.write()
    state.started = open(state.dir / f"started{state.suffix}.txt", "w")  # noqa: SIM115 (closed at unconfigure)
    _STATE = state


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The swap in the run's own output (shown with -q too)."""
    if _STATE is None:
        return
    record = _STATE.record
    if _STATE.variant == "stock":
        line = f"te_suite stock: TE {record.get('te_version')}, its own classes checked"
    else:
        line = (f"te_suite dropin: {len(record['rebound'])} names rebound to {_STATE.dropins_module}'s classes; "
                f"drop-ins constructed: {dict(_STATE.constructed)}")
    terminalreporter.write_line(f"{line}; test modules: {record.get('test_modules')}")


def pytest_collection_finish(session: pytest.Session) -> None:
    """The test modules are imported now: each must have bound the variant's classes."""
    if _STATE is None:
        return
    modules = {id(m): m for m in (getattr(item, "module", None) for item in session.items) if m is not None}
    try:
        check_bound(_STATE.namespaces, _STATE.expected)
        bound = check_test_modules(list(modules.values()), _STATE.expected, _STATE.forbidden)
    except SwapError as err:
        _STATE.record["error"] = str(err)
        _STATE.write()
        pytest.exit(f"te_suite {_STATE.variant}: {err}", returncode=3)
    _STATE.record["test_modules"] = {"checked": len(modules), "bound": bound}
    _STATE.write()


def pytest_runtest_logstart(nodeid: str, location: tuple) -> None:
    if _STATE is not None and _STATE.started is not None:
        _STATE.started.write(nodeid + "\n")
        _STATE.started.flush()


#: pytest's exit statuses for "some test failed" and "no test collected".
_OUTCOME_EXITS = (1, 5)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Record the exit status. Under torchrun, a rank whose tests merely
    failed exits 0: torchrun stops every rank as soon as one exits non-zero,
    which could cut another rank's JUnit file short. The outcomes are in
    the JUnit files either way."""
    if _STATE is None:
        return
    _STATE.record["exitstatus"] = int(exitstatus)
    _STATE.write()
    if _STATE.suffix and int(exitstatus) in _OUTCOME_EXITS:
        session.exitstatus = 0


def pytest_unconfigure(config: pytest.Config) -> None:
    global _STATE
    if _STATE is None:
        return
    if _STATE.started is not None:
        _STATE.started.close()
    for cls, own in _STATE.restore:
        if own is None:
            del cls.__init__
        else:
            cls.__init__ = own
    _STATE = None
