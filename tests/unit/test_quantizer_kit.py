"""The quantizer testing kit: the reference quantizer passes it, broken ones
are rejected with a report that names the quantizer and the failed check."""

from __future__ import annotations

import dataclasses
import functools
import re

import pytest
import torch

from workspace_manager import InvalidCapabilitiesError, QuantizerCapabilities, UnknownQuantizerError, Usage
from workspace_manager.extending import QuantizerRegistry
from workspace_manager.testing import (
    CheckStatus,
    KitArgumentError,
    Freshness,
    QuantizerCheckError,
    QuantizerRuntime,
    QuantizerUnderTest,
    check_quantizer,
)
from workspace_manager.testing import invariants as inv
from workspace_manager.testing.reference import (
    FLOAT8_MAX,
    REFERENCE_CAPABILITIES,
    Float8PerTensorQuantizer,
)

FAST = dict(examples=2, steps=25)


class LeakyTransposeQuantizer(Float8PerTensorQuantizer):
    """Broken: clear_derived keeps the transpose cache (TE#2717's leak)."""

    def clear_derived(self, handle) -> None:
        pass


class PerColumnScaleQuantizer(Float8PerTensorQuantizer):
    """Broken: claims columnwise_derivable, but a direct columnwise
    quantization scales each weight column on its own, so the transpose of
    the (per-tensor) rowwise data is not what it builds."""

    def quantize(self, weight, *, rowwise, columnwise):
        handle = super().quantize(weight, rowwise=True, columnwise=False)
        if not rowwise:
            handle.rowwise = None
        if columnwise:
            wt = weight.detach().float().t().contiguous()
            handle.column_scales = FLOAT8_MAX / wt.abs().amax(dim=1, keepdim=True).clamp_min(1e-12)
            handle.columnwise = (wt * handle.column_scales).clamp(-FLOAT8_MAX, FLOAT8_MAX).to(torch.float8_e4m3fn)
        return handle

    def dequantize(self, handle, usage):
        if usage is Usage.COLUMNWISE and hasattr(handle, "column_scales") and Usage.COLUMNWISE not in handle.derived:
            return (handle.columnwise.float() / handle.column_scales).t()
        return super().dequantize(handle, usage)


def test_the_reference_quantizer_passes_the_kit():
    report = check_quantizer(Float8PerTensorQuantizer, REFERENCE_CAPABILITIES)
    report.raise_for_failures()
    assert report.passed and report.quantizer == "workspace_manager.testing.reference.Float8PerTensorQuantizer"
    names = [r.name for r in report.results]
    assert names[:5] == ["protocol", "usages", "columnwise_derivable", "derived_caches", "requantization_safe"]
    # The policy invariants read only the capability flags: one result, apart from the quantizer's checks.
    assert not any(n.startswith("policy") for n in names)
    assert report.policy.name == "policy checks (independent of your quantizer)" and not report.policy.failed
    assert report.policy.reason.startswith(f"{len(inv.PLAN_INVARIANTS) + len(inv.CONTEXT_INVARIANTS)} invariants held")
    assert sum(n.startswith("lifecycle: ") for n in names) == 16
    assert str(report).startswith(
        f"check_quantizer(workspace_manager.testing.reference.Float8PerTensorQuantizer): all {len(names)} checks passed"
    )
    assert isinstance(Float8PerTensorQuantizer(), QuantizerUnderTest)


def test_a_quantizer_that_keeps_its_transpose_after_clearing_is_rejected():
    report = check_quantizer(LeakyTransposeQuantizer, REFERENCE_CAPABILITIES, **FAST)
    failed = {r.name for r in report.failures}
    assert "derived_caches" in failed
    # the lifecycle catches it too, on its real bytes: FSDP2 quantized parameters
    assert "lifecycle: fsdp2_reshard quantized_param no microbatches" in failed
    assert not any(n.startswith(("policy", "lifecycle: none")) for n in failed)
    with pytest.raises(QuantizerCheckError) as info:
        report.raise_for_failures()
    text = str(info.value)
    assert isinstance(info.value, AssertionError) and info.value.report is report
    assert text.startswith(f"check_quantizer({__name__}.LeakyTransposeQuantizer): {len(failed)} of ")
    assert "FAIL  derived_caches: after clear_derived the handle still holds 65540 bytes" in text
    assert "TE#2717" in text
    assert "derived columnwise data (32768 bytes) alive on an idle FSDP2 parameter" in text
    assert "backward -> " in text  # the events that led there


