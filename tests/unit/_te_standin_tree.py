"""A stand-in TransformerEngine written to disk, for import checks on CPU.

``te_integration.te._compat`` checks at import that every piece of TE the
binding relies on exists and has the shape it expects; its checks read real
source files (``inspect.getsource``), so the stand-in is a package on disk.
It holds exactly the pieces ``_compat.SEAMS`` names, each defined with a
``def``, ``class`` or assignment at the start of a line, so that
:func:`remove` can take one away; and the code lines and argument-tuple
positions ``_compat`` looks for, the positions read from ``_compat.py`` itself.
"""

from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _compat_literal(name: str):
    """A literal assigned in _compat.py (argument-tuple positions, field names)."""
    tree = ast.parse((ROOT / "te_integration/te/_compat.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == name:
            return ast.literal_eval(node.value)
    raise KeyError(name)


def _unpack(table: dict[str, int], source: str = "non_tensor_args") -> str:
    """``(a, b, ...) = <source>`` with each name of ``table`` at its position."""
    by_index = {i: n for n, i in table.items()}
    names = [by_index.get(i, f"_unused{i}") for i in range(max(by_index) + 1)]
    return f"({', '.join(names)},) = {source}"


def _files() -> dict[str, str]:
    return {
        "__init__.py": "__version__ = '2.20.2'\n",
        "pytorch/__init__.py": """
            from .module import linear as _linear, layernorm_linear as _lnl, layernorm_mlp as _mlp
            Linear = getattr(_linear, "Linear", None)
            LayerNormLinear = getattr(_lnl, "LayerNormLinear", None)
            LayerNormMLP = getattr(_mlp, "LayerNormMLP", None)
            from .module import grouped_linear as _grouped
            GroupedLinear = getattr(_grouped, "GroupedLinear", None)
        """,
        "pytorch/module/__init__.py": """
            from . import grouped_linear as _grouped
            GroupedLinear = getattr(_grouped, "GroupedLinear", None)
        """,
        "pytorch/module/grouped_linear.py": _grouped_linear_source(),
        "pytorch/module/base.py": """
            class QuantizedTensor:
                pass
            def quantize_weight(*, tensor=None, quantizer=None, workspace=None, workspace_dtype=None, **kwargs):
                if isinstance(tensor, QuantizedTensor):
                    return tensor, None
                if workspace is not None:
                    return workspace, None
                out = quantizer.quantize(tensor, dtype=workspace_dtype)
                return out, None
            def _is_weight_workspace_valid(workspace, quantizer):
                return True
            class TransformerEngineBaseModule:
                def prepare_forward(self, inp):
                    return inp
                def end_forward(self):
                    return None
        """,
        "pytorch/module/linear.py": f"""
            import dataclasses
            from . import base as _base
            quantize_weight = getattr(_base, "quantize_weight", None)
            general_gemm = None
            LinearFwdArgs = dataclasses.make_dataclass("LinearFwdArgs", {list(_compat_literal("LINEAR_FWD_FIELDS"))!r})
            LinearBwdArgs = dataclasses.make_dataclass("LinearBwdArgs", {list(_compat_literal("LINEAR_BWD_FIELDS"))!r})
            def _linear_forward_impl(is_fsdp2, weightmat, weight):
                if is_fsdp2 and weightmat is not weight:
                    pass
                return quantize_weight()
            def _linear_backward_impl(bwd_args, saved_weight):
                weight_fp8 = bwd_args.weight_quantizer(saved_weight)
                return weight_fp8
            def _linear_eager(*args):
                if args:
                    return _Linear.apply(*args)
                return _Linear.forward(None, *args)
            class _Linear:
                @staticmethod
                def forward(ctx, *args):
                    return None
                @staticmethod
                def backward(ctx, *grads):
                    return None
            class Linear:
                def forward(self, *args):
                    self.prepare_forward(args)
                    try:
                        return _linear_eager(*args)
                    finally:
                        self.end_forward()
        """,
        "pytorch/module/layernorm_linear.py": f"""
            from . import base as _base
            quantize_weight = getattr(_base, "quantize_weight", None)
            general_gemm = None
            class _LayerNormLinear:
                @staticmethod
                def forward(ctx, non_tensor_args, weight, weightmat):
                    {_unpack(_compat_literal("LNL_ARGS"))}
                    if is_fsdp2 and weightmat is not weight:
                        ctx.is_fsdp2 = is_fsdp2
                    return quantize_weight()
                @staticmethod
                def backward(ctx, weight_quantizer, clear_columnwise_cache):
                    weight_quantizer.set_usage(rowwise=True, columnwise=True)
                    clear_columnwise_cache(None)
            class LayerNormLinear:
                def forward(self, *args):
                    self.prepare_forward(args)
                    try:
                        if args:
                            return _LayerNormLinear.apply(*args)
                        return _LayerNormLinear.forward(None, *args)
                    finally:
                        self.end_forward()
        """,
        "pytorch/module/layernorm_mlp.py": f"""
            from . import base as _base
            quantize_weight = getattr(_base, "quantize_weight", None)
            general_gemm = None
            def prepare_for_saving(*tensors):
                return list(tensors), [None] * len(tensors)
            class _LayerNormMLP:
                @staticmethod
                def _forward(ctx, non_tensor_args, is_recomputation):
                    {_unpack(_compat_literal("LNMLP_ARGS"))}
                    fsdp2_skip_columnwise = is_fsdp2 and not is_recomputation
                    ctx.is_fsdp2 = is_fsdp2
                    fc1_wt_save = fc2_wt_save = None
                    tensors_to_save, tensor_objects = prepare_for_saving(
                        fc1_wt_save,
                        fc2_wt_save,
                    )
                    return fsdp2_skip_columnwise
                @staticmethod
                def forward(ctx, *args):
                    return _LayerNormMLP._forward(ctx, *args)
                @staticmethod
                def backward(ctx, origin_fc1_weight, origin_fc2_weight):
                    {_unpack(_compat_literal("LNMLP_RECOMPUTED"), "_LayerNormMLP._recompute(ctx)")}
                    fc1_weight = ctx.fc1_weight_quantizer(origin_fc1_weight)
                    fc2_weight = ctx.fc2_weight_quantizer(origin_fc2_weight)
                    return fc1_weight, fc2_weight
            class LayerNormMLP:
                def forward(self, *args):
                    self.prepare_forward(args)
                    try:
                        if args:
                            return _LayerNormMLP.apply(*args)
                        return _LayerNormMLP.forward(None, *args)
                    finally:
                        self.end_forward()
        """,
        "pytorch/attention/__init__.py": "",
        "pytorch/attention/multi_head_attention.py": """
            from ..module import linear as _linear, layernorm_linear as _lnl
            Linear = getattr(_linear, "Linear", None)
            LayerNormLinear = getattr(_lnl, "LayerNormLinear", None)
        """,
        "pytorch/transformer.py": """
            from .module import layernorm_mlp as _mlp
            LayerNormMLP = getattr(_mlp, "LayerNormMLP", None)
        """,
        "pytorch/distributed.py": """
            _IN_ACTIVATION_RECOMPUTE_REGION = False
            def is_fp8_activation_recompute_enabled():
                return _IN_ACTIVATION_RECOMPUTE_REGION and False
            def in_fp8_activation_recompute_phase():
                return False
        """,
        "pytorch/distributed_weight.py": """
            def is_distributed_weight(weight):
                return False
        """,
        "pytorch/graph.py": """
            _IS_GRAPH_CAPTURING = False
            def is_graph_capturing():
                return _IS_GRAPH_CAPTURING
        """,
        "pytorch/jit.py": """
            def no_torch_dynamo(recursive=True):
                return lambda fn: fn
        """,
        "pytorch/quantization.py": """
            class FP8GlobalStateManager:
                @staticmethod
                def get_fp8_recipe():
                    return None
            def get_fp8_te_dtype(recipe, fprop_tensor=True):
                return None
        """,
        "pytorch/constants.py": """
            import enum
            class DType(enum.IntEnum):
                kFloat8E4M3 = 7
                kFloat8E5M2 = 8
        """,
        "pytorch/optimizers/__init__.py": "",
        "pytorch/optimizers/multi_tensor_apply.py": """
            def multi_tensor_applier(op, noop_flag, tensor_lists, *args):
                return op(noop_flag, tensor_lists, *args)
        """,
        "pytorch/tensor/float8_tensor.py": """
            class Float8Tensor:
                pass
            class Float8Quantizer:
                pass
            class Float8CurrentScalingQuantizer:
                pass
        """,
        "pytorch/quantized_tensor.py": """
            class QuantizedTensorStorage:
                pass
        """,
        "pytorch/tensor/__init__.py": "",
        "pytorch/tensor/storage/__init__.py": "",
        "pytorch/tensor/storage/float8_tensor_storage.py": _storage("Float8TensorStorage"),
        "pytorch/tensor/storage/float8_blockwise_tensor_storage.py": _storage("Float8BlockwiseQTensorStorage"),
        "pytorch/tensor/float8_blockwise_tensor.py": """
            class Float8BlockQuantizer:
                pass


            class Float8BlockwiseQTensor:
                pass
        """,
        "pytorch/tensor/utils.py": """
            def clear_columnwise_cache(tensor):
                return None
        """,
    }


def _storage(name: str) -> str:
    """A TE storage class whose ``__new__`` holds the line ``_compat`` checks
    and keeps what the caller gave (``test_split_experts`` reads it)."""
    return f"""
            class {name}:
                def __new__(cls, *args, quantizer=None, **kwargs):
                    instance = object.__new__(cls)
                    instance._quantizer = quantizer.copy() if quantizer is not None else None
                    instance.kwargs = kwargs
                    return instance
        """


def _grouped_linear_source() -> str:
    """TE's grouped_linear.py as the seams read it: the saving and restoring
    lines by position, the argument tuple, the module's cache."""
    pad = " " * 12  # the common indent textwrap.dedent removes from each file
    saving = "\n".join(pad + " " * 16 + name + "," for name in ("*inputmats", "*weights_fp8", "*saved_weights",
                                                                  "*biases"))
    grouped_saving = "\n".join(pad + " " * 16 + name + "," for name in ("input_to_save", "*weights_to_save",
                                                                          "split_sizes"))
    body = f"""
            from . import base as _base
            quantize_weight = getattr(_base, "quantize_weight", None)
            general_grouped_gemm = None
            class tex:
                @staticmethod
                def compute_amax(tensor, amax):
                    return None
                @staticmethod
                def multi_tensor_compute_scale_and_scale_inv(*args):
                    return None
            class GroupedTensorStorage:
                def split_into_quantized_tensors(self, i=0, numel=0, quantizer=None, tensor_shape=None, math=None):
                    data_start = i * numel
                    rowwise_data = self.rowwise_data[data_start:data_end].view(rowwise_tensor_shape)
                    columnwise_tensor_shape = quantizer.get_columnwise_shape(tensor_shape)
                    scale_inv = self.scale_inv[i : i + 1]
                    scale_inv = self.columnwise_scale_inv[i : i + 1]
                    cum += math.prod(scale_shape)
                    is_2D_scaled = quantizer.block_scaling_dim == 2
                    float8_tensor_class = Float8TensorStorage
                    float8_blockwise_q_tensor_class = Float8BlockwiseQTensorStorage
            def prepare_for_saving(*tensors):
                return list(tensors), [None] * len(tensors)
            def restore_from_func_ctx(ctx, return_saved_tensors=False):
                return []
            class _GroupedLinear:
                @staticmethod
                def _prepare_weights_for_grouped_tensor_gemm(weights, quantizers, workspaces, **kwargs):
                    return weights, [None]
                @staticmethod
                def _forward_grouped_tensor(ctx, weights_to_save, single_grouped_weight):
                    _GroupedLinear._prepare_weights_for_grouped_tensor_gemm(None, None, None)
                    weights_to_save = [None] * len(weights_to_save)
                    prepare_for_saving(
{grouped_saving}
                    )
                @staticmethod
                def forward(ctx, non_tensor_args, num_gemms):
                    {_unpack(_compat_literal("GROUPED_ARGS"))}
                    weights_fp8 = [None] * num_gemms
                    quantize_weight()
                    if ctx:
                        return _GroupedLinear._forward_grouped_tensor(ctx, None, False)
                    prepare_for_saving(
{saving}
                    )
                @staticmethod
                def _backward_grouped_tensor(ctx, N):
                    saved_tensors = restore_from_func_ctx(ctx)
                    weights_for_gemm = saved_tensors[1]
                    weight_tensors = saved_tensors[1 : 1 + N]
                @staticmethod
                def backward(ctx, N):
                    saved_tensors = restore_from_func_ctx(ctx)
                    weights = saved_tensors[N : 2 * N]
                    saved_weights = saved_tensors[2 * N : 3 * N]
            class GroupedLinear:
                def forward(self, *args):
                    self.prepare_forward(args)
                    try:
                        if args:
                            return _GroupedLinear.apply(*args)
                        key = _GroupedLinear.forward(None, *args)
                        self._fp8_workspaces[key] = ws
                    finally:
                        self.end_forward()
        """
    return body


#: Code for a process that imports te_integration over the tree: TE's quantizer
#: classes that ``_te_quantizers`` resolves by name, which the tree lacks, made
#: empty classes in their modules (the tree's module where it has one).
QUANTIZER_STUBS = """
import importlib, sys, types
from workspace_manager.extending import TE_QUANTIZER_PROFILES
for name in TE_QUANTIZER_PROFILES:
    module, _, cls = name.rpartition(".")
    try:
        found = importlib.import_module(module)
    except ImportError:
        found = sys.modules.setdefault(module, types.ModuleType(module))
    setattr(found, cls, type(cls, (), {}))
"""


def write_te_tree(root: Path) -> Path:
    """Write the complete stand-in under ``root``/transformer_engine; returns ``root``."""
    for rel, source in _files().items():
        path = root / "transformer_engine" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source).lstrip("\n"))
    return root


def source_file(root: Path, module: str) -> Path:
    """The stand-in's file for dotted ``module`` (a package's ``__init__.py``)."""
    path = root / module.replace(".", "/")
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def remove(root: Path, module: str, attr: str) -> None:
    """Take ``attr``'s last part out of ``module`` (renaming where it is
    defined), or the whole module file when ``attr`` is empty."""
    path = source_file(root, module)
    if not attr:
        path.unlink()
        return
    name = attr.rsplit(".", 1)[-1]
    pattern = re.compile(rf"^(\s*)(def |class )?{re.escape(name)}\b(?=\s*[(:=])", re.MULTILINE)
    text, count = pattern.subn(lambda m: f"{m.group(1)}{m.group(2) or ''}{name}_removed_by_test", path.read_text())
    assert count, f"the stand-in defines no {name!r} in {path}"
    path.write_text(text)
