"""A small CPU stand-in for the parts of TE 2.20 the whole binding touches.

It mirrors the structure the seams rely on, not TE's numerics: a module's
``forward`` calls ``prepare_forward``, then its autograd Function through
the module file's global (so the installed seam is what runs), then
``end_forward`` in a ``finally``; the Function quantizes the weight through
the file's global ``quantize_weight``; the module caches the workspace TE
returns under ``"weight"`` when a microbatch position is given. The
"quantizer" rounds to a coarse grid, so a wrong workspace gives wrong
numbers. :func:`checkpoint` stands for ``te.checkpoint``: it sets the two
recompute flags TE's modules read, around its first pass and around the
recompute pass. :func:`load_full_binding` loads ``_modules`` and its
imports against it.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from _binding_standin import load_binding


class QuantizedTensorStorage:
    """Stands for TE's quantized storage base class."""


@dataclass(eq=False)
class Workspace(QuantizedTensorStorage):
    """A quantized weight: rounded data, the weight it came from, usages."""

    data: torch.Tensor
    source: torch.Tensor
    rowwise: bool = True
    columnwise: bool = True
    _quantizer: Any = None
    refreshes: int = 0

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def get_usages(self) -> dict:
        return {"rowwise": self.rowwise, "columnwise": self.columnwise}


# Named as TE's class so the registry's TE profiles describe it.
class Float8CurrentScalingQuantizer:
    def __init__(self) -> None:
        self.rowwise_usage, self.columnwise_usage = True, True

    def set_usage(self, *, rowwise: bool | None = None, columnwise: bool | None = None) -> None:
        if rowwise is not None:
            self.rowwise_usage = rowwise
        if columnwise is not None:
            self.columnwise_usage = columnwise

    def __call__(self, tensor: torch.Tensor) -> Workspace:
        return self.quantize(tensor)

    def quantize(self, tensor: torch.Tensor) -> Workspace:
        return Workspace(torch.round(tensor.detach() * 8) / 8, tensor, self.rowwise_usage, self.columnwise_usage, self)


Float8CurrentScalingQuantizer.__module__ = "transformer_engine.pytorch.tensor.float8_tensor"


def quantize_weight(*, tensor=None, quantizer=None, workspace=None, update_workspace=True, skip_update_flag=None,
                    fsdp_group=None, workspace_dtype=None, cache=False):
    """TE's contract: a given workspace is refreshed in place (when asked)
    and returned; else a new one is made, and returned twice if cached."""
    if workspace is not None:
        if update_workspace:
            workspace.data = torch.round(tensor.detach() * 8) / 8
            workspace.source = tensor
            workspace.refreshes += 1
        return workspace, None
    ws = quantizer.quantize(tensor)
    return ws, (ws if cache else None)


class InjectedFault(RuntimeError):
    """Raised where :attr:`LinearFunction.fault` says."""


def _maybe_fail(phase: str, weight: torch.Tensor) -> None:
    fault = LinearFunction.fault
    if fault is not None and fault(phase, weight):
        raise InjectedFault(f"injected failure in the {phase} of a Linear")


def _linear_forward(ctx, weight, inp, bias, fwd_args):
    _maybe_fail("forward", weight)
    file = _FILES["linear"]
    ws, new = file.quantize_weight(tensor=weight, quantizer=fwd_args.weight_quantizer,
                                   workspace=fwd_args.weight_workspace, cache=fwd_args.cache_weight)
    if ctx is not None:
        ctx.backward_objects = SimpleNamespace(is_fsdp2=fwd_args.is_fsdp2, weight_quantizer=fwd_args.weight_quantizer)
        ctx.saved_ws = None if fwd_args.is_fsdp2 else ws
        # Saved through autograd, as TE saves its tensors, so that a
        # non-reentrant checkpoint recomputes the forward when backward reads
        # it (and hands back a copy: the parameter itself is kept for faults).
        ctx.save_for_backward(weight)
        ctx.parameter = weight
    fwd_args.seen_workspace = ws
    return inp @ ws.data.t(), new


