"""The one thin, version-checked layer between this package and TE's internals.

Everything ``te_integration`` uses from TransformerEngine is imported here,
and nowhere else. At import the layer checks the installed version, that
every piece the binding takes from TE exists (:data:`SEAMS`), and the shape
of the private ones (argument-tuple positions, the lines of TE's code a seam
depends on). A mismatch refuses to load with :class:`UnsupportedTEError`,
naming each missing or changed piece and the TE file it belongs in.
"""

from __future__ import annotations

import importlib
import warnings
from dataclasses import dataclass
from types import ModuleType

from ._te_source import structure_problems

SUPPORTED = "2.20"
"""TE major.minor this package binds to: ``>=2.20,<2.21``."""

#: For a SUPPORTED.x build that lacks pieces (which the te extra would keep): a released one.
_INSTALL_HINT = "`pip install 'transformer_engine[pytorch]>=2.20,<2.21'`"


def _te_extra_hint() -> str:
    """TE missing or of another version: the te extra pins TE to SUPPORTED,
    so installing it replaces another. (Imported here, when a message needs
    it: loading this layer alone imports nothing of the core.)"""
    from workspace_manager.extending import install_hint

    return install_hint("te")


class UnsupportedTEError(ImportError):
    """TransformerEngine is missing, of another version, or its internals moved."""


def _import_te() -> ModuleType:
    try:
        with warnings.catch_warnings():
            # TE warns at import when JAX is installed without TE's JAX
            # extension; that is not a problem for the PyTorch side we use.
            warnings.filterwarnings("ignore", message="Detected a Jax installation", category=RuntimeWarning)
            import transformer_engine
            import transformer_engine.pytorch  # noqa: F401  (the PyTorch extension)
    except ImportError as err:
        raise UnsupportedTEError(
            "te_integration needs TransformerEngine for PyTorch "
            f"{SUPPORTED}.x, which could not be imported ({err}). Install it with the te extra: "
            f"{_te_extra_hint()}; or use the TE-free core (`import workspace_manager`) alone."
        ) from err
    return transformer_engine


te = _import_te()
VERSION: str = str(getattr(te, "__version__", "unknown"))
if not VERSION.startswith(SUPPORTED + "."):
    raise UnsupportedTEError(
        f"te_integration supports TransformerEngine >={SUPPORTED},<2.21; the installed "
        f"version is {VERSION}. Install a supported version with the te extra: {_te_extra_hint()}; "
        "or use the TE-free core (`import workspace_manager`) alone."
    )


@dataclass(frozen=True)
class Seam:
    """One piece the binding takes from TE: ``attr`` (a dotted path, empty
    for the module itself) of module ``module``, bound here as ``export``
    (empty: only checked, e.g. a method the seams call or override)."""

    module: str
    attr: str = ""
    export: str = ""

    @property
    def name(self) -> str:
        return self.attr or self.module

    @property
    def file(self) -> str:
        """The TE source file the piece is defined or bound in."""
        path = self.module.replace(".", "/")
        return f"{path}/__init__.py" if self.module in _PACKAGES else f"{path}.py"


_PT = "transformer_engine.pytorch"
_PACKAGES = frozenset({_PT, f"{_PT}.module"})
_LIN, _LNL, _MLP, _BASE = (f"{_PT}.module.linear", f"{_PT}.module.layernorm_linear", f"{_PT}.module.layernorm_mlp",
                           f"{_PT}.module.base")
_GL = f"{_PT}.module.grouped_linear"

