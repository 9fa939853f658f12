"""The quantized FSDP2 all-gather (docs/decisions.md, D13) as the GPU tests
and ``benchmarks.quantized_gather`` set it up and measure it:
:func:`enable_on` (the FSDP2 policy pinned with ``QuantizedGather.ON`` on
every drop-in, then ``te_integration.enable_quantized_gather``), and
:class:`GatheredBytes`, the bytes FSDP2's all-gathers hand a rank.
torch.distributed and TE are imported inside the functions."""

from __future__ import annotations

from typing import Any

__all__ = ["GatheredBytes", "enable_on"]


def enable_on(model: Any, recipe: Any) -> Any:
    """Pin ``FSDP2WorkspacePolicy(quantized_gather=QuantizedGather.ON)`` on
    every drop-in of ``model`` (so that it is set up at world size 1 too,
    where the default rule makes workspaces in the call) and set the
    quantized all-gather up; call after ``fully_shard`` and before the first
    forward. Returns ``enable_quantized_gather``'s setup."""
    import te_integration as ti

    from workspace_manager import FSDP2WorkspacePolicy, QuantizedGather

    from .model import pin_policy

    pin_policy(model, FSDP2WorkspacePolicy(quantized_gather=QuantizedGather.ON))
    return ti.enable_quantized_gather(model, recipe)


class GatheredBytes:
    """Bytes FSDP2's all-gathers hand each rank while active: at world size
    > 1 the output of each all-gather collective; at world size 1, where
    FSDP2 makes no collective, the all-gather input it copies in its place
    (``FSDPParam.all_gather_inputs[0]``, read in ``wait_for_unshard``)."""

    def __enter__(self):
        import torch.distributed as dist
        from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

        self._dist = dist
        self.bytes, self._in_wait, self._saved = 0, False, []
        self._patch(dist, "all_gather_into_tensor", self._counting_collective)
        self._patch(_fsdp_param_group.FSDPParamGroup, "wait_for_unshard", self._marking_wait)
        self._patch(_fsdp_param.FSDPParam, "all_gather_inputs", self._counting_inputs)
        return self

    def _patch(self, owner, name, make) -> None:
        if hasattr(owner, name):
            original = owner.__dict__.get(name, getattr(owner, name))
            self._saved.append((owner, name, original))
            setattr(owner, name, make(original))

    def _counting_collective(self, original):
        def call(output_tensor, *args, **kwargs):
            self.bytes += output_tensor.numel() * output_tensor.element_size()
            return original(output_tensor, *args, **kwargs)
        return call

    def _marking_wait(self, original):
        def wait(group, *args, **kwargs):
            self._in_wait = self._dist.get_world_size() == 1
            try:
                return original(group, *args, **kwargs)
            finally:
                self._in_wait = False
        return wait

    def _counting_inputs(self, original):
        def inputs(fsdp_param):
            out = original.fget(fsdp_param)
            if self._in_wait:
                self.bytes += out[0].numel() * out[0].element_size()
            return out
        return property(inputs)

    def __exit__(self, *exc) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