class LinearFunction(torch.autograd.Function):
    #: Set by a test to make the next backward raise.
    fail_backward = False
    #: Workspaces rebuilt in backward, for tests to inspect.
    rebuilt: list = []
    #: Set by a test: ``fault(phase, weight)`` ("forward" or "backward", the
    #: call's weight) returns whether that call raises :class:`InjectedFault`.
    fault: Callable[[str, torch.Tensor], bool] | None = None

    @staticmethod
    def forward(ctx, weight, inp, bias, fwd_args):
        return _linear_forward(ctx, weight, inp, bias, fwd_args)

    @staticmethod
    def backward(ctx, grad_output, grad_workspace):
        (weight,) = ctx.saved_tensors
        _maybe_fail("backward", ctx.parameter)
        ws = ctx.saved_ws
        if ws is None:  # nothing saved (TE's is_fsdp2 lever): rebuild from the weight, as TE does
            quantizer = ctx.backward_objects.weight_quantizer
            quantizer.set_usage(rowwise=True, columnwise=True)
            ws = quantizer(weight)
            LinearFunction.rebuilt.append(ws)
        if LinearFunction.fail_backward:
            raise RuntimeError("injected failure in backward")
        return None, grad_output @ ws.data, None, None


@dataclass
class FwdArgs:
    weight_quantizer: Any
    weight_workspace: Any
    is_first_microbatch: bool | None
    cache_weight: bool
    is_grad_enabled: bool
    input_requires_grad: bool
    fp8: bool = True
    debug: bool = False
    fsdp_group: Any = None
    skip_fp8_weight_update: Any = None
    cpu_offloading: bool = False
    backward_override: str | None = None
    is_fsdp2: bool = False
    seen_workspace: Any = field(default=None, repr=False)