#: Every piece of TE the binding relies on. The seamed names (what
#: ``_install.install`` replaces) are ``quantize_weight``, ``_Linear``,
#: ``_LayerNormLinear`` and ``_LayerNormMLP`` in the three module files.
SEAMS: tuple[Seam, ...] = (
    Seam(_PT, export="tep"),
    Seam(_LIN, export="linear_module"), Seam(_LNL, export="lnl_module"), Seam(_MLP, export="lnmlp_module"),
    Seam(_BASE, export="base_module"), Seam(f"{_PT}.distributed", export="te_distributed"),
    Seam(f"{_PT}.attention.multi_head_attention", export="mha_module"),
    Seam(f"{_PT}.transformer", export="transformer_module"),
    # Public classes: what convert_model swaps and the drop-ins subclass.
    Seam(_PT, "Linear", "TELinear"), Seam(_PT, "LayerNormLinear", "TELayerNormLinear"),
    Seam(_PT, "LayerNormMLP", "TELayerNormMLP"),
    Seam(_LNL, "LayerNormLinear.forward"), Seam(_MLP, "LayerNormMLP.forward"),
    Seam(_BASE, "TransformerEngineBaseModule", "TEBaseModule"),
    Seam(_BASE, "TransformerEngineBaseModule.prepare_forward"), Seam(_BASE, "TransformerEngineBaseModule.end_forward"),
    # Linear: the autograd Function, its eager entry and argument dataclasses.
    Seam(_LIN, "_Linear", "LinearFunction"), Seam(_LIN, "_Linear.forward"), Seam(_LIN, "_Linear.backward"),
    Seam(_LIN, "_linear_eager"), Seam(_LIN, "_linear_forward_impl"), Seam(_LIN, "_linear_backward_impl"),
    Seam(_LIN, "LinearFwdArgs", "LinearFwdArgs"), Seam(_LIN, "LinearBwdArgs", "LinearBwdArgs"),
    Seam(_LNL, "_LayerNormLinear", "LNLFunction"), Seam(_LNL, "_LayerNormLinear.forward"),
    Seam(_LNL, "_LayerNormLinear.backward"),
    Seam(_MLP, "_LayerNormMLP", "LNMLPFunction"), Seam(_MLP, "_LayerNormMLP._forward"),
    Seam(_MLP, "_LayerNormMLP.forward"), Seam(_MLP, "_LayerNormMLP.backward"),
    # quantize_weight: TE's own, and the module globals the seam replaces.
    Seam(_BASE, "quantize_weight", "quantize_weight"), Seam(_LIN, "quantize_weight"), Seam(_LNL, "quantize_weight"),
    Seam(_MLP, "quantize_weight"),
    # LayerNormMLP's saving helper: swapped for the call alone when FC1 and FC2 save differently.
    Seam(_MLP, "prepare_for_saving"),
    Seam(_BASE, "_is_weight_workspace_valid", "is_weight_workspace_valid"),
    # GroupedLinear: the module, its Function, and the module globals its
    # seams replace (quantize_weight, and the saving pair around backward).
    Seam(_GL, export="grouped_module"), Seam(_PT, "GroupedLinear", "TEGroupedLinear"),
    Seam(f"{_PT}.module", "GroupedLinear"), Seam(_GL, "GroupedLinear.forward"),
    Seam(_GL, "_GroupedLinear", "GroupedFunction"), Seam(_GL, "_GroupedLinear.forward"),
    Seam(_GL, "_GroupedLinear.backward"), Seam(_GL, "_GroupedLinear._forward_grouped_tensor"),
    Seam(_GL, "_GroupedLinear._backward_grouped_tensor"),
    Seam(_GL, "_GroupedLinear._prepare_weights_for_grouped_tensor_gemm"),
    Seam(_GL, "quantize_weight"), Seam(_GL, "prepare_for_saving", "prepare_for_saving"),
    Seam(_GL, "restore_from_func_ctx", "restore_from_func_ctx"),
    Seam(_GL, "GroupedTensorStorage", "GroupedTensorStorage"), Seam(_GL, "tex", "tex"),
    # The quantized FSDP2 all-gather (D13): the shard's amax, the scale from it,
    # the scaled cast, and the FP8 weight TE's modules receive.
    Seam(_GL, "tex.compute_amax"), Seam(_GL, "tex.multi_tensor_compute_scale_and_scale_inv"),
    Seam(f"{_PT}.optimizers.multi_tensor_apply", "multi_tensor_applier", "multi_tensor_applier"),
    Seam(f"{_PT}.tensor.float8_tensor", "Float8Tensor", "Float8Tensor"),
    Seam(f"{_PT}.tensor.float8_tensor", "Float8Quantizer", "Float8Quantizer"),
    Seam(f"{_PT}.tensor.float8_tensor", "Float8CurrentScalingQuantizer", "Float8CurrentScalingQuantizer"),
    Seam(f"{_PT}.quantization", "get_fp8_te_dtype", "get_fp8_te_dtype"),
    Seam(f"{_PT}.constants", "DType", "TE_DType"),
    # The per-expert storages a grouped quantization is split into (``split_experts``).
    Seam(f"{_PT}.tensor.storage.float8_tensor_storage", "Float8TensorStorage", "Float8TensorStorage"),
    Seam(f"{_PT}.tensor.storage.float8_blockwise_tensor_storage", "Float8BlockwiseQTensorStorage",
         "Float8BlockwiseQTensorStorage"),
    Seam(f"{_PT}.tensor.float8_blockwise_tensor", "Float8BlockQuantizer", "Float8BlockQuantizer"),
    # The 2D-block weight TE's modules receive from a quantized all-gather (D13).
    Seam(f"{_PT}.tensor.float8_blockwise_tensor", "Float8BlockwiseQTensor", "Float8BlockwiseQTensor"),
    # Names managed_construction rebinds while TE builds its composite modules.
    Seam(f"{_PT}.attention.multi_head_attention", "Linear"),
    Seam(f"{_PT}.attention.multi_head_attention", "LayerNormLinear"),
    Seam(f"{_PT}.transformer", "LayerNormMLP"),
    # GroupedLinear has no composite builder in TE: users name it from the package.
    Seam(f"{_PT}.module", export="te_module_package"),
    # Helpers the seams ask.
    Seam(f"{_PT}.distributed", "is_fp8_activation_recompute_enabled", "is_fp8_activation_recompute_enabled"),
    Seam(f"{_PT}.distributed", "in_fp8_activation_recompute_phase", "in_fp8_activation_recompute_phase"),
    Seam(f"{_PT}.distributed_weight", "is_distributed_weight", "is_distributed_weight"),
    Seam(f"{_PT}.graph", "is_graph_capturing", "is_graph_capturing"),
    # The flags behind those two helpers, which the hot paths read as
    # attributes (a call per module call adds up on a busy host).
    Seam(f"{_PT}.distributed", "_IN_ACTIVATION_RECOMPUTE_REGION"), Seam(f"{_PT}.graph", export="graph_flags"),
    Seam(f"{_PT}.graph", "_IS_GRAPH_CAPTURING"),
    Seam(f"{_PT}.jit", "no_torch_dynamo", "no_torch_dynamo"),
    Seam(f"{_PT}.quantization", "FP8GlobalStateManager", "FP8GlobalStateManager"),
    Seam(f"{_PT}.quantization", "FP8GlobalStateManager.get_fp8_recipe"),
    Seam(f"{_PT}.quantized_tensor", "QuantizedTensorStorage", "QuantizedTensorStorage"),
    Seam(f"{_PT}.tensor.utils", "clear_columnwise_cache", "clear_columnwise_cache"),
    # The GEMM each module file calls (check_stale_reads watches them).
    Seam(_LIN, "general_gemm"), Seam(_LNL, "general_gemm"), Seam(_MLP, "general_gemm"),
    Seam(_GL, "general_grouped_gemm"),
)


