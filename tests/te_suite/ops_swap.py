"""The te.ops part of the TE-suite swap (``--te-suite-ops``): ``te.ops.BasicLinear``
and ``te.ops.GroupedLinear`` replaced by ``te_integration``'s drop-ins.

Rebound where TE's tests and TE's own constructors look the names up at
call time: the ``te.ops`` and ``te.ops.basic`` packages (``te_ops.BasicLinear(...)``,
``te_ops.basic.BasicLinear(...)``) and ``ops/linear.py``, whose
``te.ops.Linear`` builds its op from its module global. TE's fused ops keep
their own import of TE's class: they only test ``isinstance`` and call
``BasicLinear._functional_forward`` through it, which the drop-ins pass.
``te.ops.Linear`` itself stays TE's class (with a drop-in op inside).
"""

from __future__ import annotations

import importlib

from .plugin import Rebinding, SwapError, qualname

__all__ = ["OPS_SWAPS", "swap_ops", "check_ops"]

_OPS = "transformer_engine.pytorch.ops"
#: name -> (module defining TE's class, namespaces rebinding it, the drop-in's name in the provider).
OPS_SWAPS = {
    "BasicLinear": (f"{_OPS}.basic.basic_linear", (_OPS, f"{_OPS}.basic", f"{_OPS}.linear"), "OpsBasicLinear"),
    "GroupedLinear": (f"{_OPS}.basic.grouped_linear", (_OPS, f"{_OPS}.basic"), "OpsGroupedLinear"),
}


def _stock(name: str) -> type:
    return getattr(importlib.import_module(OPS_SWAPS[name][0]), name)


def check_ops(expected: dict[str, type]) -> None:
    """SwapError unless every namespace holds ``expected[name]``."""
    wrong = []
    for name, (_, spaces, _) in OPS_SWAPS.items():
        for space in spaces:
            held = getattr(importlib.import_module(space), name, None)
            if held is not expected[name]:
                wrong.append(f"{space}.{name} is {qualname(held)}, expected {qualname(expected[name])}")
    if wrong:
        raise SwapError("; ".join(wrong))


def swap_ops(provider_name: str | None) -> tuple[list[Rebinding], dict[str, type]]:
    """Rebind the te.ops names to ``provider_name``'s drop-ins (None: check
    they are TE's own); the rebindings and the classes now expected."""
    stock = {name: _stock(name) for name in OPS_SWAPS}
    check_ops(stock)
    if provider_name is None:
        return [], stock
    provider = importlib.import_module(provider_name)
    dropins = {name: getattr(provider, attr) for name, (_, _, attr) in OPS_SWAPS.items()}
    for name, cls in dropins.items():
        if not (isinstance(cls, type) and issubclass(cls, stock[name])):
            raise SwapError(f"{qualname(cls)} is not a subclass of {qualname(stock[name])}")
    done = []
    for name, (_, spaces, _) in OPS_SWAPS.items():
        for space in spaces:
            setattr(importlib.import_module(space), name, dropins[name])
            done.append(Rebinding(space, name, qualname(stock[name]), qualname(dropins[name])))
    check_ops(dropins)
    return done, dropins
