"""Checks of a quantizer against the protocol and its capability claims.

Each check quantizes a few deterministic weights with fresh quantizers from
the author's factory and compares what :meth:`QuantizerUnderTest.dequantize`
returns bit for bit, and what :meth:`QuantizerUnderTest.bytes_held` reports.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._context import QuantizerCapabilities
from .._plan import Usage
from ._protocol import PROTOCOL_METHODS, QuantizerUnderTest
from ._report import CheckResult, CheckStatus, describe_exception, guarded

__all__ = ["sample_weights", "protocol_check", "claim_checks"]

Factory = Callable[[], QuantizerUnderTest]
_SINGLE = (Usage.ROWWISE, Usage.COLUMNWISE)


def sample_weights(shapes: Sequence[tuple[int, int]], count: int, seed: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """``count`` deterministic weights: Gaussian, with outliers, tiny, and
    with rows and columns of very different magnitudes."""
    weights = []
    for i in range(count):
        gen = torch.Generator().manual_seed(seed * 1000 + i)
        rows, cols = shapes[i % len(shapes)]
        w = torch.randn(rows, cols, generator=gen)
        kind = i % 4
        if kind == 1:
            w[torch.rand(rows, cols, generator=gen) < 0.01] *= 100.0
        elif kind == 2:
            w *= 1e-3
        elif kind == 3:
            w *= torch.logspace(-2, 2, rows).unsqueeze(1) * torch.logspace(1, -1, cols).unsqueeze(0)
        weights.append(w.to(dtype))
    return weights


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _first_difference(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"shape/dtype {tuple(a.shape)}/{a.dtype} vs {tuple(b.shape)}/{b.dtype}"
    differ = (a.float() != b.float()) | (a.float().isnan() != b.float().isnan())
    count = int(differ.sum())
    if count == 0:  # same values, other bits (e.g. -0.0 and 0.0)
        return "same values but different bits"
    index = tuple(int(i) for i in differ.nonzero()[0])
    return f"{count} of {a.numel()} elements differ, first at {index}: {float(a[index])!r} vs {float(b[index])!r}"


def _usage_flags(usage: Usage) -> str:
    return f"rowwise={Usage.ROWWISE in usage}, columnwise={Usage.COLUMNWISE in usage}"


def protocol_check(factory: Factory) -> tuple[CheckResult, Any]:
    """Does ``factory()`` return an object with the protocol's methods?"""
    try:
        quantizer = factory()
    except Exception as err:
        return CheckResult("protocol", CheckStatus.FAILED, "factory() raised " + describe_exception(err)), None
    missing = [m for m in PROTOCOL_METHODS if not callable(getattr(quantizer, m, None))]
    if missing or not isinstance(quantizer, QuantizerUnderTest):
        reason = (
            f"factory() returned a {type(quantizer).__qualname__}, which lacks {', '.join(missing)}; "
            f"QuantizerUnderTest needs {', '.join(PROTOCOL_METHODS)} "
            "(see workspace_manager.testing.QuantizerUnderTest)"
        )
        return CheckResult("protocol", CheckStatus.FAILED, reason), quantizer
    return CheckResult("protocol", CheckStatus.PASSED, f"has {', '.join(PROTOCOL_METHODS)}"), quantizer