def _lookup(seam: Seam) -> object:
    """The piece ``seam`` names; raises LookupError saying why it is not there."""
    try:
        obj = importlib.import_module(seam.module)
    except ImportError as err:
        raise LookupError(f"the module could not be imported ({err})") from err
    for part in filter(None, seam.attr.split(".")):
        if not hasattr(obj, part):
            raise LookupError(f"no attribute {part!r}")
        obj = getattr(obj, part)
    return obj


def missing_seams_message(version: str, missing: list[tuple[Seam, str]]) -> str:
    """What the user reads when pieces the binding relies on are not in TE."""
    listed = "; ".join(f"`{seam.name}` in {seam.file} ({why})" for seam, why in missing)
    return (
        f"TransformerEngine {version} lacks what te_integration binds to: {listed}. te_integration supports "
        f"released TransformerEngine {SUPPORTED}.x builds; install one ({_INSTALL_HINT}). If this already is "
        "a released build, please report this message to the te-workspace-manager project."
    )


def _resolve(seams: tuple[Seam, ...]) -> dict[str, object]:
    """``{export: piece}`` for every exported seam; UnsupportedTEError
    listing every missing piece at once."""
    found, missing = {}, []
    for seam in seams:
        try:
            piece = _lookup(seam)
        except LookupError as err:
            missing.append((seam, str(err)))
            continue
        if seam.export:
            found[seam.export] = piece
    if missing:
        raise UnsupportedTEError(missing_seams_message(VERSION, missing))
    return found


