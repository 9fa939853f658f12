"""A CPU stand-in for TE 2.20's GroupedLinear, in the shape the seams rely on.

It follows ``module/grouped_linear.py`` where the experts' workspaces are
concerned (no bias, no FP8 inputs, the GEMMs one per expert):

* the module reads its cache (``weight0`` ..., or ``weight`` for one grouped
  weight) when ``is_first_microbatch`` is given, calls the Function through
  its file's global ``_GroupedLinear``, and stores the new workspaces it
  returns, between ``prepare_forward`` and ``end_forward``;
* the split-quantize path (also taken under a recipe's ``backward_override``)
  quantizes each expert through the file's ``quantize_weight`` (columnwise
  where a quantized dgrad follows) and saves
  ``inputs, workspaces, weights (None), biases (None)`` through the file's
  ``prepare_for_saving``; its backward restores through the file's
  ``restore_from_func_ctx``, makes sure of each workspace's columnwise data
  and reads ``workspaces[0].shape`` for the weight gradients, as TE does;
  under ``backward_override`` dgrad reads the workspaces dequantized, or the
  high-precision weights saved for it (``"high_precision"``);
* the grouped-tensor path (``use_grouped_tensor``) prepares the weights
  through ``_GroupedLinear._prepare_weights_for_grouped_tensor_gemm``
  (one grouped weight: one grouped quantization, TE's own cache entry) and
  saves ``input, workspaces, four offsets``.
"""

from __future__ import annotations

import types
from typing import Any

import torch

import _fake_te as fake

#: Positions in the stand-in's non-tensor argument tuple.
ARGS = {"is_first_microbatch": 0, "fp8": 1, "weight_quantizers": 2, "cpu_offloading": 3, "is_grad_enabled": 4,
        "weight_workspaces": 5, "cache_weight": 6, "skip_fp8_weight_update": 7, "debug": 8,
        "single_grouped_weight": 9, "use_grouped_tensor": 10, "activation_dtype": 11}


def _file() -> types.ModuleType:
    return fake._FILES["grouped"]


#: The recipe's ``backward_override`` the stand-in reads (TE reads it from
#: the recipe; :func:`set_backward_override` sets both views).
RECIPE = types.SimpleNamespace(backward_override=None)


def set_backward_override(binding_te: Any, override: str | None) -> None:
    """The recipe's ``backward_override``, for the stand-in and the binding's ``_compat`` alike."""
    RECIPE.backward_override = override
    binding_te.FP8GlobalStateManager = types.SimpleNamespace(get_fp8_recipe=lambda: RECIPE)


class GroupedWorkspace(fake.QuantizedTensorStorage):
    """One grouped quantization of every expert, laid out as TE's
    ``GroupedTensorStorage`` (``rowwise_data``, ``columnwise_data``, their scales)."""

    def __init__(self, rowwise, columnwise, quantizer, count: int = 1) -> None:
        self.rowwise_data, self.columnwise_data = rowwise, columnwise
        self.scale_inv, self.columnwise_scale_inv = torch.ones(count), torch.ones(count)  # one per expert
        self.quantizer, self.internal, self.count = quantizer, True, count

    def split_into_quantized_tensors(self) -> list:
        """Each expert's quantized tensor, as TE's per-expert ``quantize``
        makes it (a 2D source: the experts' rows one after the other)."""
        data = self.rowwise_data if self.rowwise_data is not None else self.columnwise_data.transpose(-1, -2)
        parts = data.chunk(self.count) if data.dim() == 2 else data.unbind(0)
        rowwise, columnwise = self.rowwise_data is not None, self.columnwise_data is not None
        return [fake.Workspace(p if rowwise else None, p.t().contiguous() if columnwise else None, p, self.quantizer)
                for p in parts]

    def get_usages(self) -> dict:
        return {"rowwise": self.rowwise_data is not None, "columnwise": self.columnwise_data is not None}

    def update_usage(self, rowwise_usage=None, columnwise_usage=None) -> None:
        if columnwise_usage and self.columnwise_data is None:
            self.columnwise_data = self.rowwise_data.transpose(-1, -2).contiguous()
        if rowwise_usage is False:
            self.rowwise_data = None

    def prepare_for_saving(self):
        tensors = [self.rowwise_data, self.columnwise_data, self.scale_inv, self.columnwise_scale_inv]
        self.rowwise_data = self.columnwise_data = self.scale_inv = self.columnwise_scale_inv = None
        return tensors, self

    def restore_from_saved(self, tensors):
        self.rowwise_data, self.columnwise_data, self.scale_inv, self.columnwise_scale_inv = tensors[:4]
        return tensors[4:]

    def expert(self, i: int, columnwise: bool) -> torch.Tensor:
        if columnwise:
            if self.columnwise_data is None:
                raise RuntimeError("grouped GEMM: the columnwise data dgrad reads is missing")
            return self.columnwise_data[i].t()
        if self.rowwise_data is None:
            raise RuntimeError("grouped GEMM: the rowwise data fprop reads is missing")
        return self.rowwise_data[i]


