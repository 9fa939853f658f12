"""A small CPU stand-in for the parts of TE 2.20 the whole binding touches.

It mirrors the structure the seams rely on, not TE's numerics: a module's
``forward`` calls ``prepare_forward``, then its autograd Function through
the module file's global (so the installed seam is what runs), then
``end_forward`` in a ``finally``; the Function quantizes the weight through
the file's global ``quantize_weight``; the module caches the workspace TE
returns under ``"weight"`` when a microbatch position is given. The
"quantizer" rounds to a coarse grid, so a wrong workspace gives wrong
numbers. :func:`load_full_binding` loads ``_modules`` and its imports
against it.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from _binding_standin import load_binding


class QuantizedTensorStorage:
    """Stands for TE's quantized storage base class."""


class Workspace(QuantizedTensorStorage):
    """A quantized weight laid out as TE 2.20's per-tensor FP8 storage on
    Hopper: rowwise data ``_data``, columnwise data in a separate
    ``_transpose`` (valid unless ``_transpose_invalid``), and a
    ``_scale_inv`` both directions share. ``source`` is the weight it was
    made from. The methods follow TE's ``Float8TensorStorage``."""

    def __init__(self, data, transpose, source, quantizer) -> None:
        self._data, self._transpose = data, transpose
        self._transpose_invalid = transpose is None
        self._scale_inv = torch.ones(())
        self.source, self._quantizer, self.refreshes = source, quantizer, 0
        #: TE makes cached workspaces with ``quantizer.internal = False``: a
        #: ``QuantizedTensor`` (a torch.Tensor), which ``prepare_for_saving``
        #: saves whole instead of splitting and emptying it.
        self.internal = True

    @property
    def data(self) -> torch.Tensor:
        return self._data if self._data is not None else self._transpose.t()

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def get_usages(self) -> dict:
        return {"rowwise": self._data is not None,
                "columnwise": self._transpose is not None and not self._transpose_invalid}

    def update_usage(self, rowwise_usage=None, columnwise_usage=None) -> None:
        # TE: a transpose can be made from rowwise data; rowwise data cannot
        # be made from a transpose; a usage set to False is dropped.
        if columnwise_usage and not self.get_usages()["columnwise"]:
            self._transpose, self._transpose_invalid = self._data.t().contiguous(), False
        if columnwise_usage is False:
            self._transpose, self._transpose_invalid = None, True
        if rowwise_usage is False:
            self._data = None

    def prepare_for_saving(self):
        tensors = [self._data, self._transpose, self._scale_inv]
        self._data = self._transpose = self._scale_inv = None
        return tensors, self

    def restore_from_saved(self, tensors):
        self._data, self._transpose, self._scale_inv = tensors[0], tensors[1], tensors[2]
        return tensors[3:]

    def dequantize(self, dtype=None) -> torch.Tensor:
        return self.data.clone()


def _round(tensor: torch.Tensor) -> torch.Tensor:
    return torch.round(tensor.detach() * 8) / 8


# Named as TE's class so the registry's TE profiles describe it.
class Float8CurrentScalingQuantizer:
    def __init__(self) -> None:
        self.rowwise_usage, self.columnwise_usage = True, True

    def set_usage(self, *, rowwise: bool | None = None, columnwise: bool | None = None) -> None:
        if rowwise is not None:
            self.rowwise_usage = rowwise
        if columnwise is not None:
            self.columnwise_usage = columnwise

    def quantize(self, tensor: torch.Tensor, *, dtype=None) -> Workspace:
        if isinstance(tensor, QuantizedTensorStorage):
            # TE's quantize_weight hands a quantized weight back with the
            # usages the quantizer asks for (spelled here, where stock and
            # drop-in pass alike, so the call counts stay comparable).
            tensor.update_usage(rowwise_usage=True if self.rowwise_usage else None,
                                columnwise_usage=True if self.columnwise_usage else None)
            return tensor
        data = _round(tensor)
        return Workspace(data if self.rowwise_usage else None,
                         data.t().contiguous() if self.columnwise_usage else None, tensor, self)

    def __call__(self, tensor: torch.Tensor) -> Workspace:  # as TE's: through quantize()
        return self.quantize(tensor)

    def update_quantized(self, tensor: torch.Tensor, workspace: Workspace) -> None:
        """Refresh ``workspace`` in place, in the usages it has (TE's in-place quantize)."""
        data = _round(tensor)
        if workspace._data is not None:
            workspace._data.copy_(data)
        if workspace.get_usages()["columnwise"]:
            workspace._transpose.copy_(data.t())
        workspace.source = tensor
        workspace.refreshes += 1