_found = _resolve(SEAMS)
tep: ModuleType = _found["tep"]
linear_module: ModuleType = _found["linear_module"]
lnl_module: ModuleType = _found["lnl_module"]
lnmlp_module: ModuleType = _found["lnmlp_module"]
base_module: ModuleType = _found["base_module"]
te_distributed: ModuleType = _found["te_distributed"]
#: Where ``_IN_ACTIVATION_RECOMPUTE_REGION`` lives (TE's ``distributed.py``).
recompute_flags: ModuleType = te_distributed
#: Where ``_IS_GRAPH_CAPTURING`` lives (TE's ``graph.py``).
graph_flags: ModuleType = _found["graph_flags"]
mha_module: ModuleType = _found["mha_module"]
transformer_module: ModuleType = _found["transformer_module"]
TELinear = _found["TELinear"]
TELayerNormLinear = _found["TELayerNormLinear"]
TELayerNormMLP = _found["TELayerNormMLP"]
TEBaseModule = _found["TEBaseModule"]
LinearFunction = _found["LinearFunction"]
LinearFwdArgs = _found["LinearFwdArgs"]
LinearBwdArgs = _found["LinearBwdArgs"]
LNLFunction = _found["LNLFunction"]
LNMLPFunction = _found["LNMLPFunction"]
grouped_module: ModuleType = _found["grouped_module"]
te_module_package: ModuleType = _found["te_module_package"]
TEGroupedLinear = _found["TEGroupedLinear"]
GroupedFunction = _found["GroupedFunction"]
prepare_for_saving = _found["prepare_for_saving"]
restore_from_func_ctx = _found["restore_from_func_ctx"]
GroupedTensorStorage = _found["GroupedTensorStorage"]
Float8TensorStorage = _found["Float8TensorStorage"]
Float8BlockwiseQTensorStorage = _found["Float8BlockwiseQTensorStorage"]
Float8BlockQuantizer = _found["Float8BlockQuantizer"]
Float8BlockwiseQTensor = _found["Float8BlockwiseQTensor"]
tex = _found["tex"]
quantize_weight = _found["quantize_weight"]
is_weight_workspace_valid = _found["is_weight_workspace_valid"]
is_fp8_activation_recompute_enabled = _found["is_fp8_activation_recompute_enabled"]
in_fp8_activation_recompute_phase = _found["in_fp8_activation_recompute_phase"]
is_distributed_weight = _found["is_distributed_weight"]
is_graph_capturing = _found["is_graph_capturing"]
no_torch_dynamo = _found["no_torch_dynamo"]
FP8GlobalStateManager = _found["FP8GlobalStateManager"]
QuantizedTensorStorage = _found["QuantizedTensorStorage"]
clear_columnwise_cache = _found["clear_columnwise_cache"]
multi_tensor_applier = _found["multi_tensor_applier"]
Float8Tensor = _found["Float8Tensor"]
Float8Quantizer = _found["Float8Quantizer"]
Float8CurrentScalingQuantizer = _found["Float8CurrentScalingQuantizer"]
get_fp8_te_dtype = _found["get_fp8_te_dtype"]
TE_DType = _found["TE_DType"]
del _found

#: ``(module file, name)`` of the GEMM functions the module kinds call: what
#: ``check_stale_reads`` watches (te.ops's are in ``_compat_ops``).
GEMM_SITES = ((linear_module, "general_gemm"), (lnl_module, "general_gemm"), (lnmlp_module, "general_gemm"),
              (grouped_module, "general_grouped_gemm"))

#: Positions in ``_LayerNormLinear.forward``'s ``non_tensor_args``.
LNL_ARGS = {"is_first_microbatch": 1, "fp8": 2, "weight_quantizer": 7, "cpu_offloading": 12,
            "is_grad_enabled": 21, "fsdp_group": 33, "skip_fp8_weight_update": 35, "debug": 37, "is_fsdp2": 38}
#: Positions in ``_LayerNormMLP._forward``'s ``non_tensor_args`` (49 from the
#: module, ``recompute_for_bwd`` appended by ``forward``).
LNMLP_ARGS = {"is_first_microbatch": 1, "fp8": 2, "fc1_weight_quantizer": 7, "fc2_weight_quantizer": 13,
              "cpu_offloading": 18, "is_grad_enabled": 28, "fsdp_group": 41, "skip_fp8_weight_update": 44,
              "checkpoint": 46, "debug": 47, "is_fsdp2": 48, "recompute_for_bwd": 49}
#: Positions, in the tuple ``_LayerNormMLP._recompute`` returns to backward,
#: of the workspaces its own checkpoint's recompute pass built (checked
#: against the names backward unpacks it into).
LNMLP_RECOMPUTED = {"fc1_weight": 4, "fc2_weight": 10}
#: Positions in ``_GroupedLinear.forward``'s ``non_tensor_args``.
GROUPED_ARGS = {"is_first_microbatch": 1, "fp8": 2, "weight_quantizers": 6, "cpu_offloading": 12,
                "activation_dtype": 14, "is_grad_enabled": 15, "weight_workspaces": 16, "cache_weight": 17, "skip_fp8_weight_update": 18,
                "debug": 20, "single_grouped_weight": 21}
#: Fields of TE's argument dataclasses the ``_Linear`` seam reads or sets.
LINEAR_FWD_FIELDS = ("is_fsdp2", "weight_quantizer", "is_first_microbatch", "is_grad_enabled", "input_requires_grad",
                     "backward_override", "fp8", "debug", "fsdp_group", "skip_fp8_weight_update", "cpu_offloading")
