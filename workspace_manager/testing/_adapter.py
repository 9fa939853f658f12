"""The reference runtime on a real quantizer.

:class:`QuantizerAdapter` stands where :class:`FakeQuantizer` stands in
:class:`ModuleRuntime`: every workspace it hands out is a handle of the
quantizer under test, and every byte it reports is that quantizer's
``bytes_held``. :class:`QuantizerRuntime` also keeps an FSDP2 quantized
parameter as a real handle, so that deriving and clearing its columnwise
data goes through the quantizer's ``update_usage`` and ``clear_derived``.
A whole quantized parameter's derived data is followed by its origin alone:
the protocol cannot rewrite a handle's rowwise data in place and keep what
was derived from the old data, which is what a fused optimizer does to it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .._context import QuantizerCapabilities, Sharding, WeightSource
from .._plan import Usage
from .._policy import WorkspacePolicy
from ._model import FakeQuantizer, FakeWorkspace, Freshness, ModuleRuntime, RuntimeModelError
from ._protocol import QuantizerUnderTest

__all__ = ["HandleWorkspace", "QuantizerAdapter", "QuantizerRuntime", "versioned_weights"]


def versioned_weights(shape: tuple[int, int], *, seed: int = 0, dtype: torch.dtype = torch.float32) -> Callable[[int], torch.Tensor]:
    """A deterministic weight per data version.

    Keyed by the runtime's data version, the truth, never by what a binding
    observes (:class:`~workspace_manager.testing._model.Observed`): a write
    that moves no version counter still changes the bytes quantized next.
    Two versions give different random weights, so a copy whose version
    label is old holds other bytes than a copy of the current data, and the
    runtime's stale-read check by label is a check of the real bytes."""
    cache: dict[int, torch.Tensor] = {}

    def weight(version: int) -> torch.Tensor:
        if version not in cache:
            gen = torch.Generator().manual_seed(seed * 7919 + version)
            cache[version] = torch.randn(shape, generator=gen).to(dtype)
        return cache[version]

    return weight


@dataclass(eq=False)
class HandleWorkspace(FakeWorkspace):
    """A workspace backed by a handle of the quantizer under test."""

    handle: Any = None
    owner: Any = None

    @property
    def nbytes(self) -> int:
        return int(self.owner.bytes_held(self.handle))


class QuantizerAdapter(FakeQuantizer):
    """Presents a :class:`QuantizerUnderTest` to :class:`ModuleRuntime`."""

    def __init__(
        self,
        quantizer: QuantizerUnderTest,
        capabilities: QuantizerCapabilities,
        weights: Callable[[int], torch.Tensor],
    ) -> None:
        super().__init__(capabilities, numel=weights(0).numel())
        self.target = quantizer
        self.weights = weights

    def quantize(self, version: int, usages: Usage, holder: str) -> FakeWorkspace:
        self.quantizations += 1
        handle = self.quantize_handle(version, usages)
        ws = HandleWorkspace(usages=usages, version=version, numel=self.numel, handle=handle, owner=self.target)
        return self._track(ws, holder)

    def quantize_handle(self, version: int, usages: Usage) -> Any:
        """Quantize weight ``version`` with ``usages``, checking what was built."""
        rowwise, columnwise = Usage.ROWWISE in usages, Usage.COLUMNWISE in usages
        handle = self.target.quantize(self.weights(version), rowwise=rowwise, columnwise=columnwise)
        built = self.target.usages(handle)
        if built != usages:
            raise RuntimeModelError(
                f"quantize(rowwise={rowwise}, columnwise={columnwise}) built a handle with usages "
                f"{built.label}; it must hold exactly {usages.label}"
            )
        return handle

    def usages_of(self, ws: FakeWorkspace) -> Usage:
        assert isinstance(ws, HandleWorkspace)
        return self.target.usages(ws.handle)

    def derive_columnwise(self, ws: FakeWorkspace) -> None:
        if not self.capabilities.columnwise_derivable:
            raise RuntimeModelError(
                f"plan asked to derive columnwise data, but {self.capabilities.name} cannot derive it"
            )
        assert isinstance(ws, HandleWorkspace)
        self.derive_handle(ws.handle)
        ws.usages = self.target.usages(ws.handle)
        ws.derived |= Usage.COLUMNWISE

    def derive_handle(self, handle: Any) -> None:
        self.target.update_usage(handle, rowwise=None, columnwise=True)
        if Usage.COLUMNWISE not in self.target.usages(handle):
            raise RuntimeModelError(
                "update_usage(columnwise=True) returned without columnwise data on a format "
                f"registered with columnwise_derivable=True ({self.capabilities.name})"
            )


class QuantizerRuntime(ModuleRuntime):
    """:class:`ModuleRuntime` whose quantized parameter is a real handle."""

    def __init__(
        self,
        adapter: QuantizerAdapter,
        *,
        sharding: Sharding = Sharding.NONE,
        weight: WeightSource = WeightSource.HIGH_PRECISION,
        pinned: WorkspacePolicy | None = None,
        freshness: Freshness = Freshness.FULL,
    ) -> None:
        super().__init__(adapter, sharding=sharding, weight=weight, pinned=pinned, freshness=freshness)
        self.adapter = adapter
        self.param_handle: Any = None
        self.param_rowwise_bytes = 0
        self._parameter_updated()

    def _parameter_updated(self) -> None:
        # FSDP2 shards the rowwise data of a quantized parameter; anything
        # else on it is derived by the backward all-gather. A new handle for
        # new data hides no stale bytes: writes come only while no backward
        # is pending, when the plans have cleared the derived data already
        # (the session checks that an idle FSDP2 parameter holds none).
        if self.weight is WeightSource.QUANTIZED_PARAM and self.sharding.is_fsdp2:
            self.param_handle = self.adapter.quantize_handle(self.version, Usage.ROWWISE)
            self.param_rowwise_bytes = int(self.adapter.target.bytes_held(self.param_handle))

    def _derive_parameter_columnwise(self) -> None:
        super()._derive_parameter_columnwise()
        if self.param_handle is not None:
            self.adapter.derive_handle(self.param_handle)

    def _release_parameter_derived(self) -> None:
        super()._release_parameter_derived()
        if self.param_handle is not None:
            self.adapter.target.clear_derived(self.param_handle)

    def parameter_derived_bytes(self) -> int:
        """Bytes the quantized parameter holds beyond its rowwise data."""
        if self.param_handle is None:
            return super().parameter_derived_bytes()
        return int(self.adapter.target.bytes_held(self.param_handle)) - self.param_rowwise_bytes