Float8CurrentScalingQuantizer.__module__ = "transformer_engine.pytorch.tensor.float8_tensor"


def quantize_weight(*, tensor=None, quantizer=None, workspace=None, update_workspace=True, skip_update_flag=None,
                    fsdp_group=None, workspace_dtype=None, cache=False):
    """TE's contract: a quantized weight (a parameter) gets the usages its
    quantizer asks for and is returned itself; a given workspace is
    refreshed in place (when asked) and returned; else a new one is made,
    and returned twice if cached."""
    if workspace is not None:
        if update_workspace:
            quantizer.update_quantized(tensor, workspace)
        return workspace, None
    ws = quantizer.quantize(tensor, dtype=workspace_dtype)  # TE's miss call, dtype and all
    if ws is tensor:  # a quantized weight: itself, with its usages (see the quantizer)
        return ws, None
    ws.internal = not cache
    return ws, (ws if cache else None)


def general_gemm(a, b, layout: str = "TN", grad: bool = False, **kwargs) -> torch.Tensor:
    """TE's GEMM, for the three layouts the Linear uses (fprop ``y = x w^T``,
    dgrad ``dx = dy w``, wgrad ``dw = dy^T x``). A quantized operand is read
    in the direction the layout needs, as cuBLAS reads it."""
    if layout == "NT":
        return b.t() @ a
    if isinstance(a, QuantizedTensorStorage) and hasattr(a, "gemm_operand"):  # a gathered FP8 weight (_fake_te_gather)
        a = a.gemm_operand(layout)
        return b @ a.t() if layout == "TN" else b @ a
    if isinstance(a, Workspace):
        usage = "rowwise" if layout == "TN" else "columnwise"
        if not a.get_usages()[usage]:
            raise RuntimeError(f"general_gemm: the {usage} data the {layout} GEMM reads is missing")
        a = a._data if layout == "TN" else a._transpose.t()
    return b @ a.t() if layout == "TN" else b @ a


#: What ``te.checkpoint`` says about the call in flight (TE's two flags).
RECOMPUTE = {"enabled": False, "phase": False}


def prepare_for_saving(*tensors):
    """TE's: storages are split into their tensors, the objects kept apart."""
    flat, objects = [], []
    for t in tensors:
        if t is None or isinstance(t, torch.Tensor):
            flat.append(t)
            objects.append(None)
        elif not t.internal:  # a QuantizedTensor in TE: saved whole (held by the ctx here)
            flat.append(None)
            objects.append(_Whole(t))
        else:
            parts, obj = t.prepare_for_saving()
            flat.extend(parts)
            objects.append(obj)
    return flat, objects


@dataclass
class _Whole:
    """A cached workspace saved whole (see ``Workspace.internal``)."""

    tensor: Any

    def restore_from_saved(self, saved):
        return saved[1:]


def restore_from_saved(objects, saved):
    out = []
    for obj in objects:
        if obj is None:
            out.append(saved[0])
            saved = saved[1:]
        else:
            saved = obj.restore_from_saved(saved)
            out.append(obj.tensor if isinstance(obj, _Whole) else obj)
    return out


def clear_columnwise_cache(tensor) -> None:
    tensor._transpose, tensor._transpose_invalid = None, True


class InjectedFault(RuntimeError):
    """Raised where :attr:`LinearFunction.fault` says."""


def _maybe_fail(phase: str, weight: torch.Tensor) -> None:
    fault = LinearFunction.fault
    if fault is not None and fault(phase, weight):
        raise InjectedFault(f"injected failure in the {phase} of a Linear")