LINEAR_BWD_FIELDS = ("is_fsdp2", "weight_quantizer")

#: Lines of TE's code each seam relies on (a changed TE refuses to load).
_SENTINELS = {
    linear_module._linear_forward_impl: ["if is_fsdp2 and weightmat is not weight:", "quantize_weight("],
    linear_module._linear_eager: ["_Linear.apply(", "_Linear.forward(None"],
    LNLFunction.forward: ["if is_fsdp2 and weightmat is not weight:", "ctx.is_fsdp2 = is_fsdp2", "quantize_weight("],
    LNLFunction.backward: ["weight_quantizer.set_usage(rowwise=True, columnwise=True)", "clear_columnwise_cache("],
    TELayerNormLinear.forward: ["_LayerNormLinear.apply", "_LayerNormLinear.forward", "self.prepare_forward(",
                                "self.end_forward()"],
    TELinear.forward: ["_linear_eager(", "self.prepare_forward(", "self.end_forward()"],
    LNMLPFunction._forward: ["fsdp2_skip_columnwise = is_fsdp2 and not is_recomputation", "ctx.is_fsdp2 = is_fsdp2",
                             "tensors_to_save, tensor_objects = prepare_for_saving(", "fc1_wt_save,", "fc2_wt_save,"],
    LNMLPFunction.forward: ["_LayerNormMLP._forward("],
    LNMLPFunction.backward: ["ctx.fc1_weight_quantizer(origin_fc1_weight)", "ctx.fc2_weight_quantizer(origin_fc2_weight)"],
    linear_module._linear_backward_impl: ["weight_fp8 = bwd_args.weight_quantizer(saved_weight)"],
    is_fp8_activation_recompute_enabled: ["return _IN_ACTIVATION_RECOMPUTE_REGION and"],
    is_graph_capturing: ["return _IS_GRAPH_CAPTURING"],
    # The quantize_weight seam makes the last call itself, for an uncached high-precision weight.
    quantize_weight: ["if isinstance(tensor, QuantizedTensor):", "if workspace is not None:",
                      "out = quantizer.quantize(tensor, dtype=workspace_dtype)"],
    # GroupedLinear: what each path saves and restores, by position (the
    # saving seam swaps the weights' slots), and the module's cache.
    GroupedFunction.forward: ["*inputmats,\n                *weights_fp8,\n                *saved_weights,\n                *biases,",
                              "weights_fp8 = [None] * num_gemms", "quantize_weight(",
                              "return _GroupedLinear._forward_grouped_tensor("],
    GroupedFunction._forward_grouped_tensor: [
        "input_to_save,\n                *weights_to_save,\n                split_sizes,",
        "_GroupedLinear._prepare_weights_for_grouped_tensor_gemm(", "weights_to_save = [None] * len(weights_to_save)"],
    GroupedFunction.backward: ["saved_tensors = restore_from_func_ctx(ctx)", "weights = saved_tensors[N : 2 * N]",
                               "saved_weights = saved_tensors[2 * N : 3 * N]"],
    GroupedFunction._backward_grouped_tensor: ["saved_tensors = restore_from_func_ctx(ctx)",
                                               "weights_for_gemm = saved_tensors[1]",
                                               "weight_tensors = saved_tensors[1 : 1 + N]"],
    TEGroupedLinear.forward: ["_GroupedLinear.apply", "_GroupedLinear.forward", "self.prepare_forward(",
                              "self.end_forward()", 'self._fp8_workspaces[key] = ws'],
    # split_experts builds what split_into_quantized_tensors builds, in TE's layout.
    GroupedTensorStorage.split_into_quantized_tensors: [
        "data_start = i * numel", "rowwise_data = self.rowwise_data[data_start:data_end].view(rowwise_tensor_shape)",
        "columnwise_tensor_shape = quantizer.get_columnwise_shape(tensor_shape)",
        "scale_inv = self.scale_inv[i : i + 1]", "scale_inv = self.columnwise_scale_inv[i : i + 1]",
        "cum += math.prod(scale_shape)", "is_2D_scaled = quantizer.block_scaling_dim == 2",
        "float8_tensor_class = Float8TensorStorage", "float8_blockwise_q_tensor_class = Float8BlockwiseQTensorStorage"],
    Float8TensorStorage.__new__: ["instance._quantizer = quantizer.copy() if quantizer is not None else None"],
    Float8BlockwiseQTensorStorage.__new__: [
        "instance._quantizer = quantizer.copy() if quantizer is not None else None"],
    TELayerNormMLP.forward: ["_LayerNormMLP.apply", "_LayerNormMLP.forward", "self.prepare_forward(",
                             "self.end_forward()"],
}