class GroupedParameter(torch.nn.Parameter):
    """One parameter for every expert, as TE's GroupedTensor parameter is read."""

    @property
    def rowwise_data(self) -> torch.Tensor:
        return self.data.reshape(-1)

    @property
    def logical_shape(self) -> tuple:
        return tuple(self.shape)


def group_quantize(source, quantizer, count, splits, noop_flag=None, output=None):
    """TE's ``tex.group_quantize`` for a weight: every expert at once."""
    data = fake._round(source)
    out = GroupedWorkspace(data if quantizer.rowwise_usage else None,
                           data.transpose(-1, -2).contiguous() if quantizer.columnwise_usage else None, quantizer,
                           count)
    if output is not None:  # refreshed in place, as TE's kernel writes into a given workspace
        for name in ("rowwise_data", "columnwise_data"):
            if getattr(output, name) is not None and getattr(out, name) is not None:
                getattr(output, name).copy_(getattr(out, name))
        return output
    return out


def multi_tensor_quantize(tensors, quantizers):
    """TE's ``tex.multi_tensor_quantize``: each tensor with its own quantizer,
    in the usages each asks for."""
    return [quantizer.quantize(tensor) for tensor, quantizer in zip(tensors, quantizers)]


def _prepare_weights(weights, quantizers, workspaces, *, num_gemms, single_grouped_weight, with_quantized_compute,
                     columnwise_usage, activation_dtype, is_first_microbatch, skip_fp8_weight_update, cache_weight):
    """TE's ``_prepare_weights_for_grouped_tensor_gemm``, weight steps only."""
    update = is_first_microbatch is None or is_first_microbatch
    if single_grouped_weight:
        quantizer = quantizers[0]
        quantizer.set_usage(rowwise=True, columnwise=columnwise_usage)
        workspace = workspaces[0] if workspaces else None
        if workspace is not None and columnwise_usage and workspace.columnwise_data is None:
            workspace = None
        source = weights[0].rowwise_data.view(weights[0].logical_shape)
        if workspace is None:
            grouped = group_quantize(source, quantizer, num_gemms, None)
            grouped.internal = not cache_weight  # TE makes a persistent entry a tensor: saved whole
        elif update:
            grouped = group_quantize(source, quantizer, num_gemms, None, output=workspace)
        else:
            grouped = workspace
        return grouped, [grouped if cache_weight else None]
    out, new = [], [None] * len(weights)
    for i, weight in enumerate(weights):
        quantizers[i].set_usage(rowwise=True, columnwise=columnwise_usage)
        ws, new[i] = _file().quantize_weight(tensor=weight, quantizer=quantizers[i],
                                             workspace=workspaces[i] if workspaces else None,
                                             update_workspace=update, cache=cache_weight)
        out.append(ws)
    return out, new