def _linear_forward(ctx, weight, inp, bias, fwd_args):
    """TE 2.20's ``_linear_forward_impl`` and ``_Linear.forward``, weight steps only."""
    _maybe_fail("forward", weight)
    file = _FILES["linear"]
    quantizer = fwd_args.weight_quantizer
    if not isinstance(weight, QuantizedTensorStorage):
        columnwise = fwd_args.is_grad_enabled and fwd_args.input_requires_grad and not fwd_args.is_fsdp2
        if fwd_args.backward_override is not None:
            columnwise = False
        columnwise = columnwise or (RECOMPUTE["enabled"] and not RECOMPUTE["phase"])
        quantizer.set_usage(rowwise=True, columnwise=columnwise)
    else:
        quantizer = weight._quantizer
    update = fwd_args.is_first_microbatch is None or fwd_args.is_first_microbatch
    ws, new = file.quantize_weight(tensor=weight, quantizer=quantizer, workspace=fwd_args.weight_workspace,
                                   update_workspace=update, cache=fwd_args.cache_weight)
    ws.update_usage(rowwise_usage=True)
    out = file.general_gemm(ws, inp)
    if ctx is not None and fwd_args.is_grad_enabled:
        wt_save = None if (fwd_args.is_fsdp2 and ws is not weight) else ws
        tensors, objects = prepare_for_saving(inp, wt_save, weight if isinstance(weight, torch.Tensor) else None)
        ctx.save_for_backward(*tensors)
        ctx.tensor_objects = objects
        ctx.saved_param = weight if not isinstance(weight, torch.Tensor) else None
        ctx.parameter = weight  # the module's own weight, for faults (a checkpoint may hand back a copy)
        ctx.backward_objects = SimpleNamespace(
            is_fsdp2=fwd_args.is_fsdp2, weight_quantizer=quantizer, backward_override=fwd_args.backward_override,
            fp8=fwd_args.backward_override is None, requires_dgrad=fwd_args.input_requires_grad)
    return out, new


def _linear_dgrad(ctx, weight_fp8, saved_weight, grad_output):
    """TE's dgrad steps: rebuild when nothing was saved, make sure of the
    columnwise data, apply the override, GEMM, clear under FSDP2."""
    bwd = ctx.backward_objects
    file = _FILES["linear"]
    if weight_fp8 is None:
        if isinstance(saved_weight, QuantizedTensorStorage):
            weight_fp8 = saved_weight
        elif bwd.weight_quantizer is not None:
            bwd.weight_quantizer.set_usage(rowwise=True, columnwise=True)
            weight_fp8 = bwd.weight_quantizer(saved_weight)
            LinearFunction.rebuilt.append(weight_fp8.get_usages())
    if bwd.fp8 and bwd.weight_quantizer is not None and isinstance(weight_fp8, QuantizedTensorStorage):
        weight_fp8.update_usage(columnwise_usage=True)
    operand = weight_fp8
    if bwd.backward_override == "dequantized":
        operand = weight_fp8.dequantize() if isinstance(weight_fp8, QuantizedTensorStorage) else weight_fp8
    elif bwd.backward_override == "high_precision":
        operand = saved_weight.dequantize() if isinstance(saved_weight, QuantizedTensorStorage) else saved_weight
    dgrad = file.general_gemm(operand, grad_output, layout="NN", grad=True)
    if bwd.is_fsdp2 and isinstance(weight_fp8, QuantizedTensorStorage):
        clear_columnwise_cache(weight_fp8)
    return dgrad


class LinearFunction(torch.autograd.Function):
    #: Set by a test to make the next backward raise.
    fail_backward = False
    #: Set by a test: ``fault(phase, weight)`` ("forward" or "backward", the
    #: call's weight) returns whether that call raises :class:`InjectedFault`.
    fault: Callable[[str, torch.Tensor], bool] | None = None
    #: The usages of each workspace rebuilt in backward, as built.
    rebuilt: list = []

    @staticmethod
    def forward(ctx, weight, inp, bias, fwd_args):
        return _linear_forward(ctx, weight, inp, bias, fwd_args)

    @staticmethod
    def backward(ctx, grad_output, grad_workspace):
        inp, weight_fp8, saved_weight = restore_from_saved(ctx.tensor_objects, ctx.saved_tensors)
        _maybe_fail("backward", ctx.parameter)
        saved_weight = saved_weight if ctx.saved_param is None else ctx.saved_param
        ctx.tensor_objects = None
        if LinearFunction.fail_backward:
            raise RuntimeError("injected failure in backward")
        dgrad = _linear_dgrad(ctx, weight_fp8, saved_weight, grad_output) if ctx.backward_objects.requires_dgrad \
            else None
        wgrad = _FILES["linear"].general_gemm(inp, grad_output, layout="NT", grad=True)
        ctx.backward_objects = None
        return (wgrad if isinstance(saved_weight, torch.Tensor) else None), dgrad, None, None


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