_problems = structure_problems(
    _SENTINELS,
    ((LNLFunction.forward, "non_tensor_args", LNL_ARGS), (LNMLPFunction._forward, "non_tensor_args", LNMLP_ARGS),
     (LNMLPFunction.backward, "_recompute", LNMLP_RECOMPUTED),
     (GroupedFunction.forward, "non_tensor_args", GROUPED_ARGS)),
    ((LinearFwdArgs, LINEAR_FWD_FIELDS), (LinearBwdArgs, LINEAR_BWD_FIELDS)),
)
if _problems:
    raise UnsupportedTEError(
        f"TransformerEngine {VERSION}'s internals differ from what te_integration binds to: "
        + "; ".join(_problems)
        + f". Install a released TransformerEngine {SUPPORTED}.x ({_INSTALL_HINT}); if this already is one, "
        "please report this message to the te-workspace-manager project."
    )


def split_experts(grouped, quantizer, count: int, shape: tuple) -> list | None:
    """The experts of ``tex.group_quantize(stacked, quantizer, count)``, as
    ``grouped.split_into_quantized_tensors()`` gives them (TE's classes,
    views of the same buffers at the same offsets), without its Python work
    per expert: one ``unbind`` per buffer gives every expert's view, and
    the experts share one copy of ``quantizer`` where TE copies it for each
    (nothing writes to a workspace's quantizer). None where this is not
    TE's evenly split layout of a storage class (then the caller asks TE)."""
    if not getattr(quantizer, "internal", False):
        return None  # TE's split would make QuantizedTensor subclasses here
    rowwise, columnwise = grouped.rowwise_data, grouped.columnwise_data
    rows = rowwise.view(count, *shape).unbind(0) if rowwise is not None else (None,) * count
    cols = ((None,) * count if columnwise is None else
            columnwise.view(count, *quantizer.get_columnwise_shape(shape)).unbind(0))
    common = {"shape": shape, "dtype": grouped.fake_dtype, "fp8_dtype": quantizer.dtype, "quantizer": None}
    if isinstance(quantizer, Float8BlockQuantizer):
        scales = _block_scales(grouped, quantizer, count, shape)
        if scales is None:
            return None
        common["is_2D_scaled"] = quantizer.block_scaling_dim == 2
        out = [Float8BlockwiseQTensorStorage(rowwise_data=r, rowwise_scale_inv=rs, columnwise_data=c,
                                             columnwise_scale_inv=cs, **common)
               for r, c, rs, cs in zip(rows, cols, *scales)]
    else:
        inverse = grouped.scale_inv if grouped.scale_inv is not None else grouped.columnwise_scale_inv
        out = [Float8TensorStorage(data=r, fp8_scale_inv=s, data_transpose=c, **common)
               for r, c, s in zip(rows, cols, inverse.view(count, 1).unbind(0))]
    shared = quantizer.copy()
    for expert in out:
        expert._quantizer = shared
    return out


def _block_scales(grouped, quantizer, count: int, shape: tuple) -> tuple | None:
    """Every expert's rowwise and columnwise scales (None where absent), at
    the offsets TE's split reads: the group's own where it has them, else
    ``count`` equal blocks. None where neither fits the buffer."""
    pairs = []
    for buffer, offsets, columnwise in ((grouped.scale_inv, grouped.scale_inv_offsets, False),
                                        (grouped.columnwise_scale_inv, grouped.columnwise_scale_inv_offsets, True)):
        if buffer is None:
            pairs.append((None,) * count)
            continue
        scale_shape = quantizer.get_scale_shape(shape, columnwise)
        size = scale_shape[0] * scale_shape[1]
        if offsets is None and buffer.numel() == count * size:
            pairs.append(buffer.view(count, *scale_shape).unbind(0))
            continue
        if offsets is None:
            offsets = range(0, (count + 1) * size, size)
        if not isinstance(offsets, (list, tuple, range)) or len(offsets) <= count or offsets[count] > buffer.numel():
            return None
        try:
            pairs.append(tuple(buffer[offsets[i]:offsets[i + 1]].view(scale_shape) for i in range(count)))
        except RuntimeError:  # a block of another size than the expert's scales
            return None
    return tuple(pairs)