class TELinear(torch.nn.Module):
    """Stands for te.Linear: the same forward skeleton around the Function."""

    def __init__(self, in_features: int, out_features: int, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.weight = torch.nn.Parameter(torch.randn(out_features, in_features, generator=gen))
        self._fp8_workspaces: dict = {}
        self.quantizer = Float8CurrentScalingQuantizer()
        self.calls: list[FwdArgs] = []

    @property
    def is_fsdp2(self) -> bool:
        return False

    def prepare_forward(self, inp, *args, **kwargs):
        return inp

    def end_forward(self) -> None:
        pass

    def reset_parameters(self) -> None:
        pass

    def forward(self, inp, is_first_microbatch: bool | None = None):
        inp = self.prepare_forward(inp)
        try:
            cache_name = None if (is_first_microbatch is None or self.is_fsdp2) else "weight"
            args = FwdArgs(self.quantizer, self._fp8_workspaces.get(cache_name) if cache_name else None,
                           is_first_microbatch, cache_name is not None, torch.is_grad_enabled(), inp.requires_grad)
            self.calls.append(args)
            if torch.is_grad_enabled():
                out, new = _FILES["linear"]._Linear.apply(self.weight, inp, None, args)
            else:
                out, new = _FILES["linear"]._Linear.forward(None, self.weight, inp, None, args)
            if new is not None and cache_name is not None:
                self._fp8_workspaces[cache_name] = new
        finally:
            self.end_forward()
        return out


#: TE's two recompute flags (``distributed.py``): inside a checkpoint
#: region, and in its recompute pass.
_RECOMPUTE = {"enabled": False, "phase": False}


def in_recompute_phase() -> bool:
    return _RECOMPUTE["phase"]


@contextlib.contextmanager
def _recompute_flags(phase: bool) -> Iterator[None]:
    _RECOMPUTE.update(enabled=True, phase=phase)
    try:
        yield
    finally:  # TE's context clears both flags on exit, also after an exception
        _RECOMPUTE.update(enabled=False, phase=False)


class _ReentrantCheckpoint(torch.autograd.Function):
    """TE's reentrant checkpoint: a first pass without grad, and the
    recompute pass with grad inside backward, each under its flags."""

    @staticmethod
    def forward(ctx, function, *args):
        ctx.function = function
        ctx.save_for_backward(*args)
        with _recompute_flags(phase=False):
            return function(*args)

    @staticmethod
    def backward(ctx, *grads):
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        with torch.enable_grad(), _recompute_flags(phase=True):
            outputs = ctx.function(*inputs)
        torch.autograd.backward(outputs, grads)
        return (None, *(t.grad for t in inputs))


def checkpoint(function: Callable, *args: torch.Tensor, use_reentrant: bool = True) -> torch.Tensor:
    """Stands for ``te.checkpoint``: reentrant as TE's own Function, or
    non-reentrant through torch's checkpoint with TE's flag contexts."""
    if use_reentrant:
        return _ReentrantCheckpoint.apply(function, *args)
    return torch.utils.checkpoint.checkpoint(
        function, *args, use_reentrant=False,
        context_fn=lambda: (_recompute_flags(phase=False), _recompute_flags(phase=True)))


_FILES: dict[str, types.ModuleType] = {}


def _file(name: str, **attrs: Any) -> types.ModuleType:
    module = types.ModuleType(f"fake_te.{name}")
    module.quantize_weight = quantize_weight
    for key, value in attrs.items():
        setattr(module, key, value)
    _FILES[name] = module
    return module


def _te_named(obj: Any, module: str, qualname: str) -> Any:
    """Give ``obj`` the home TE gives the real one (the install check reads it)."""
    obj.__module__, obj.__qualname__ = module, qualname
    return obj


class _RecomputeRegion:
    """TE's ``distributed`` module as the hot path reads it: its
    ``_IN_ACTIVATION_RECOMPUTE_REGION`` global, here following the stand-in
    checkpoint's flags."""

    @property
    def _IN_ACTIVATION_RECOMPUTE_REGION(self) -> bool:
        return _RECOMPUTE["enabled"]


def compat() -> dict[str, Any]:
    """The stand-in ``_compat``: what the binding reads from TE."""
    base = types.ModuleType("fake_te.base")
    base.quantize_weight = _te_named(quantize_weight, "fake_te.base", "quantize_weight")
    linear = _file("linear", _Linear=_te_named(LinearFunction, "fake_te.linear", "_Linear"))
    fn = {name: _te_named(type(name, (), {"forward": staticmethod(lambda *a: None),
                                          "_forward": staticmethod(lambda *a: None)}), f"fake_te.{file}", name)
          for file, name in (("lnl", "_LayerNormLinear"), ("lnmlp", "_LayerNormMLP"))}
    lnl = _file("lnl", _LayerNormLinear=fn["_LayerNormLinear"])
    lnmlp = _file("lnmlp", _LayerNormMLP=fn["_LayerNormMLP"])
    other = type("_Unused", (torch.nn.Module,), {"prepare_forward": TELinear.prepare_forward,
                                                  "end_forward": TELinear.end_forward})
    return {
        "QuantizedTensorStorage": QuantizedTensorStorage,
        "TELinear": TELinear, "TELayerNormLinear": other, "TELayerNormMLP": type("_UnusedMLP", (other,), {}),
        "LinearFunction": LinearFunction, "LNLFunction": fn["_LayerNormLinear"],
        "LNMLPFunction": fn["_LayerNormMLP"], "base_module": base,
        "LNL_ARGS": {}, "LNMLP_ARGS": {},
        "linear_module": linear, "lnl_module": lnl, "lnmlp_module": lnmlp,
        "mha_module": types.ModuleType("fake_mha"), "transformer_module": types.ModuleType("fake_transformer"),
        "quantize_weight": quantize_weight,
        "is_weight_workspace_valid": lambda ws, q: isinstance(ws, Workspace),
        "is_fp8_activation_recompute_enabled": lambda: _RECOMPUTE["enabled"],
        "in_fp8_activation_recompute_phase": in_recompute_phase,
        "is_graph_capturing": lambda: False,
        "graph_flags": SimpleNamespace(_IS_GRAPH_CAPTURING=False),
        "recompute_flags": _RecomputeRegion(),
        "is_distributed_weight": lambda weight: False,
        "clear_columnwise_cache": lambda tensor: None,
        "FP8GlobalStateManager": SimpleNamespace(get_fp8_recipe=lambda: None),
        "no_torch_dynamo": lambda **kw: (lambda f: f),
    }


def load_full_binding(monkeypatch) -> SimpleNamespace:
    """``_modules`` (with the seams, state, steps, shards and attribution)
    loaded against the stand-in; the seams are installed into its files."""
    mods = load_binding(monkeypatch, compat(), "_steps", "_attribution", "_support", "_state", "_shards", "_seams", "_modules")
    return SimpleNamespace(files=_FILES, **{name.lstrip("_"): m for name, m in mods.items()})