class _Probe:
    """Quantizes the sample weights with fresh quantizers and checks results."""

    def __init__(self, factory: Factory, capabilities: QuantizerCapabilities, weights: list[torch.Tensor]) -> None:
        self.factory = factory
        self.caps = capabilities
        self.weights = weights

    def quantize(self, q: QuantizerUnderTest, w: torch.Tensor, usage: Usage) -> Any:
        handle = q.quantize(w, rowwise=Usage.ROWWISE in usage, columnwise=Usage.COLUMNWISE in usage)
        held = q.usages(handle)
        assert held == usage, f"quantize({_usage_flags(usage)}) built a handle holding {held.label}, not {usage.label}"
        return handle

    def dequantized(self, q: QuantizerUnderTest, handle: Any, usage: Usage, w: torch.Tensor) -> torch.Tensor:
        out = q.dequantize(handle, usage)
        assert isinstance(out, torch.Tensor) and out.shape == w.shape, (
            f"dequantize(handle, Usage.{usage.name}) must return a tensor of the weight's shape "
            f"{tuple(w.shape)}; returned {type(out).__name__} {tuple(getattr(out, 'shape', ()))}"
        )
        return out

    def expect_same(self, a: torch.Tensor, b: torch.Tensor, what: str) -> None:
        assert _same_bits(a, b), f"{what}: {_first_difference(a, b)}"

    # -- protocol: usages ----------------------------------------------------
    def usages(self) -> CheckResult:
        for w in self.weights:
            q = self.factory()
            for usage in (Usage.ROWWISE, Usage.COLUMNWISE, Usage.BOTH):
                handle = self.quantize(q, w, usage)
                assert q.bytes_held(handle) > 0, f"bytes_held is {q.bytes_held(handle)} for a {usage.label} handle"
                for single in _SINGLE:
                    if single in usage:
                        self.dequantized(q, handle, single, w)
            self.drops(q, w)
        return CheckResult(
            "usages", CheckStatus.PASSED,
            f"quantize built exactly the usages asked for, and update_usage(...=False) freed them "
            f"({len(self.weights)} weights)",
        )

    def drops(self, q: QuantizerUnderTest, w: torch.Tensor) -> None:
        for drop, keep in ((Usage.ROWWISE, Usage.COLUMNWISE), (Usage.COLUMNWISE, Usage.ROWWISE)):
            flag = drop.name.lower()
            handle = self.quantize(q, w, Usage.BOTH)
            q.update_usage(handle, **{flag: False})
            held = q.usages(handle)
            assert held == keep, f"update_usage({flag}=False) on a rowwise+columnwise handle left {held.label}"
            fresh = self.factory()
            alone = self.quantize(fresh, w, keep)
            got, want = q.bytes_held(handle), fresh.bytes_held(alone)
            assert got == want, (
                f"after update_usage({flag}=False) the handle holds {got} bytes, but a {keep.label}-only "
                f"quantization holds {want}: dropping a usage must free its bytes"
            )
            if self.caps.requantization_safe:
                self.expect_same(
                    self.dequantized(q, handle, keep, w), self.dequantized(fresh, alone, keep, w),
                    f"{keep.label} data differs from a {keep.label}-only quantization after {drop.label} was dropped",
                )

    # -- columnwise_derivable --------------------------------------------------
    def derivable(self) -> CheckResult:
        if not self.caps.columnwise_derivable:
            return self.refuses_to_derive()
        for w in self.weights:
            q = self.factory()
            handle = self.quantize(q, w, Usage.ROWWISE)
            rowwise = self.dequantized(q, handle, Usage.ROWWISE, w)
            q.update_usage(handle, columnwise=True)
            held = q.usages(handle)
            assert held == Usage.BOTH, f"update_usage(columnwise=True) on a rowwise handle left {held.label}"
            derived = self.dequantized(q, handle, Usage.COLUMNWISE, w)
            self.expect_same(self.dequantized(q, handle, Usage.ROWWISE, w), rowwise, "deriving changed the rowwise data")
            self.expect_same(derived, rowwise, "derived columnwise data does not represent the rowwise values")
            if self.caps.requantization_safe:
                fresh = self.factory()
                direct = self.dequantized(fresh, self.quantize(fresh, w, Usage.COLUMNWISE), Usage.COLUMNWISE, w)
                self.expect_same(
                    derived, direct,
                    "columnwise data derived from rowwise data differs from a direct columnwise quantization "
                    "(columnwise_derivable=True promises they are identical)",
                )
        exact = "and to a direct columnwise quantization" if self.caps.requantization_safe else "(not compared with a direct columnwise quantization: requantization_safe=False)"
        return CheckResult(
            "columnwise_derivable", CheckStatus.PASSED,
            f"derived columnwise data is bit-identical to the rowwise values {exact} ({len(self.weights)} weights)",
        )

    def refuses_to_derive(self) -> CheckResult:
        q = self.factory()
        handle = self.quantize(q, self.weights[0], Usage.ROWWISE)
        try:
            q.update_usage(handle, columnwise=True)
        except Exception as err:
            return CheckResult(
                "columnwise_derivable", CheckStatus.PASSED,
                f"not claimed, and update_usage(columnwise=True) on a rowwise handle refused: {type(err).__name__}: {err}",
            )
        if Usage.COLUMNWISE in q.usages(handle):
            reason = (
                "registered with columnwise_derivable=False, but update_usage(columnwise=True) derived columnwise "
                "data from a rowwise handle. If the derived data is exact, register columnwise_derivable=True "
                "(FSDP2 plans then derive instead of gathering it); otherwise make update_usage raise."
            )
        else:
            reason = (
                "update_usage(columnwise=True) on a rowwise handle returned without columnwise data and without "
                "raising; a format that cannot derive it must raise, so that a plan that asks for it fails loudly."
            )
        return CheckResult("columnwise_derivable", CheckStatus.FAILED, reason)

    # -- derived_caches --------------------------------------------------------
    def derived_caches(self) -> CheckResult:
        for w in self.weights:
            q = self.factory()
            built = self.quantize(q, w, Usage.BOTH)
            before = q.bytes_held(built)
            q.clear_derived(built)
            assert q.usages(built) == Usage.BOTH and q.bytes_held(built) == before, (
                "clear_derived dropped data that quantize built (not derived); it must drop derived data only"
            )
            if self.caps.columnwise_derivable:
                self.clear_after_derive(q, w)
            else:
                handle = self.quantize(q, w, Usage.ROWWISE)
                before = q.bytes_held(handle)
                q.clear_derived(handle)
                assert q.bytes_held(handle) == before, "clear_derived changed the bytes of a rowwise handle"
        if self.caps.derived_caches and not self.caps.columnwise_derivable:
            return CheckResult("derived_caches", CheckStatus.SKIPPED, _UNCHECKABLE_DERIVED)
        return CheckResult("derived_caches", CheckStatus.PASSED, self.derived_summary())

    def clear_after_derive(self, q: QuantizerUnderTest, w: torch.Tensor) -> None:
        handle = self.quantize(q, w, Usage.ROWWISE)
        rowwise_bytes, rowwise = q.bytes_held(handle), self.dequantized(q, handle, Usage.ROWWISE, w)
        q.update_usage(handle, columnwise=True)
        derived_bytes = q.bytes_held(handle)
        q.clear_derived(handle)
        after = q.bytes_held(handle)
        if self.caps.derived_caches:
            assert derived_bytes > rowwise_bytes, (
                f"deriving columnwise data left bytes_held at {derived_bytes} (rowwise alone: {rowwise_bytes}); "
                "with derived_caches=True plans clear data that takes no memory: count derived data in "
                "bytes_held, or register derived_caches=False"
            )
            assert after == rowwise_bytes, (
                f"after clear_derived the handle still holds {after} bytes, but its rowwise data alone holds "
                f"{rowwise_bytes}: {after - rowwise_bytes} bytes of derived data survive, and under FSDP2 they "
                "would stay alive on every layer (TE#2717)"
            )
            assert q.usages(handle) == Usage.ROWWISE, f"after clear_derived the handle holds {q.usages(handle).label}"
            self.expect_same(self.dequantized(q, handle, Usage.ROWWISE, w), rowwise, "clear_derived changed the rowwise data")
        else:
            assert after == derived_bytes, (
                f"clear_derived freed {derived_bytes - after} bytes of derived data, so the quantizer keeps "
                "derived data it must clear: register derived_caches=True; with False, FSDP2 plans never "
                "release it (Release.DERIVED_COLUMNWISE) and it stays alive"
            )

    def derived_summary(self) -> str:
        n = len(self.weights)
        if not self.caps.columnwise_derivable:
            return f"nothing can be derived; clear_derived kept the data quantize built ({n} weights)"
        if self.caps.derived_caches:
            return f"clear_derived freed the derived columnwise data, back to the rowwise bytes ({n} weights)"
        return f"not claimed, and clear_derived left derived data and its bytes alone ({n} weights)"

    # -- requantization_safe ---------------------------------------------------
    def requantization(self) -> CheckResult:
        identical = True
        for w in self.weights:
            q = self.factory()
            first, second = self.quantize(q, w, Usage.BOTH), self.quantize(q, w, Usage.BOTH)
            for usage in _SINGLE:
                a, b = self.dequantized(q, first, usage, w), self.dequantized(q, second, usage, w)
                if not self.caps.requantization_safe:
                    identical = identical and _same_bits(a, b)
                    continue
                self.expect_same(a, b, f"quantizing the same weight twice with one quantizer gave other {usage.label} data")
        if self.caps.requantization_safe:
            return CheckResult(
                "requantization_safe", CheckStatus.PASSED,
                f"quantizing the same weight twice gave identical data ({len(self.weights)} weights)",
            )
        hint = " (they were identical here; if that always holds, claim requantization_safe=True)" if identical else ""
        return CheckResult(
            "requantization_safe", CheckStatus.SKIPPED,
            "not claimed: plans that requantize for dgrad say so in their notes" + hint,
        )


#: Why the kit cannot check derived caches claimed by a format that cannot derive.
_UNCHECKABLE_DERIVED = (
    "claimed with columnwise_derivable=False, so nothing can be derived through the protocol and the claim "
    "is not checked (clear_derived kept the data quantize built). Under FSDP2 the plans of quantized "
    "parameters release derived columnwise data after backward; claim it only for a format that keeps "
    "derived data inside a direction's own storage (as TE's hybrid formats may), else register "
    "derived_caches=False"
)


def claim_checks(factory: Factory, capabilities: QuantizerCapabilities, weights: list[torch.Tensor]) -> list[CheckResult]:
    """The usage protocol and the three capability claims."""
    probe = _Probe(factory, capabilities, weights)
    return [
        guarded("usages", probe.usages),
        guarded("columnwise_derivable", probe.derivable),
        guarded("derived_caches", probe.derived_caches),
        guarded("requantization_safe", probe.requantization),
    ]