# -- the quantized FSDP2 all-gather (docs/decisions.md, D13) -------------------------------
#: The largest finite value of each FP8 format, as TE's FP8-weight casts use it (``tensor/utils.py``).
_FP8_MAX = {TE_DType.kFloat8E4M3: 448.0, TE_DType.kFloat8E5M2: 57344.0}


def weight_quantizer_of(recipe) -> object | None:
    """The weight quantizer TE's modules make for ``recipe`` where a shard of
    the weight can be quantized to the whole weight's bytes: a
    ``Float8CurrentScaling`` recipe (``Float8CurrentScalingRecipeState``,
    with the weight's power-of-2 and epsilon settings the modules set from
    ``recipe.fp8_quant_fwd_weight``) or a ``Float8BlockScaling`` recipe with
    2D weight blocks (``Float8BlockScalingRecipeState``, rowwise usage only:
    a gathered 2D-block weight derives its columnwise form); None for any
    other recipe."""
    import torch

    settings = getattr(recipe, "fp8_quant_fwd_weight", None)
    current, block = getattr(recipe, "float8_current_scaling", None), getattr(recipe, "float8_block_scaling", None)
    if current is not None and current():
        return Float8CurrentScalingQuantizer(get_fp8_te_dtype(recipe, True), torch.device("cuda"),
                                             force_pow_2_scales=settings.power_2_scale,
                                             amax_epsilon=settings.amax_epsilon)
    if block is not None and block() and getattr(recipe, "w_block_scaling_dim", None) == 2:
        return Float8BlockQuantizer(get_fp8_te_dtype(recipe, True), rowwise=True, columnwise=False,
                                    amax_epsilon=settings.amax_epsilon, force_pow_2_scales=settings.power_2_scale,
                                    block_scaling_dim=2)
    return None


def shard_amaxes(shards):
    """The amax of each of ``shards`` as TE's current scaling computes it
    (``tex.compute_amax``): float32 tensors of one element, views of one
    buffer, as TE packs master weights' amaxes (``tensor/utils.py``,
    ``_cast_master_weights_to_fp8_current_scaling``); 0 for a shard without rows."""
    import torch

    if not shards:
        return []
    amaxes = list(torch.zeros(len(shards), dtype=torch.float32, device=shards[0].device).split(1))
    for shard, amax in zip(shards, amaxes):
        if shard.numel():
            tex.compute_amax(shard.contiguous(), amax)
    return amaxes


class CurrentCast:
    """One weight's Float8CurrentScaling cast, kept from one refresh to the
    next (:func:`cast_with_amaxes`): the FP8 bytes, the scale and its
    inverse, a ``Float8Quantizer`` over that scale and TE's ``Float8Tensor``
    over those bytes, the cast's destination. Built anew for every weight
    at every refresh, they cost more host time than the casts themselves."""

    __slots__ = ("data", "scale", "scale_inv", "cast", "out")

    def __init__(self, shard, fp8_dtype) -> None:
        import torch

        device = shard.device
        self.data = torch.empty(shard.shape, dtype=torch.uint8, device=device)
        self.scale = torch.empty(1, dtype=torch.float32, device=device)
        # One tensor each, not views of one buffer: the GEMMs read scale_inv
        # through a pointer cuBLAS requires aligned (16 bytes), which a view at
        # an offset of 4 bytes is not ("the requested functionality is not supported").
        self.scale_inv = torch.empty(1, dtype=torch.float32, device=device)
        self.cast = Float8Quantizer(scale=self.scale, amax=torch.Tensor(), fp8_dtype=fp8_dtype, rowwise=True,
                                    columnwise=False)
        self.out = self.cast.create_tensor_from_data(self.data, fake_dtype=shard.dtype)

    def fits(self, shard, fp8_dtype) -> bool:
        return (self.data.shape == shard.shape and self.data.device == shard.device
                and self.cast.dtype == fp8_dtype)