def test_a_quantizer_that_cannot_really_derive_columnwise_data_is_rejected():
    report = check_quantizer(PerColumnScaleQuantizer, REFERENCE_CAPABILITIES, **FAST)
    assert [r.name for r in report.failures] == ["columnwise_derivable"]
    text = str(report)
    assert f"check_quantizer({__name__}.PerColumnScaleQuantizer)" in text
    assert "FAIL  columnwise_derivable: columnwise data derived from rowwise data differs from a direct columnwise" in text
    assert "elements differ, first at" in text


@pytest.mark.parametrize(
    "claim, reason",
    [
        (dict(columnwise_derivable=False), "update_usage(columnwise=True) derived columnwise data"),
        (dict(derived_caches=False), "register derived_caches=True"),
    ],
)
def test_claims_weaker_than_the_quantizer_are_rejected_too(claim, reason):
    caps = dataclasses.replace(REFERENCE_CAPABILITIES, name="understated", **claim)
    report = check_quantizer(Float8PerTensorQuantizer, caps, **FAST)
    assert report.failures and reason in str(report)


def test_requantization_safe_is_checked_on_one_quantizer_instance():
    class Drifting(Float8PerTensorQuantizer):
        """Delayed-scaling-like: each quantization moves the scale."""

        calls = 0

        def quantize(self, weight, *, rowwise, columnwise):
            self.calls += 1
            return super().quantize(weight * (1 + self.calls * 1e-3), rowwise=rowwise, columnwise=columnwise)

    report = check_quantizer(Drifting, REFERENCE_CAPABILITIES, **FAST)
    assert report["requantization_safe"].failed
    assert "quantizing the same weight twice with one quantizer gave other rowwise data" in report["requantization_safe"].reason
    honest = check_quantizer(Drifting, dataclasses.replace(REFERENCE_CAPABILITIES, requantization_safe=False), **FAST)
    assert honest["requantization_safe"].status is CheckStatus.SKIPPED and honest.passed


def test_a_format_that_cannot_derive_must_refuse():
    class Silent(Float8PerTensorQuantizer):
        def update_usage(self, handle, *, rowwise=None, columnwise=None):
            if columnwise and handle.columnwise is None:
                return  # neither derives nor raises
            super().update_usage(handle, rowwise=rowwise, columnwise=columnwise)

    caps = dataclasses.replace(REFERENCE_CAPABILITIES, name="silent", columnwise_derivable=False, derived_caches=False)
    report = check_quantizer(Silent, caps, **FAST)
    assert [r.name for r in report.failures] == ["columnwise_derivable"]
    assert "without columnwise data and without raising" in report["columnwise_derivable"].reason


def test_errors_raised_by_the_quantizer_are_reported_with_their_location():
    class Crashing(Float8PerTensorQuantizer):
        def bytes_held(self, handle):
            raise RuntimeError("bytes unknown")

    report = check_quantizer(Crashing, REFERENCE_CAPABILITIES, **FAST)
    reason = report["usages"].reason
    assert reason.startswith("the quantizer raised RuntimeError: bytes unknown (at ") and "in bytes_held)" in reason
    assert "the quantizer raised RuntimeError: bytes unknown" in report["lifecycle: fsdp2_reshard quantized_param no microbatches"].reason


def test_an_object_without_the_protocol_fails_the_protocol_check_only():
    report = check_quantizer(lambda: object(), REFERENCE_CAPABILITIES, **FAST)
    assert report["protocol"].failed
    assert "lacks quantize, update_usage, clear_derived, usages, bytes_held, dequantize" in report["protocol"].reason
    assert report["usages"].status is CheckStatus.SKIPPED
    assert not report.policy.failed


def test_capabilities_default_to_the_registered_ones():
    registry = QuantizerRegistry()
    with pytest.raises(UnknownQuantizerError, match="Float8PerTensorQuantizer"):
        check_quantizer(Float8PerTensorQuantizer, registry=registry)
    registry.register(Float8PerTensorQuantizer, REFERENCE_CAPABILITIES)
    report = check_quantizer(LeakyTransposeQuantizer, registry=registry, **FAST)  # inherits the entry
    assert report.capabilities is REFERENCE_CAPABILITIES and not report.passed