class GroupedFunction(torch.autograd.Function):
    #: How many times the stand-in's backward ran, per path.
    backwards: list = []

    _prepare_weights_for_grouped_tensor_gemm = staticmethod(_prepare_weights)

    @staticmethod
    def forward(ctx, inp, m_splits, nta, out, dgrad_out, *weights_and_biases):
        count = len(m_splits)
        single, grad = nta[ARGS["single_grouped_weight"]], nta[ARGS["is_grad_enabled"]]
        weights = weights_and_biases[:1 if single else count]
        override = RECIPE.backward_override
        if nta[ARGS["use_grouped_tensor"]] and override is None:  # TE's grouped-tensor path takes no override
            return _file()._GroupedLinear._forward_grouped_tensor(ctx, inp, m_splits, nta, weights)
        if single:
            raise RuntimeError("Single grouped parameters require the native grouped-tensor path")
        origin = weights
        distributed = getattr(weights[0], "is_distributed_weight", False)
        if distributed:  # TE gathers a DistributedWeight's shards for forward (here: a copy)
            weights = [w.detach().clone() for w in weights]
        quantizers = nta[ARGS["weight_quantizers"]]
        if not isinstance(weights[0], fake.QuantizedTensorStorage):
            for quantizer in quantizers:
                quantizer.set_usage(rowwise=True, columnwise=grad and inp.requires_grad and override is None)
        else:
            quantizers = [w._quantizer for w in weights]
        first = nta[ARGS["is_first_microbatch"]]
        workspaces, fp8 = nta[ARGS["weight_workspaces"]], []
        new = [None] * count
        for i in range(count):
            ws, new[i] = _file().quantize_weight(tensor=weights[i], quantizer=quantizers[i],
                                                 workspace=workspaces[i] if workspaces else None,
                                                 update_workspace=first is None or first,
                                                 cache=nta[ARGS["cache_weight"]])
            fp8.append(ws)
        xs = inp.split(list(m_splits))
        result = torch.cat([_file().general_gemm(fp8[i], xs[i]) for i in range(count)])
        if ctx is not None and grad:
            kept = weights if override == "high_precision" and inp.requires_grad else [None] * count
            if distributed:  # the gathered workspaces are not saved: backward gathers again
                fp8, kept = [None] * count, origin
            tensors, objects = _file().prepare_for_saving(*xs, *fp8, *kept, *([None] * count))
            GroupedFunction._keep(ctx, tensors, objects, count, m_splits, inp, grouped=False)
            ctx.backward_override, ctx.weight_quantizers = override, quantizers
        return result, new

    @staticmethod
    def _forward_grouped_tensor(ctx, inp, m_splits, nta, weights):
        count, single = len(m_splits), nta[ARGS["single_grouped_weight"]]
        grad = nta[ARGS["is_grad_enabled"]]
        operands, new = _file()._GroupedLinear._prepare_weights_for_grouped_tensor_gemm(
            weights, nta[ARGS["weight_quantizers"]], nta[ARGS["weight_workspaces"]], num_gemms=count,
            single_grouped_weight=single, with_quantized_compute=True, columnwise_usage=grad and inp.requires_grad,
            activation_dtype=None, is_first_microbatch=nta[ARGS["is_first_microbatch"]],
            skip_fp8_weight_update=None, cache_weight=nta[ARGS["cache_weight"]])
        xs = inp.split(list(m_splits))
        result = torch.cat([xs[i] @ _expert_rowwise(operands, i).t() for i in range(count)])
        if ctx is not None and grad:
            saved = [operands] if single else list(operands)
            if not inp.requires_grad:
                saved = [None] * len(saved)
            offsets = [torch.zeros(1) for _ in range(4)]
            tensors, objects = _file().prepare_for_saving(inp, *saved, *offsets)
            GroupedFunction._keep(ctx, tensors, objects, count, m_splits, inp, grouped=True)
            ctx.single_grouped_weight = single
        return result, new

    @staticmethod
    def _keep(ctx, tensors, objects, count, m_splits, inp, grouped: bool) -> None:
        ctx.save_for_backward(*tensors)
        ctx.tensor_objects, ctx.num_gemms, ctx.m_splits = objects, count, list(m_splits)
        ctx.grouped_tensor_supported, ctx.requires_dgrad = grouped, inp.requires_grad
        ctx.backward_override = None

    @staticmethod
    def backward(ctx, grad_output, _grad_workspaces):
        saved = _file().restore_from_func_ctx(ctx)
        count = ctx.num_gemms
        dys = grad_output.split(ctx.m_splits)
        if ctx.grouped_tensor_supported:
            GroupedFunction.backwards.append("grouped")
            xs = saved[0].split(ctx.m_splits)
            weights = saved[1] if ctx.single_grouped_weight else saved[1:1 + count]
        else:
            GroupedFunction.backwards.append("split")
            xs, weights = saved[:count], saved[count:2 * count]
            if getattr(saved[2 * count], "is_distributed_weight", False):  # gathered again, quantized for dgrad
                weights = [q(w.detach().clone()) for q, w in zip(ctx.weight_quantizers, saved[2 * count:3 * count])]
            _ = weights[0].shape  # TE sizes the weight gradients from the saved workspace
            if ctx.backward_override == "dequantized":
                weights = [w.dequantize() if isinstance(w, fake.QuantizedTensorStorage) else w for w in weights]
            elif ctx.backward_override == "high_precision":
                weights = saved[2 * count:3 * count]
        dgrad = None
        if ctx.requires_dgrad:
            if not isinstance(weights, GroupedWorkspace):
                for weight in weights:
                    if isinstance(weight, fake.QuantizedTensorStorage):
                        weight.update_usage(columnwise_usage=True)
            dgrad = torch.cat([_dgrad(weights, i, dys[i]) for i in range(count)])
        wgrads = [dys[i].t() @ xs[i] for i in range(count)]
        if ctx.grouped_tensor_supported and ctx.single_grouped_weight:
            wgrads = [torch.stack(wgrads)]
        return (dgrad, None, None, None, None, *wgrads)


def _expert_rowwise(operands, i: int) -> torch.Tensor:
    if isinstance(operands, GroupedWorkspace):
        return operands.expert(i, columnwise=False)
    ws = operands[i]
    if ws.get_usages()["rowwise"] is False:
        raise RuntimeError("grouped GEMM: the rowwise data fprop reads is missing")
    return ws._data


