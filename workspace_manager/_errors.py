"""Exceptions raised by the workspace manager.

Every error raised for user input is a subclass of :class:`ValueError` or
:class:`TypeError` (a lookup in a mapping, :class:`KeyError`), so callers that
already guard configuration code with those built-ins keep working, and each
message says what was received and what is allowed.
"""

from __future__ import annotations

__all__ = [
    "WorkspaceManagerError",
    "InvalidContextError",
    "ContextTypeError",
    "PolicyMismatchError",
    "UnsupportedPlanError",
    "UnknownPolicyError",
    "UnknownQuantizerError",
    "UnknownRecipeError",
    "UnknownProfileError",
    "DuplicateQuantizerError",
    "InvalidCapabilitiesError",
    "InvalidPlanError",
    "QuantizerPluginError",
    "KitArgumentError",
]


class WorkspaceManagerError(Exception):
    """Base class of every error the workspace manager raises on purpose."""


class InvalidContextError(WorkspaceManagerError, ValueError):
    """A call context whose fields are of the right type but cannot occur together."""


class ContextTypeError(WorkspaceManagerError, TypeError):
    """A call context or capability field that received a value of the wrong type."""


class PolicyMismatchError(WorkspaceManagerError, ValueError):
    """A policy was asked to plan a call in a setting it does not cover."""


class UnsupportedPlanError(PolicyMismatchError):
    """A valid plan that the installed binding cannot carry out for this call
    (for TE 2.20: a plan asking for something TE's code has no lever for).
    The message names the plan field, the context and what to change; the
    call is refused before anything runs, never carried out differently."""


class UnknownQuantizerError(WorkspaceManagerError, TypeError):
    """No capabilities are registered for a quantizer class or any of its bases."""


class _NamedKeyError(KeyError):
    def __str__(self) -> str:  # KeyError's own quotes the message as a repr
        return str(self.args[0]) if self.args else ""


class UnknownPolicyError(WorkspaceManagerError, _NamedKeyError, ValueError):
    """``named_policy(name)`` for a name that is no shipped policy's, in any
    case. A :class:`ValueError`, as ``named_policy`` raised before it had a
    class of its own, and a :class:`KeyError`, the error of a failed lookup;
    its message names the policies and the closest one."""


class UnknownRecipeError(WorkspaceManagerError, _NamedKeyError):
    """``RECIPE_PROFILES[name]`` for a name that is no TE recipe. A
    :class:`KeyError`, so ``in`` and ``.get`` work as for any mapping; its
    message names the recipes that exist."""


class UnknownProfileError(WorkspaceManagerError, _NamedKeyError):
    """``PROFILES[name]`` for a name that is no capability profile. A
    :class:`KeyError`, so ``in`` and ``.get`` work as for any dict; its
    message names the profiles that exist, and ``RECIPE_PROFILES`` where the
    name is a TE recipe's."""


class DuplicateQuantizerError(WorkspaceManagerError, ValueError):
    """A quantizer class was registered twice without ``override=True``."""


class InvalidCapabilitiesError(WorkspaceManagerError, TypeError):
    """A registration that cannot be made: the quantizer is neither a class
    nor its qualified name, or the capabilities are neither a profile nor a
    callable returning one."""


class InvalidPlanError(WorkspaceManagerError, ValueError):
    """A plan whose decisions contradict each other (raised when a policy,
    typically a user-written one, builds such a plan)."""


class QuantizerPluginError(WorkspaceManagerError, ValueError):
    """An installed package's ``workspace_manager.quantizers`` entry point
    failed to load or to register its quantizers. The message names the entry
    point and its distribution."""


class KitArgumentError(WorkspaceManagerError, TypeError, ValueError):
    """``workspace_manager.testing.check_quantizer`` received an argument it
    cannot use (a factory that is not callable, a count that is not positive)."""
