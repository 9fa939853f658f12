"""The optimizer step's tasks run in the order ``_step_hook.ORDER`` declares,
whatever order the runtime's modules were imported in; and the runtime keeps
no module-level state but registries."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from _binding_standin import ROOT, load_binding
from _fake_te import compat

#: Two import orders of the modules that register step tasks.
ORDERS = (
    ("runtime._step_hook", "runtime._model", "runtime._freshness", "runtime._shards", "runtime._gather",
     "runtime._attribution"),
    ("runtime._attribution", "runtime._gather", "runtime._shards", "runtime._freshness", "runtime._model",
     "runtime._step_hook"),
)


def _run_order(monkeypatch, order: tuple[str, ...]) -> list[str]:
    loaded = load_binding(monkeypatch, compat(), *order)
    hook = loaded["runtime._step_hook"]
    ran: list[str] = []
    for name, task in list(hook._TASKS.items()):
        monkeypatch.setitem(hook._TASKS, name, lambda step, name=name, task=task: (ran.append(name), task(step)))
    hook._after_optimizer_step(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1), (), {})
    return ran


@pytest.mark.parametrize("order", ORDERS, ids=["dependencies-first", "dependents-first"])
def test_the_step_tasks_run_in_the_declared_order_whatever_the_import_order(monkeypatch, order):
    hook_order = load_binding(monkeypatch, compat(), "runtime._step_hook")["runtime._step_hook"].ORDER
    assert _run_order(monkeypatch, order) == list(hook_order)


def test_a_step_task_outside_the_declared_order_is_refused(monkeypatch):
    hook = load_binding(monkeypatch, compat(), "runtime._step_hook")["runtime._step_hook"]
    with pytest.raises(ValueError, match="'flush' is not a step task; the tasks are weights_written"):
        hook.step_task("flush")
    hook.step_task("step_caches")(_a_task)
    with pytest.raises(ValueError, match="'step_caches' is already .*_a_task; each task has one function"):
        hook.step_task("step_caches")(lambda step: None)


def _a_task(step) -> None:
    """A step task for the refusal above."""


#: Every module-level mutable object of ``te_integration/runtime``, with why
#: it is the process's: a registry, TE's or torch's installed seams, or a
#: value cache keyed by types or values. A new one needs a reason here.
REGISTRIES = {
    "_attribution.ACTIVE_RECORDINGS": "the registry of recordings active now (each adds itself for its block)",
    "_construction._CONSTRUCTION_LOCK": "guards the rebinding of TE's module globals (installed seams)",
    "_expert_quantize._METHODS": "TE's quantizer classes -> how their experts quantize at once (by type)",
    "_gemm_watch._ACTIVE_WATCH": "the GEMM watch replaces TE's GEMM functions (installed seams): one at a time",
    "_gemm_watch._LAYOUT_POSITION": "a constant: where TE 2.20.2's GEMM functions take their layout",
    "_install.SEAM_FUNCTIONS": "each kind's Function seam (installed seams)",
    "_install._LOCK": "guards installing the seams",
    "_install.INSTALLED": "whether the seams are installed in TE's module files",
    "_install._SEAMED": "the names the installed seams hold",
    "_install._REPLACED": "TE's definitions the installed seams replaced",
    "_model._BY_ROOT": "the registry of model states by root module (weak), as FSDP2 maps a root to its state",
    "_model._LOCK": "guards the model registry and pending releases",
    "_model._MODELS": "the registry of live model states (weak), which the step hook walks",
    "_modules._CONVERTED": "the drop-in classes made for third-party TE subclasses (by type)",
    "_quantize._EXPERT_KEYS": "the cache keys weight0, weight1, ...: strings made once",
    "_kind_registry.OP_HOOKS": "the registry of te.ops kinds",
    "_kind_registry._ADAPTERS": "the registry of module kinds",
    "_saved_tensors.PER_TENSOR_LAYOUTS": "TE's per-tensor FP8 storage classes (by type)",
    "_state._CAPABILITY_TOKENS": "capabilities (values) -> small ints for memo keys",
    "_state._IS_QUANTIZED": "weight type -> whether it is a quantized tensor (by type)",
    "_step_hook._HOOK": "torch's handle of the one installed optimizer-step hook",
    "_step_hook._LOCK": "guards installing the optimizer-step hook",
    "_step_hook._PLACEMENTS": "per optimizer (weak), the parameters its step writes",
    "_step_hook._TASKS": "the registry of step tasks, run in ORDER",
}
_MUTABLE_CALLS = {"dict", "list", "set", "WeakSet", "WeakKeyDictionary", "WeakValueDictionary", "Lock", "RLock",
                  "defaultdict", "OrderedDict", "deque"}


def _module_level_mutables(path: Path) -> list[str]:
    """Module-level names bound to a mutable container, and names functions
    rebind with ``global``."""
    tree = ast.parse(path.read_text())
    found = [f"{path.stem}.{name}" for node in ast.walk(tree) if isinstance(node, ast.Global) for name in node.names]
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        called = value.func.attr if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) else \
            value.func.id if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) else None
        if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)) or \
                called in _MUTABLE_CALLS:
            found.extend(f"{path.stem}.{t.id}" for t in targets if isinstance(t, ast.Name) and t.id != "__all__")
    return found


def test_the_runtime_keeps_no_module_level_state_but_registries():
    found = sorted(name for path in (ROOT / "te_integration" / "runtime").glob("*.py")
                   for name in _module_level_mutables(path))
    unexplained = sorted({name for name in found if name not in REGISTRIES})
    assert not unexplained, f"module-level mutable state without a reason in REGISTRIES: {unexplained}"
    assert sorted(REGISTRIES) == sorted(set(found)), "REGISTRIES names an object that is gone"
