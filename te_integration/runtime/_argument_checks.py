"""Argument checks shared by the public functions: each error names the
function, the argument, what was expected, what arrived and how to fix it.
Checks run before anything is changed, so a refused call changes nothing."""

from __future__ import annotations

from typing import Any

import torch

from workspace_manager import Policy


def _received(value: Any) -> str:
    return f"received {type(value).__name__} {value!r:.80}"


def expect_module(func: str, arg: str, value: Any) -> None:
    if not isinstance(value, torch.nn.Module):
        raise TypeError(f"{func}: {arg} must be a torch.nn.Module; {_received(value)}.")


def expect_te_module(func: str, arg: str, value: Any, te_classes: tuple[type, ...], hint: str) -> None:
    """``value`` is a TE Linear, LayerNormLinear or LayerNormMLP (stock or drop-in)."""
    expect_module(func, arg, value)
    if not isinstance(value, te_classes):
        names = ", ".join(c.__name__ for c in te_classes)
        raise TypeError(f"{func}: {arg} must be a TE module ({names}); received {type(value).__name__}. {hint}")


def expect_policy(func: str, value: Any) -> None:
    """``value`` is a policy (a ``workspace_manager.Policy`` instance) or None."""
    if value is None or isinstance(value, Policy):
        return
    if isinstance(value, type) and issubclass(value, Policy):
        raise TypeError(f"{func}: policy must be a Policy instance or None; received the class "
                        f"{value.__name__}. Pass an instance: {value.__name__}().")
    raise TypeError(f"{func}: policy must be a Policy (from workspace_manager, e.g. FSDP2WorkspacePolicy()) or "
                    f"None; {_received(value)}.")


def expect_callable(func: str, arg: str, value: Any) -> None:
    """``value`` is callable or None."""
    if value is not None and not callable(value):
        raise TypeError(f"{func}: {arg} must be callable or None; {_received(value)}.")


def expect_bool(func: str, arg: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{func}: {arg} must be True or False; {_received(value)}.")
