"""Workspace attribution: which quantized weight copies are alive, where, and why.

A subpackage of its own because attribution is a different job from
deciding. The policies (``workspace_manager._policy``) say what a call
should do with its workspace; attribution watches what is actually alive
(weak references to storages, records, reports, timelines) and compares it
with the plan behind it. It needs the plan vocabulary (``_plan``) and
nothing of the policies, so the decisions can be read, tested and changed
without it, and it stays TE-free: ``te_integration`` records into its ledger
and builds ``workspace_report`` and ``record_workspaces`` on top.

Every public name here is also importable from ``workspace_manager``.
"""

from ._ledger import (
    Lifetime,
    LiveWorkspace,
    TimelinePoint,
    WorkspaceKind,
    WorkspaceLedger,
    WorkspaceRecord,
    WorkspaceReport,
    buffers_of,
    expected_lifetime,
    workspace_kind,
)

__all__ = [
    "WorkspaceKind",
    "Lifetime",
    "WorkspaceRecord",
    "LiveWorkspace",
    "TimelinePoint",
    "WorkspaceLedger",
    "WorkspaceReport",
    "workspace_kind",
    "expected_lifetime",
    "buffers_of",
]