class TEModule(torch.nn.Module):
    """What the stand-in modules share with TE's base module: the forward
    window the drop-ins override, and no FSDP2 flag of their own."""

    @property
    def is_fsdp2(self) -> bool:
        return False

    def prepare_forward(self, inp, *args, **kwargs):
        return inp

    def end_forward(self) -> None:
        pass

    def reset_parameters(self) -> None:
        pass


class TELinear(TEModule):
    """Stands for te.Linear: the same forward skeleton around the Function."""

    def __init__(self, in_features: int, out_features: int, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.weight = torch.nn.Parameter(torch.randn(out_features, in_features, generator=gen))
        self._fp8_workspaces: dict = {}
        self.quantizer = Float8CurrentScalingQuantizer()
        #: Every call's arguments (None: not kept; they hold the cached workspace).
        self.calls: list[FwdArgs] | None = []
        #: The recipe's backward_override (TE reads it from the recipe).
        self.backward_override: str | None = None

    def forward(self, inp, is_first_microbatch: bool | None = None):
        inp = self.prepare_forward(inp)
        try:
            cache_name = None if (is_first_microbatch is None or self.is_fsdp2) else "weight"
            args = FwdArgs(self.quantizer, self._fp8_workspaces.get(cache_name) if cache_name else None,
                           is_first_microbatch, cache_name is not None, torch.is_grad_enabled(), inp.requires_grad,
                           backward_override=self.backward_override)
            if self.calls is not None:
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


def in_recompute_phase() -> bool:
    return RECOMPUTE["phase"]


@contextlib.contextmanager
def _recompute_flags(phase: bool) -> Iterator[None]:
    RECOMPUTE.update(enabled=True, phase=phase)
    try:
        yield
    finally:  # TE's context clears both flags on exit, also after an exception
        RECOMPUTE.update(enabled=False, phase=False)


class _ReentrantCheckpoint(torch.autograd.Function):
    """TE's reentrant checkpoint: a first pass without grad, and the
    recompute pass with grad inside backward, each under its flags."""

    @staticmethod
    def forward(ctx, function, kwargs, *args):
        ctx.function, ctx.kwargs = function, kwargs
        ctx.save_for_backward(*args)
        with _recompute_flags(phase=False):
            return function(*args, **kwargs)

    @staticmethod
    def backward(ctx, *grads):
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        with torch.enable_grad(), _recompute_flags(phase=True):
            outputs = ctx.function(*inputs, **ctx.kwargs)
        torch.autograd.backward(outputs, grads)
        return (None, None, *(t.grad for t in inputs))


def checkpoint(function: Callable, *args: torch.Tensor, use_reentrant: bool = True, **kwargs) -> torch.Tensor:
    """Stands for ``te.checkpoint``: reentrant as TE's own Function, or
    non-reentrant through torch's checkpoint with TE's flag contexts."""
    if use_reentrant:
        return _ReentrantCheckpoint.apply(function, kwargs, *args)
    return torch.utils.checkpoint.checkpoint(
        function, *args, use_reentrant=False,
        context_fn=lambda: (_recompute_flags(phase=False), _recompute_flags(phase=True)), **kwargs)


class _RecomputeRegion:
    """TE's ``distributed`` module as the hot path reads it: its
    ``_IN_ACTIVATION_RECOMPUTE_REGION`` global, following the flags above."""

    @property
    def _IN_ACTIVATION_RECOMPUTE_REGION(self) -> bool:
        return RECOMPUTE["enabled"]


_FILES: dict[str, types.ModuleType] = {}


def _file(name: str, **attrs: Any) -> types.ModuleType:
    module = types.ModuleType(f"fake_te.{name}")
    module.quantize_weight = quantize_weight
    module.general_gemm = general_gemm
    for key, value in attrs.items():
        setattr(module, key, value)
    _FILES[name] = module
    return module


def _te_named(obj: Any, module: str, qualname: str) -> Any:
    """Give ``obj`` the home TE gives the real one (the install check reads it)."""
    obj.__module__, obj.__qualname__ = module, qualname
    return obj


def compat() -> dict[str, Any]:
    """The stand-in ``_compat``: what the binding reads from TE."""
    base = types.ModuleType("fake_te.base")
    base.quantize_weight = _te_named(quantize_weight, "fake_te.base", "quantize_weight")
    linear = _file("linear", _Linear=_te_named(LinearFunction, "fake_te.linear", "_Linear"))
    import _fake_te_mlp as mlp  # it imports this module

    lnl_fn = _te_named(type("_LayerNormLinear", (), {"forward": staticmethod(lambda *a: None),
                                                     "backward": staticmethod(lambda *a: None)}), "fake_te.lnl",
                       "_LayerNormLinear")
    mlp_fn = _te_named(type("_LayerNormMLP", (mlp.MLPFunction,), {}), "fake_te.lnmlp", "_LayerNormMLP")
    lnl = _file("lnl", _LayerNormLinear=lnl_fn)
    lnmlp = _file("lnmlp", _LayerNormMLP=mlp_fn, prepare_for_saving=prepare_for_saving)
    other = type("_Unused", (torch.nn.Module,), {"prepare_forward": TELinear.prepare_forward,
                                                  "end_forward": TELinear.end_forward})
    import _fake_te_grouped as grouped  # it imports this module
    import _fake_te_gather as gather  # it imports this module

    return {
        **grouped.compat_entries(),
        **gather.compat_entries(),
        "QuantizedTensorStorage": QuantizedTensorStorage,
        "TELinear": TELinear, "TELayerNormLinear": other, "TELayerNormMLP": mlp.TELayerNormMLP,
        "LinearFunction": LinearFunction, "LNLFunction": lnl_fn,
        "LNMLPFunction": mlp_fn, "base_module": base,
        "LNL_ARGS": {}, "LNMLP_ARGS": mlp.ARGS, "LNMLP_RECOMPUTED": mlp.RECOMPUTED,
        "linear_module": linear, "lnl_module": lnl, "lnmlp_module": lnmlp,
        "mha_module": types.ModuleType("fake_mha"), "transformer_module": types.ModuleType("fake_transformer"),
        "quantize_weight": quantize_weight,
        "is_weight_workspace_valid": lambda ws, q: isinstance(ws, Workspace),
        "is_fp8_activation_recompute_enabled": lambda: RECOMPUTE["enabled"],
        "in_fp8_activation_recompute_phase": lambda: RECOMPUTE["phase"],
        "is_graph_capturing": lambda: False,
        "graph_flags": SimpleNamespace(_IS_GRAPH_CAPTURING=False),
        "recompute_flags": _RecomputeRegion(),
        "is_distributed_weight": lambda weight: False,
        "clear_columnwise_cache": clear_columnwise_cache,
        "FP8GlobalStateManager": SimpleNamespace(get_fp8_recipe=lambda: None),
        "no_torch_dynamo": lambda **kw: (lambda f: f),
    }


def load_full_binding(monkeypatch) -> SimpleNamespace:
    """The runtime and every kind (``kinds``, whose files register their
    adapters) loaded against the stand-in, named by their last part
    (``state``, ``registry``, ``kinds``, ``grouped_linear``...); the seams
    are installed into its files at the first drop-in call."""
    mods = load_binding(monkeypatch, compat(), "runtime._step_hook", "runtime._model", "runtime._attribution", "runtime._state",
                        "runtime._shards", "runtime._call", "runtime._kind_registry", "runtime._install", "runtime._modules",
                        "runtime._construction", "runtime._gather", "runtime._stale", "kinds", "kinds.layernorm_mlp",
                        "kinds.grouped_linear")
    return SimpleNamespace(files=_FILES, **{name.rsplit(".", 1)[-1].lstrip("_"): m for name, m in mods.items()})
