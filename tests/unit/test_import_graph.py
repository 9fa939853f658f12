"""Nothing under ``workspace_manager/`` imports in a circle, no consumer of
the core imports its private names, and the tests, the shared ``testbed``
and the benchmarks import one another only one way: ``tests`` and
``benchmarks`` import ``testbed``; ``testbed`` imports neither; ``tests``
imports nothing from ``benchmarks`` nor ``benchmarks`` from ``tests``.

The graph is drawn from the source (ast), not from ``sys.modules``: an
import inside a function counts as much as one at the top, since a cycle
hidden behind a deferred import is still a cycle a reader must untangle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import workspace_manager

PACKAGE_DIR = Path(workspace_manager.__file__).parent


def _module_name(root: Path, package: str, path: Path) -> str:
    parts = [package, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _targets(node: ast.AST, here: str, is_package: bool, modules: set[str]) -> set[str]:
    """The package's modules that one import statement loads explicitly."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
        return {name for name in names if name in modules}
    if not isinstance(node, ast.ImportFrom):
        return set()
    if node.level:
        base = here.split(".") if is_package else here.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    found = {source} if source in modules else set()
    # ``from .pkg import mod`` loads the submodule ``pkg.mod`` too.
    found |= {f"{source}.{alias.name}" for alias in node.names if f"{source}.{alias.name}" in modules}
    return found


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module -> modules of the same package it imports (relative or absolute)."""
    files = {_module_name(root, package, p): p for p in sorted(root.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        edges: set[str] = set()
        for node in ast.walk(tree):
            edges |= _targets(node, name, is_package, set(files))
        graph[name] = edges - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path that returns to its start, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_workspace_manager_has_no_import_cycle():
    graph = import_graph(PACKAGE_DIR, "workspace_manager")
    # The graph must see the package: a walker that found no edges would pass vacuously.
    assert "workspace_manager._policy" in graph["workspace_manager"]
    assert "workspace_manager._notes" in graph["workspace_manager._policy"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_cycle_through_a_deferred_relative_import_is_found(tmp_path):
    _write(tmp_path, {
        "__init__.py": "",
        "a.py": "from .b import thing\n",
        "b.py": "def f():\n    from .sub import c\n",
        "sub/__init__.py": "",
        "sub/c.py": "from ..a import x\n",
    })
    cycle = find_cycle(import_graph(tmp_path, "pkg"))
    assert cycle == ["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"]


def test_a_cycle_through_absolute_imports_is_found(tmp_path):
    _write(tmp_path, {"__init__.py": "", "a.py": "import pkg.b\n", "b.py": "from pkg import a\n"})
    assert find_cycle(import_graph(tmp_path, "pkg")) == ["pkg.a", "pkg.b", "pkg.a"]


def test_an_acyclic_package_passes(tmp_path):
    _write(tmp_path, {"__init__.py": "from .a import x\n", "a.py": "from .b import y\n", "b.py": "import os\n"})
    graph = import_graph(tmp_path, "pkg")
    assert graph == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.b"}, "pkg.b": set()}
    assert find_cycle(graph) is None


# -- private names across packages ---------------------------------------------------------------

REPO = PACKAGE_DIR.parent
#: Packages that use the core from outside; what they need must be public.
CONSUMERS = ("te_integration", "benchmarks", "testbed", "examples")


def private_imports(root: Path, package: str) -> list[str]:
    """``file: statement`` for each import, under ``root``, of a private
    module or name of ``package`` (a dotted part or a name starting with _)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and not node.level and node.module:
                modules, names = [node.module], [alias.name for alias in node.names]
            elif isinstance(node, ast.Import):
                modules, names = [alias.name for alias in node.names], []
            else:
                continue
            for module in modules:
                parts = module.split(".")
                if parts[0] != package:
                    continue
                if any(p.startswith("_") for p in parts[1:]) or any(n.startswith("_") for n in names):
                    found.append(f"{path.relative_to(root)}: {ast.unparse(node)}")
    return found


def test_no_consumer_imports_a_private_name_of_the_core():
    for consumer in CONSUMERS:
        assert (REPO / consumer).is_dir(), consumer
        assert private_imports(REPO / consumer, "workspace_manager") == []


def test_a_private_import_from_another_package_is_found(tmp_path):
    _write(tmp_path, {
        "ok.py": "from workspace_manager import plan_call\nimport workspace_manager.testing\n",
        "bad.py": "from workspace_manager._profiles import X\n",
        "worse.py": "def f():\n    from workspace_manager.testing import _model\n",
    })
    assert private_imports(tmp_path, "workspace_manager") == [
        "bad.py: from workspace_manager._profiles import X",
        "worse.py: from workspace_manager.testing import _model",
    ]