def cast_with_amaxes(shards, amaxes, quantizer, kept=None):
    """``(uint8 data, scale_inv, CurrentCast)`` of each of ``shards`` cast to
    FP8 with the scale of its (reduced) amax: the scales and their inverses
    from one call of TE's ``multi_tensor_compute_scale_and_scale_inv`` for
    all of them (``quantizer``'s FP8 format, power-of-2 and epsilon
    settings), then TE's scaled cast of each, as TE casts FP8 master weights
    (``tensor/utils.py``, ``_cast_master_weights_to_fp8_current_scaling``).
    ``kept``: per shard, a :class:`CurrentCast` a previous call returned, or
    None; one that fits the shard is written over (its bytes and scales
    are the new shard's), any other is left alone and a new one made."""
    import torch

    if not shards:
        return []
    kept = kept if kept is not None else [None] * len(shards)
    fp8_dtype = quantizer.dtype
    slots = [k if isinstance(k, CurrentCast) and k.fits(s, fp8_dtype) else CurrentCast(s, fp8_dtype)
             for s, k in zip(shards, kept)]
    overflow = torch.zeros(1, dtype=torch.int, device=shards[0].device)
    multi_tensor_applier(tex.multi_tensor_compute_scale_and_scale_inv, overflow,
                         [[amax.reshape(1) for amax in amaxes], [k.scale for k in slots],
                          [k.scale_inv for k in slots]],
                         _FP8_MAX[fp8_dtype], quantizer.force_pow_2_scales, quantizer.amax_epsilon)
    for shard, slot in zip(shards, slots):
        if shard.numel():
            slot.cast.update_quantized(shard.contiguous(), slot.out)
    return [(slot.data, slot.scale_inv, slot) for slot in slots]


def float8_weight(data, scale_inv, dtype, quantizer):
    """The FP8 weight TE's modules compute with, over gathered ``data``:
    ``Float8Tensor`` with a copy of the recipe's weight quantizer, rowwise
    usage only (TE's backward derives the transpose where dgrad reads it)."""
    own = quantizer.copy()
    own.set_usage(rowwise=True, columnwise=False)
    own.internal = False
    return Float8Tensor(shape=data.shape, dtype=dtype, data=data, fp8_scale_inv=scale_inv, fp8_dtype=own.dtype,
                        requires_grad=False, data_transpose=None, quantizer=own, device=data.device)


def refill_float8_weight(out, data, scale_inv) -> None:
    """Point the weight :func:`float8_weight` made at a new gather's bytes and
    scale, dropping the transpose derived from the previous gather."""
    out._data = data
    out._transpose = None
    out._transpose_invalid = True
    out._scale_inv = scale_inv


class BlockCast:
    """One weight's 2D-block cast, kept from one refresh to the next
    (:func:`block_quantize_rows`): a copy of the weight quantizer, rowwise
    usage only, and TE's ``Float8BlockwiseQTensor`` it writes."""

    __slots__ = ("cast", "out")

    def __init__(self, cast, out) -> None:
        self.cast, self.out = cast, out

    def fits(self, shard) -> bool:
        return self.out._rowwise_data.shape == shard.shape and self.out._rowwise_data.device == shard.device


def block_quantize_rows(shard, quantizer, kept=None):
    """``(uint8 data, scale_inv, BlockCast)`` of ``shard``'s rows quantized
    in 2D blocks by TE's own kernel (``quantizer``: a ``Float8BlockQuantizer``
    with ``block_scaling_dim=2``), rowwise usage only. Exact as the whole
    weight's quantization where the shard's first row starts a block: every
    block then lies in one shard. ``scale_inv`` has one row per 128-row
    block of the shard and the block columns padded to a multiple of 4, as
    TE lays it out. ``kept``: a :class:`BlockCast` a previous call returned,
    written over where it fits the shard, or None."""
    import torch

    source = shard.contiguous()
    if isinstance(kept, BlockCast) and kept.fits(shard):
        kept.cast.update_quantized(source, kept.out)
    else:
        own = quantizer.copy()
        own.set_usage(rowwise=True, columnwise=False)
        own.internal = False
        kept = BlockCast(own, own.quantize(source))
    return kept.out._rowwise_data.view(torch.uint8), kept.out._rowwise_scale_inv, kept


def block_weight(data, scale_inv, dtype, quantizer):
    """The 2D-block FP8 weight TE's modules compute with, over gathered
    ``data`` and the whole weight's ``scale_inv``: ``Float8BlockwiseQTensor``
    with rowwise data only (TE's backward derives the columnwise form with
    ``_create_columnwise``, a byte and scale transpose, where dgrad reads it)."""
    own = quantizer.copy()
    own.set_usage(rowwise=True, columnwise=False)
    own.internal = False
    return Float8BlockwiseQTensor(shape=data.shape, dtype=dtype, fp8_dtype=own.dtype, rowwise_data=data,
                                  rowwise_scale_inv=scale_inv, columnwise_data=None, columnwise_scale_inv=None,
                                  quantizer=own, is_2D_scaled=True, requires_grad=False, device=data.device)


def refill_block_weight(out, data, scale_inv) -> None:
    """Point the weight :func:`block_weight` made at a new gather's bytes and
    scales, dropping the columnwise form derived from the previous gather."""
    out._rowwise_data = data
    out._rowwise_scale_inv = scale_inv
    out._columnwise_data = None
    out._columnwise_scale_inv = None