def test_reports_are_deterministic():
    first = str(check_quantizer(LeakyTransposeQuantizer, REFERENCE_CAPABILITIES, seed=3, **FAST))
    assert first == str(check_quantizer(LeakyTransposeQuantizer, REFERENCE_CAPABILITIES, seed=3, **FAST))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(factory=3), KitArgumentError, "factory must be a callable"),
        (dict(capabilities="fp8"), InvalidCapabilitiesError, "capabilities must be a QuantizerCapabilities"),
        (dict(examples=0), KitArgumentError, "examples must be a positive int"),
        (dict(shapes=[(128,)]), KitArgumentError, "shapes must be"),
        # one pair where a sequence of pairs is wanted: the message shows how to write it
        (dict(shapes=(128, 256)), KitArgumentError,
         r"received \(128, 256\); for one shape write shapes=\(\(128, 256\),\)"),
        (dict(shapes="128x256"), KitArgumentError, "shapes must be a non-empty sequence of"),
        (dict(seed="a"), KitArgumentError, r"seed must be a non-negative int; received 'a' \(str\)"),
        (dict(seed=True), KitArgumentError, r"seed must be a non-negative int; received True \(bool\)"),
        (dict(seed=-1), KitArgumentError, "seed must be a non-negative int"),
        (dict(dtype="float32"), KitArgumentError, r"dtype must be a floating-point torch.dtype .*received 'float32'"),
        (dict(dtype=torch.int8), KitArgumentError, "dtype must be a floating-point torch.dtype"),
    ],
)
def test_bad_arguments_are_user_errors(kwargs, error, match):
    args = {"factory": Float8PerTensorQuantizer, "capabilities": REFERENCE_CAPABILITIES, **kwargs}
    with pytest.raises(error, match=match) as info:
        check_quantizer(args.pop("factory"), args.pop("capabilities"), **args)
    assert isinstance(info.value, (TypeError, ValueError))


def test_a_factory_that_raises_without_capabilities_is_a_user_error():
    def factory():
        raise OSError("no device")

    with pytest.raises(KitArgumentError, match="factory\\(\\) raised OSError: no device"):
        check_quantizer(factory)
    report = check_quantizer(factory, QuantizerCapabilities(
        name="x", columnwise_derivable=False, derived_caches=False, requantization_safe=True))
    assert report["protocol"].failed and "factory() raised OSError: no device" in str(report)


def test_a_broken_policy_invariant_fails_the_report_but_is_not_blamed_on_the_quantizer(monkeypatch):
    import workspace_manager.testing._kit as kit

    def never_holds(policy, ctx, plan):
        raise inv.InvariantViolation("broken on purpose")

    monkeypatch.setattr(kit, "PLAN_INVARIANTS", (*inv.PLAN_INVARIANTS, never_holds))
    report = check_quantizer(Float8PerTensorQuantizer, REFERENCE_CAPABILITIES, **FAST)
    assert report.policy.failed and not report.passed
    assert report.failures == (report.policy,)
    checks = len(inv.PLAN_INVARIANTS) + len(inv.CONTEXT_INVARIANTS) + 1  # with never_holds
    assert f"1 of {checks} broken, a bug in workspace_manager" in report.policy.reason
    assert "policy: never_holds: broken on" in report.policy.reason
    text = str(report)
    assert text.splitlines()[0].endswith(
        f"all {len(report.results)} checks passed; the policy checks failed (a bug in workspace_manager)")
    assert "\n  policy checks (independent of your quantizer): FAIL, 1 of " in text
    with pytest.raises(QuantizerCheckError):
        report.raise_for_failures()


def test_an_unregistered_quantizer_is_told_how_to_pass_its_capabilities():
    from workspace_manager import UnknownQuantizerError

    with pytest.raises(UnknownQuantizerError) as info:
        check_quantizer(Float8PerTensorQuantizer)
    message = str(info.value)
    assert "No workspace capabilities are registered for quantizer class" in message
    assert message.endswith("Or pass them to the kit: check_quantizer(Float8PerTensorQuantizer, capabilities=...) "
                            "(the reference quantizer's are workspace_manager.testing.reference."
                            "REFERENCE_CAPABILITIES).")


@pytest.mark.parametrize(
    "freshness, write",
    [(Freshness.VERSION_COUNTER, "silent optimizer write"), (Freshness.STEP_GENERATION, "in-place write")],
    ids=["blind-to-silent-writes", "blind-to-in-place-writes"],
)
def test_the_lifecycle_walks_catch_a_runtime_that_reads_a_stale_copy(monkeypatch, freshness, write):
    """The walks write the weight behind the version counter's back and in
    place; a runtime missing one of the two freshness checks reads a copy of
    older data, and the report says which and after what."""
    import workspace_manager.testing._walks as walks

    monkeypatch.setattr(walks, "QuantizerRuntime", functools.partial(QuantizerRuntime, freshness=freshness))
    report = check_quantizer(Float8PerTensorQuantizer, REFERENCE_CAPABILITIES, **FAST)
    failed = {r.name: r.reason for r in report.failures}
    assert failed and all("stale copy: the " in reason for reason in failed.values())
    assert any(write in reason for reason in failed.values())  # the write that made it stale, in the trace
    # Under the default policies only a whole weight keeps a copy from one
    # call to the next (the microbatch cache, the FP8 parameter's transpose);
    # FSDP2 and distributed weights keep none across a write.
    assert all(name.startswith("lifecycle: none ") for name in failed)


