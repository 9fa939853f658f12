"""What :func:`~workspace_manager.testing.check_quantizer` returns."""

from __future__ import annotations

import enum
import textwrap
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from .._context import QuantizerCapabilities

__all__ = ["CheckStatus", "CheckResult", "QuantizerReport", "QuantizerCheckError"]


class CheckStatus(enum.Enum):
    PASSED = "pass"
    FAILED = "FAIL"
    SKIPPED = "skip"


@dataclass(frozen=True)
class CheckResult:
    """One check: its name (``"columnwise_derivable"``, ``"policy: ..."``,
    ``"lifecycle: ..."``), its status, and why, in words. ``cause``: the
    reason in one line, where a failed walk's reason also says where it
    failed (the report gives results of one status and cause one line);
    by default the reason's first line."""

    name: str
    status: CheckStatus
    reason: str
    cause: str = ""

    @property
    def failed(self) -> bool:
        return self.status is CheckStatus.FAILED

    @property
    def one_line(self) -> str:
        """The cause, or the reason's first line."""
        return self.cause or (self.reason.splitlines() or [""])[0]

    def render(self) -> str:
        first, *rest = self.reason.splitlines() or [""]
        head = f"{self.status.value:<4}  {self.name}: {first}"
        return "\n".join([head, *(textwrap.indent(line, "        ") for line in rest)])


class QuantizerCheckError(AssertionError):
    """Raised by :meth:`QuantizerReport.raise_for_failures`; its message is the report."""

    def __init__(self, report: QuantizerReport) -> None:
        super().__init__(str(report))
        self.report = report


@dataclass(frozen=True)
class QuantizerReport:
    """Every check :func:`check_quantizer` ran on one quantizer."""

    quantizer: str
    """The quantizer's qualified class name."""
    capabilities: QuantizerCapabilities
    """The capabilities it was checked against."""
    results: tuple[CheckResult, ...]
    """The checks of the quantizer itself."""
    policy: CheckResult | None = None
    """The policy invariants for these capabilities, summed up in one result.
    They read only the three capability flags, never the quantizer, so they
    are reported once and not counted among the checks of the quantizer;
    they still fail the report if they break (a bug in workspace_manager)."""

    @property
    def passed(self) -> bool:
        return not self.failures

    @property
    def failures(self) -> tuple[CheckResult, ...]:
        return tuple(r for r in self._all() if r.failed)

    def _all(self) -> tuple[CheckResult, ...]:
        return self.results if self.policy is None else (*self.results, self.policy)

    def __getitem__(self, name: str) -> CheckResult:
        for result in self._all():
            if result.name == name:
                return result
        raise KeyError(f"no check named {name!r}; checks: {', '.join(r.name for r in self._all())}")

    def raise_for_failures(self) -> None:
        """Raise :class:`QuantizerCheckError` (an AssertionError) if any check failed."""
        if self.failures:
            raise QuantizerCheckError(self)

    def __str__(self) -> str:
        """The verdict, the claims and the policy checks (apart: they are no
        check of the quantizer), then one line per group of checks that
        share a status and a cause: failures first, a group's line naming
        how many checks it stands for."""
        caps = self.capabilities
        skipped = sum(r.status is CheckStatus.SKIPPED for r in self.results)
        own_failures = [r for r in self.results if r.failed]
        verdict = f"{len(own_failures)} of {len(self.results)} checks failed" if own_failures else (
            f"all {len(self.results) - skipped} checks passed"
        )
        if self.policy is not None and self.policy.failed:
            verdict += "; the policy checks failed (a bug in workspace_manager)"
        lines = [
            f"check_quantizer({self.quantizer}): {verdict}" + (f", {skipped} skipped" if skipped else ""),
            f"  claimed: {caps.name} (columnwise_derivable={caps.columnwise_derivable}, "
            f"derived_caches={caps.derived_caches}, requantization_safe={caps.requantization_safe})",
        ]
        if self.policy is not None:
            lines.append(f"  {self.policy.name}: {self.policy.status.value}, {self.policy.reason}")
        order = {CheckStatus.FAILED: 0, CheckStatus.SKIPPED: 1, CheckStatus.PASSED: 2}
        groups: dict[tuple[CheckStatus, str], list[CheckResult]] = {}
        for result in sorted(self.results, key=lambda r: order[r.status]):  # stable: order kept otherwise
            groups.setdefault((result.status, result.one_line), []).append(result)
        return "\n".join(lines + [_render_group(group) for group in groups.values()])


#: The prefix of the lifecycle checks' names, one per module setting.
LIFECYCLE = "lifecycle: "


def _group_label(group: list[CheckResult]) -> str:
    """The checks of a group by name, its lifecycle settings counted."""
    names = [r.name for r in group if not r.name.startswith(LIFECYCLE)]
    settings = len(group) - len(names)
    if settings:
        names.append(f"lifecycle ({settings} settings)")
    return ", ".join(names)


def _render_group(group: list[CheckResult]) -> str:
    """One result as it is; several of one status and cause in one line.
    Failures then say where each happened (a walk: which one, at which
    event) and give the first one's details (a walk's: its events)."""
    if len(group) == 1:
        return group[0].render()
    first = group[0]
    head = f"{first.status.value:<4}  {_group_label(group)}: {first.one_line}"
    if not first.failed:  # passed or skipped alike, for the same reason
        return head
    where = [r.name.removeprefix(LIFECYCLE) + (f" ({r.reason.split(':', 1)[0]})" if r.cause else "") for r in group]
    shown = next((r for r in group if len(r.reason.splitlines()) > 1), None)
    detail = ["in:", *(f"  {w}" for w in where)]
    if shown is not None:
        detail += [f"first, {shown.name}:", *shown.reason.splitlines()[1:]]
    return "\n".join([head, *(textwrap.indent(line, "        ") for line in detail)])


def describe_exception(err: BaseException) -> str:
    """``Type: message (at file:line in function)``, naming the innermost frame."""
    frames = traceback.extract_tb(err.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
    return f"{type(err).__name__}: {err}{where}"


def guarded(name: str, check: Callable[[], CheckResult]) -> CheckResult:
    """Run ``check``; an exception it raises (an assertion, or an error in
    the quantizer under test) becomes a failed result."""
    try:
        return check()
    except AssertionError as err:
        return CheckResult(name, CheckStatus.FAILED, str(err))
    except Exception as err:  # the quantizer under test may raise anything
        return CheckResult(name, CheckStatus.FAILED, "the quantizer raised " + describe_exception(err))