def _dgrad(weights, i: int, dy: torch.Tensor) -> torch.Tensor:
    if isinstance(weights, GroupedWorkspace):
        return dy @ weights.expert(i, columnwise=True)
    return _file().general_gemm(weights[i], dy, layout="NN", grad=True)


def restore_from_func_ctx(ctx, return_saved_tensors=False):
    out = fake.restore_from_saved(ctx.tensor_objects, list(ctx.saved_tensors))
    ctx.tensor_objects = None
    return out


class TEGroupedLinear(fake.TEModule):
    """Stands for te.GroupedLinear: the forward skeleton around the Function."""

    def __init__(self, num_gemms: int, in_features: int, out_features: int, *, seed: int = 0,
                 single_grouped_weight: bool = False, use_grouped_tensor: bool = False) -> None:
        super().__init__()
        self.num_gemms, self.single_grouped_weight = num_gemms, single_grouped_weight
        self.use_grouped_tensor = use_grouped_tensor or single_grouped_weight
        gen = torch.Generator().manual_seed(seed)
        data = torch.randn(num_gemms, out_features, in_features, generator=gen)
        if single_grouped_weight:
            self.weight = GroupedParameter(data)
        else:
            for i in range(num_gemms):
                self.register_parameter(f"weight{i}", torch.nn.Parameter(data[i].clone()))
        self._fp8_workspaces: dict = {}
        self.quantizers = [fake.Float8CurrentScalingQuantizer() for _ in range(num_gemms)]

    def _weights(self) -> list:
        if self.single_grouped_weight:
            return [self.weight]
        return [getattr(self, f"weight{i}") for i in range(self.num_gemms)]

    def _keys(self) -> list[str]:
        return ["weight"] if self.single_grouped_weight else [f"weight{i}" for i in range(self.num_gemms)]

    def forward(self, inp, m_splits, is_first_microbatch: bool | None = None):
        inp = self.prepare_forward(inp, num_gemms=self.num_gemms)
        try:
            cache = is_first_microbatch is not None
            workspaces = [self._fp8_workspaces.get(k) for k in self._keys()] if cache else [None] * len(self._keys())
            nta = [None] * len(ARGS)
            for name, value in (("is_first_microbatch", is_first_microbatch), ("fp8", True),
                                ("weight_quantizers", self.quantizers), ("cpu_offloading", False),
                                ("is_grad_enabled", torch.is_grad_enabled()), ("weight_workspaces", workspaces),
                                ("cache_weight", cache), ("debug", False),
                                ("single_grouped_weight", self.single_grouped_weight),
                                ("use_grouped_tensor", self.use_grouped_tensor),
                                ("activation_dtype", self._weights()[0].dtype)):
                nta[ARGS[name]] = value
            function = _file()._GroupedLinear
            args = (inp, torch.tensor(m_splits), tuple(nta), None, None, *self._weights())
            out, new = function.apply(*args) if torch.is_grad_enabled() else function.forward(None, *args)
            for key, ws in zip(self._keys(), new):
                if ws is not None and cache:
                    self._fp8_workspaces[key] = ws
        finally:
            self.end_forward()
        return out


def compat_entries(quantize_weight: Any = None) -> dict[str, Any]:
    """What the binding reads from TE for GroupedLinear, pointing at this
    stand-in (``quantize_weight``: TE's, where a test has its own)."""
    grouped_fn = fake._te_named(type("_GroupedLinear", (GroupedFunction,), {}), "fake_te.grouped", "_GroupedLinear")
    prepare = fake._te_named(_copy(fake.prepare_for_saving), "fake_te.quantized_tensor", "prepare_for_saving")
    restore = fake._te_named(_copy(restore_from_func_ctx), "fake_te.quantized_tensor", "restore_from_func_ctx")
    file = fake._file("grouped", _GroupedLinear=grouped_fn, prepare_for_saving=prepare,
                      restore_from_func_ctx=restore)
    if quantize_weight is not None:
        file.quantize_weight = quantize_weight
    package = types.ModuleType("fake_te.pytorch")
    package.GroupedLinear = TEGroupedLinear
    return {"grouped_module": file, "TEGroupedLinear": TEGroupedLinear, "GroupedFunction": grouped_fn,
            "prepare_for_saving": prepare, "restore_from_func_ctx": restore, "GROUPED_ARGS": ARGS,
            "GroupedTensorStorage": GroupedWorkspace,
            "tex": types.SimpleNamespace(group_quantize=group_quantize, multi_tensor_quantize=multi_tensor_quantize),
            "tep": package, "te_module_package": types.SimpleNamespace(GroupedLinear=TEGroupedLinear),
            # TE's real layout is read on the GPU only: here every group is split by the stand-in's own split.
            "split_experts": lambda grouped, quantizer, count, shape: None}


def _copy(fn):
    """A function object of its own (the homes given to stand-ins must not clash)."""
    return types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