class ClearCrashes(Float8PerTensorQuantizer):
    """Broken: clear_derived raises, which fails derived_caches and every
    setting whose plans clear derived data (FSDP2 quantized parameters)."""

    def clear_derived(self, handle) -> None:
        raise RuntimeError("no clearing here")


def _status_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line[:4] in ("pass", "FAIL", "skip")]


def _checks_on(line: str) -> int:
    """How many checks a report line stands for: its names, a lifecycle group counted by its settings."""
    names = line[6:].split(": ", 1)[0]
    settings = re.search(r"lifecycle \((\d+) settings\)", names)
    others = [n for n in re.sub(r"lifecycle \(\d+ settings\)", "", names).split(", ") if n.strip()]
    return len(others) + (int(settings.group(1)) if settings else 1 if names.startswith("lifecycle: ") else 0)


def test_failures_of_one_cause_are_one_line_that_says_where_each_happened():
    report = check_quantizer(ClearCrashes, REFERENCE_CAPABILITIES, **FAST)
    failed = [r.name for r in report.failures]
    assert failed[0] == "derived_caches" and len(failed) == 5  # and the four FSDP2 quantized-parameter settings
    text = str(report)
    assert text.splitlines()[0].endswith("): 5 of 21 checks failed")
    (fail,) = [line for line in _status_lines(text) if line.startswith("FAIL")]
    assert fail.startswith("FAIL  derived_caches, lifecycle (4 settings): the quantizer raised RuntimeError: "
                           "no clearing here (at ")
    lines = text.splitlines()
    at = lines.index(fail)
    assert lines[at + 1] == "        in:" and lines[at + 2] == "          derived_caches"
    assert all(re.fullmatch(r"          fsdp2_(reshard|keep) quantized_param (no )?microbatches "
                            r"\(walk \d+, at event \d+\)", line) for line in lines[at + 3:at + 7])
    assert lines[at + 7].startswith("        first, lifecycle: fsdp2_reshard quantized_param no microbatches:")
    # the lines stand for every check once: 21, however they are grouped
    assert sum(_checks_on(line) for line in _status_lines(text)) == len(report.results) == 21


def test_every_report_counts_the_same_checks_by_the_same_names():
    """A quantizer that passes, one that fails, one without the protocol:
    21 checks each, the same names in the same order (those not run are
    skipped by name), and the policy checks apart, on no status line."""
    reports = [check_quantizer(Float8PerTensorQuantizer, REFERENCE_CAPABILITIES, **FAST),
               check_quantizer(ClearCrashes, REFERENCE_CAPABILITIES, **FAST),
               check_quantizer(lambda: object(), REFERENCE_CAPABILITIES, **FAST)]
    names = [[r.name for r in report.results] for report in reports]
    assert names[0] == names[1] == names[2] and len(names[0]) == 21
    skipped = [r for r in reports[2].results if r.status is CheckStatus.SKIPPED]
    assert len(skipped) == 20 and str(reports[2]).splitlines()[0].endswith("1 of 21 checks failed, 20 skipped")
    for report in reports:
        text = str(report)
        assert not any("policy checks" in line for line in _status_lines(text))
        assert sum(_checks_on(line) for line in _status_lines(text)) == 21


def test_derived_caches_claimed_by_a_format_that_cannot_derive_is_said_to_be_unchecked():
    """Accepted (a hybrid format's direction may keep derived data of its
    own), but the kit cannot check it, and its report says so."""
    class NoDerive(Float8PerTensorQuantizer):
        def update_usage(self, handle, *, rowwise=None, columnwise=None):
            if columnwise and handle.columnwise is None:
                raise ValueError("this format quantizes each direction from the weight")
            super().update_usage(handle, rowwise=rowwise, columnwise=columnwise)

    caps = dataclasses.replace(REFERENCE_CAPABILITIES, name="compound", columnwise_derivable=False)
    assert caps.derived_caches
    report = check_quantizer(NoDerive, caps, **FAST)
    result = report["derived_caches"]
    assert result.status is CheckStatus.SKIPPED
    assert result.reason.startswith("claimed with columnwise_derivable=False, so nothing can be derived through the "
                                    "protocol and the claim is not checked")
    assert "register derived_caches=False" in result.reason
    assert str(report).splitlines()[0].endswith(", 1 skipped")