# -- tests, testbed and benchmarks ---------------------------------------------------------------

#: folder -> the top-level packages nothing under it may import.
FORBIDDEN = {"tests": ("benchmarks",), "testbed": ("benchmarks", "tests"), "benchmarks": ("tests",)}


def _imported(node: ast.AST) -> list[str]:
    """The absolute module names one node imports: an import statement, or a
    call of ``importlib.import_module`` / ``__import__`` with a literal name."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        return [node.module] if node.module and not node.level else []
    if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
            return [node.args[0].value]
    return []


def imports_of(root: Path, packages: tuple[str, ...]) -> list[str]:
    """``file: module`` for each import, under ``root``, of ``packages`` or a module in them."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            found += [f"{path.relative_to(root)}: {module}" for module in _imported(node)
                      if module.split(".")[0] in packages]
    return found


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_tests_testbed_and_benchmarks_import_one_way(folder):
    assert (REPO / folder).is_dir(), folder
    assert imports_of(REPO / folder, FORBIDDEN[folder]) == []


def test_the_shared_testbed_is_what_both_sides_import():
    # the check above is not vacuous: both sides do import testbed
    assert imports_of(REPO / "tests" / "gpu", ("testbed",)) and imports_of(REPO / "benchmarks", ("testbed",))


def test_an_import_of_a_forbidden_package_is_found(tmp_path):
    _write(tmp_path, {
        "ok.py": "import testbed.model\nfrom . import benchmarks\nfrom benchmarking import x\n",
        "top.py": "from benchmarks import _harness\n",
        "deferred.py": "def f():\n    import benchmarks.timeline\n",
        "by_name.py": "import importlib\nimportlib.import_module('benchmarks.plot')\n__import__('tests')\n",
    })
    assert imports_of(tmp_path, ("benchmarks", "tests")) == [
        "by_name.py: benchmarks.plot", "by_name.py: tests", "deferred.py: benchmarks.timeline", "top.py: benchmarks",
    ]


# -- benchmarks: a leaf over the public APIs ---------------------------------------------------------

#: te_integration's layers, whatever their modules are named: what a user of the package never imports.
BINDING_LAYERS = ("runtime", "te", "kinds")


def _is_layer(module: str) -> bool:
    parts = module.split(".")
    return parts[0] == "te_integration" and len(parts) > 1 and parts[1] in BINDING_LAYERS


def internal_imports(root: Path) -> list[str]:
    """``file: module`` for each import, under ``root``, of a private module
    or name of ``workspace_manager`` or ``te_integration`` (a part starting
    with _), or of one of the binding's layers (:data:`BINDING_LAYERS`)."""
    found = private_imports(root, "workspace_manager") + private_imports(root, "te_integration")
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            modules = _imported(node)
            if isinstance(node, ast.ImportFrom) and not node.level and node.module and not _is_layer(node.module):
                modules += [f"{node.module}.{alias.name}" for alias in node.names]  # from te_integration import te
            found += [f"{path.relative_to(root)}: {module}" for module in modules if _is_layer(module)]
    return sorted(found)


def test_the_benchmarks_import_only_the_packages_public_names():
    assert imports_of(REPO / "benchmarks", ("te_integration",)) and imports_of(REPO / "benchmarks",
                                                                                 ("workspace_manager",))
    assert internal_imports(REPO / "benchmarks") == []


def test_an_import_of_the_bindings_internals_is_found(tmp_path):
    _write(tmp_path, {
        "ok.py": "import te_integration as ti\nfrom workspace_manager import LeanWorkspacePolicy\n",
        "layer.py": "def f():\n    from te_integration.runtime import stale\n",
        "layer_by_name.py": "from te_integration import kinds\n",
        "private.py": "from te_integration.debug import _levers\n",
    })
    assert internal_imports(tmp_path) == [
        "layer.py: te_integration.runtime", "layer_by_name.py: te_integration.kinds",
        "private.py: from te_integration.debug import _levers"]


def test_the_benchmarks_import_in_no_circle():
    graph = import_graph(REPO / "benchmarks", "benchmarks")
    assert "benchmarks._harness" in graph["benchmarks._runner"]  # not vacuous: the graph sees the package
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


# -- te_integration's layers: te/, runtime/, kinds/ ------------------------------------------------

BINDING_DIR = REPO / "te_integration"
#: layer -> the layers none of its modules may import (the package root, which imports all three, is none).
LAYERS = {"te": ("runtime", "kinds"), "runtime": ("kinds",), "kinds": ()}


