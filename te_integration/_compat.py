"""The one thin, version-checked layer between this package and TE's internals.

Everything ``te_integration`` uses from TransformerEngine is imported here,
and nowhere else. At import the layer checks the installed version and the
shape of every private piece the seams rely on (argument-tuple positions,
the lines of TE's code a seam depends on). A mismatch refuses to load with a
message that says which piece changed.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import warnings
from types import ModuleType

SUPPORTED = "2.20"
"""TE major.minor this package binds to: ``>=2.20,<2.21``."""


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
            f"{SUPPORTED}.x, which could not be imported ({err}). Install it with "
            "`pip install 'te-workspace-manager[te]'`, or use the TE-free core "
            "(`import workspace_manager`) alone."
        ) from err
    return transformer_engine


te = _import_te()
VERSION: str = str(getattr(te, "__version__", "unknown"))
if not VERSION.startswith(SUPPORTED + "."):
    raise UnsupportedTEError(
        f"te_integration supports TransformerEngine >={SUPPORTED},<2.21; the installed "
        f"version is {VERSION}. Install a supported version "
        "(`pip install 'transformer_engine[pytorch]>=2.20,<2.21'`) or use the TE-free core alone."
    )

import transformer_engine.pytorch as tep  # noqa: E402
import transformer_engine.pytorch.attention.multi_head_attention as mha_module  # noqa: E402
import transformer_engine.pytorch.distributed as te_distributed  # noqa: E402
import transformer_engine.pytorch.module.base as base_module  # noqa: E402
import transformer_engine.pytorch.module.layernorm_linear as lnl_module  # noqa: E402
import transformer_engine.pytorch.module.layernorm_mlp as lnmlp_module  # noqa: E402
import transformer_engine.pytorch.module.linear as linear_module  # noqa: E402
import transformer_engine.pytorch.transformer as transformer_module  # noqa: E402
from transformer_engine.pytorch.distributed_weight import is_distributed_weight  # noqa: E402
from transformer_engine.pytorch.graph import is_graph_capturing  # noqa: E402
from transformer_engine.pytorch.jit import no_torch_dynamo  # noqa: E402
from transformer_engine.pytorch.quantization import FP8GlobalStateManager  # noqa: E402
from transformer_engine.pytorch.quantized_tensor import QuantizedTensorStorage  # noqa: E402
from transformer_engine.pytorch.tensor.utils import clear_columnwise_cache  # noqa: E402

TELinear = tep.Linear
TELayerNormLinear = tep.LayerNormLinear
TELayerNormMLP = tep.LayerNormMLP
LinearFunction = linear_module._Linear
LNLFunction = lnl_module._LayerNormLinear
LNMLPFunction = lnmlp_module._LayerNormMLP
quantize_weight = base_module.quantize_weight
is_weight_workspace_valid = base_module._is_weight_workspace_valid
is_fp8_activation_recompute_enabled = te_distributed.is_fp8_activation_recompute_enabled
in_fp8_activation_recompute_phase = te_distributed.in_fp8_activation_recompute_phase

#: Positions in ``_LayerNormLinear.forward``'s ``non_tensor_args``.
LNL_ARGS = {"is_first_microbatch": 1, "fp8": 2, "weight_quantizer": 7, "cpu_offloading": 12,
            "is_grad_enabled": 21, "fsdp_group": 33, "skip_fp8_weight_update": 35, "debug": 37, "is_fsdp2": 38}
#: Positions in ``_LayerNormMLP._forward``'s ``non_tensor_args`` (49 from the
#: module, ``recompute_for_bwd`` appended by ``forward``).
LNMLP_ARGS = {"is_first_microbatch": 1, "fp8": 2, "fc1_weight_quantizer": 7, "fc2_weight_quantizer": 13,
              "cpu_offloading": 18, "is_grad_enabled": 28, "fsdp_group": 41, "skip_fp8_weight_update": 44,
              "checkpoint": 46, "debug": 47, "is_fsdp2": 48, "recompute_for_bwd": 49}

#: Lines of TE's code each seam relies on (a changed TE refuses to load).
_SENTINELS = {
    linear_module._linear_forward_impl: ["if is_fsdp2 and weightmat is not weight:", "quantize_weight("],
    linear_module._linear_eager: ["_Linear.apply(", "_Linear.forward(None"],
    LNLFunction.forward: ["if is_fsdp2 and weightmat is not weight:", "ctx.is_fsdp2 = is_fsdp2", "quantize_weight("],
    LNLFunction.backward: ["weight_quantizer.set_usage(rowwise=True, columnwise=True)", "clear_columnwise_cache("],
    TELayerNormLinear.forward: ["_LayerNormLinear.apply", "_LayerNormLinear.forward"],
    LNMLPFunction._forward: ["fsdp2_skip_columnwise = is_fsdp2 and not is_recomputation", "ctx.is_fsdp2 = is_fsdp2"],
    LNMLPFunction.forward: ["_LayerNormMLP._forward("],
    TELayerNormMLP.forward: ["_LayerNormMLP.apply", "_LayerNormMLP.forward"],
}


def _unpacked_names(fn, tuple_name: str) -> list[str]:
    """Target names of ``(...) = <tuple_name>`` in ``fn``'s source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Name) and node.value.id == tuple_name
                and isinstance(node.targets[0], ast.Tuple)):
            return [t.id for t in node.targets[0].elts if isinstance(t, ast.Name)]
    return []


def _check_structure() -> list[str]:
    problems = []
    for fn, needles in _SENTINELS.items():
        source = inspect.getsource(fn)
        problems += [f"{fn.__qualname__} no longer contains {n!r}" for n in needles if n not in source]
    for fn, table, extra in ((LNLFunction.forward, LNL_ARGS, 0), (LNMLPFunction._forward, LNMLP_ARGS, 0)):
        names = _unpacked_names(fn, "non_tensor_args")
        for name, index in table.items():
            if index >= len(names) or names[index] != name:
                problems.append(f"{fn.__qualname__}: non_tensor_args[{index}] is no longer {name!r}")
    for name in ("is_fsdp2", "weight_quantizer", "is_first_microbatch", "is_grad_enabled", "input_requires_grad",
                 "backward_override", "fp8", "debug", "fsdp_group", "skip_fp8_weight_update", "cpu_offloading"):
        if name not in linear_module.LinearFwdArgs.__dataclass_fields__:
            problems.append(f"LinearFwdArgs has no field {name!r}")
    for name in ("is_fsdp2", "weight_quantizer"):
        if name not in linear_module.LinearBwdArgs.__dataclass_fields__:
            problems.append(f"LinearBwdArgs has no field {name!r}")
    originals = (linear_module.quantize_weight, lnl_module.quantize_weight, lnmlp_module.quantize_weight)
    if any(q is not base_module.quantize_weight and not getattr(q, "_te_wm_seam", False) for q in originals):
        problems.append("quantize_weight was replaced by someone else in a TE module")
    return problems


_problems = _check_structure()
if _problems:
    raise UnsupportedTEError(
        f"TransformerEngine {VERSION}'s internals differ from what te_integration binds to: "
        + "; ".join(_problems)
    )