def layer_violations(graph: dict[str, set[str]], package: str) -> list[str]:
    """``module -> imported`` for each import of a layer the importer's layer may not import."""
    def layer(module: str) -> str | None:
        parts = module.split(".")
        return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None

    return sorted(f"{module} -> {target}" for module, targets in graph.items() for target in targets
                  if layer(module) and layer(target) in LAYERS[layer(module)])


def test_te_integration_has_no_import_cycle_and_its_layers_import_downwards_only():
    graph = import_graph(BINDING_DIR, "te_integration")
    # Not vacuous: the root imports each layer, and a kind imports the runtime and the TE layer.
    assert {"te_integration.kinds", "te_integration.runtime._modules"} <= graph["te_integration"]
    assert {"te_integration.runtime._kind_registry", "te_integration.te._compat"} <= graph["te_integration.kinds.linear"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
    assert layer_violations(graph, "te_integration") == []


def test_a_layer_importing_upwards_is_found(tmp_path):
    _write(tmp_path, {
        "__init__.py": "from . import kinds\n",
        "te/__init__.py": "", "te/_compat.py": "def f():\n    from ..runtime import _state\n",
        "runtime/__init__.py": "", "runtime/_state.py": "from ..te import _compat\n",
        "runtime/_bad.py": "from ..kinds.linear import KIND\n",
        "kinds/__init__.py": "", "kinds/linear.py": "from ..runtime import _state\n",
    })
    assert layer_violations(import_graph(tmp_path, "te_integration"), "te_integration") == [
        "te_integration.runtime._bad -> te_integration.kinds.linear",
        "te_integration.te._compat -> te_integration.runtime",
        "te_integration.te._compat -> te_integration.runtime._state",
    ]


def kind_names(kinds_dir: Path) -> set[str]:
    """The names a kind goes by in code, read from each kind file: its classes
    (its drop-ins), the TE classes they subclass and the TE classes and
    Functions its adapter names (``te_class=te.TELinear``,
    ``function=te.LinearFunction``: the attribute after the TE layer's
    alias), the name of its TE Function (``name="_Linear"``), and its
    ``ModuleKind``'s name as a constant (``ModuleKind("linear")``: ``LINEAR``)."""
    names: set[str] = set()

    def te_attribute(node: ast.AST) -> set[str]:
        return ({node.attr} if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in ("te", "te_ops") else set())

    for path in sorted(kinds_dir.glob("*.py")):
        if path.name == "__init__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ClassDef):
                names.add(node.name)
                names |= set().union(*map(te_attribute, node.bases))
            elif isinstance(node, ast.Call):
                for keyword in node.keywords:
                    if keyword.arg in ("te_class", "function"):
                        names |= te_attribute(keyword.value)
                    elif keyword.arg == "name" and isinstance(keyword.value, ast.Constant):
                        names.add(keyword.value.value)
                if getattr(node.func, "id", None) == "ModuleKind" and isinstance(node.args[0], ast.Constant):
                    names.add(node.args[0].value.upper())
    return names


def named_kinds(source: str, names: set[str]) -> list[str]:
    """The identifiers in ``source``'s code (names and attributes; not strings,
    docstrings or comments) that are among ``names``."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name) and node.id in names:
            found.add(node.id)
        elif isinstance(node, ast.Attribute) and node.attr in names:
            found.add(node.attr)
        elif isinstance(node, ast.alias) and node.name.split(".")[-1] in names:
            found.add(node.name.split(".")[-1])
    return sorted(found)


def test_the_runtime_names_no_kind():
    names = kind_names(BINDING_DIR / "kinds")
    # Not vacuous: every kind's drop-in and TE class is among the names looked for.
    assert {"Linear", "TELinear", "LinearFunction", "_Linear", "LINEAR", "GroupedLinear", "TEGroupedLinear",
            "GroupedFunction", "OpsBasicLinear", "BasicLinear", "OPS_BASIC_LINEAR", "OpsGroupedLinear", "OpsLinear",
            "LayerNormMLP", "TELayerNormMLP", "LAYERNORM_MLP"} <= names
    found = {path.relative_to(REPO).as_posix(): named_kinds(path.read_text(), names)
             for path in sorted((BINDING_DIR / "runtime").glob("*.py"))}
    assert {path: hits for path, hits in found.items() if hits} == {}


def test_a_runtime_module_naming_a_kind_is_found():
    names = {"Linear", "TELinear", "LINEAR"}
    bad = ("from ..te import _compat as te\nfrom ..kinds.linear import Linear\n"
           "def f(m):\n    '''Linear, in a docstring, is fine'''\n"
           "    return isinstance(m, te.TELinear) or m is KINDS.LINEAR\n")
    assert named_kinds(bad, names) == ["LINEAR", "Linear", "TELinear"]
    assert named_kinds("x = 'Linear'  # Linear\n", names) == []
