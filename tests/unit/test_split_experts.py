"""``te._compat.split_experts`` on CPU, against the stand-in TE on disk
(``_te_standin_tree``), whose storage classes record what they are given.

The GPU test (``tests/gpu/test_expert_split.py``) compares it with TE's own
split; here its reading of the layout is checked where a CPU can: every
expert gets the views of its own rows, its own scale (at TE's offsets for
block scales) and one shared copy of the quantizer; and it declines what
it cannot read (a quantizer that makes tensors, block scales that fit no
offsets), so the caller asks TE."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _te_standin_tree import write_te_tree

ROOT = Path(__file__).resolve().parents[2]

_PRELUDE = f"""
import sys, types, torch
package = types.ModuleType("te_integration")
package.__path__ = [{str(ROOT / "te_integration")!r}]
sys.modules["te_integration"] = package
import te_integration.te._compat as te
from types import SimpleNamespace as NS

class Quantizer:
    internal, dtype = True, "e4m3"
    def copy(self):
        return type(self)()
    def get_columnwise_shape(self, shape):
        return [shape[-1]] + list(shape[:-1])

class Block(Quantizer, te.Float8BlockQuantizer):
    block_scaling_dim = 2
    def get_scale_shape(self, shape, columnwise):
        return (shape[1] // 2, 3) if columnwise else (shape[0] // 2, 4)

COUNT, SHAPE = 3, (4, 6)
"""

_CASES = {
    "per_tensor": """
        q = Quantizer()
        rowwise = torch.arange(COUNT * 24, dtype=torch.uint8)
        columnwise = torch.arange(COUNT * 24, dtype=torch.uint8) + 100
        grouped = NS(rowwise_data=rowwise, columnwise_data=columnwise, scale_inv=torch.tensor([1., 2., 3.]),
                     columnwise_scale_inv=None, fake_dtype=torch.bfloat16)
        out = te.split_experts(grouped, q, COUNT, SHAPE)
        assert len(out) == COUNT and all(type(e) is te.Float8TensorStorage for e in out)
        for i, e in enumerate(out):
            k = e.kwargs
            assert torch.equal(k["data"], rowwise[24 * i:24 * (i + 1)].view(SHAPE))
            assert k["data"].data_ptr() == rowwise.data_ptr() + 24 * i  # a view, not a copy
            assert torch.equal(k["data_transpose"], columnwise[24 * i:24 * (i + 1)].view(6, 4))
            assert k["fp8_scale_inv"].tolist() == [float(i + 1)] and k["fp8_dtype"] == "e4m3"
        assert len({id(e._quantizer) for e in out}) == 1 and out[0]._quantizer is not q
        rowwise_only = NS(**{**vars(grouped), "columnwise_data": None})
        assert all(e.kwargs["data_transpose"] is None for e in te.split_experts(rowwise_only, q, COUNT, SHAPE))
    """,
    "declines_tensors": """
        q = Quantizer()
        q.internal = False  # TE's split would make QuantizedTensor subclasses
        grouped = NS(rowwise_data=torch.zeros(COUNT * 24, dtype=torch.uint8), columnwise_data=None,
                     scale_inv=torch.ones(COUNT), columnwise_scale_inv=None, fake_dtype=torch.bfloat16)
        assert te.split_experts(grouped, q, COUNT, SHAPE) is None
    """,
    "block_equal_blocks": """
        q = Block()
        scales = torch.arange(COUNT * 8, dtype=torch.float32)  # rowwise scale shape (2, 4) per expert
        grouped = NS(rowwise_data=torch.zeros(COUNT * 24, dtype=torch.uint8), columnwise_data=None,
                     scale_inv=scales, scale_inv_offsets=None, columnwise_scale_inv=None,
                     columnwise_scale_inv_offsets=None, fake_dtype=torch.bfloat16)
        out = te.split_experts(grouped, q, COUNT, SHAPE)
        assert all(type(e) is te.Float8BlockwiseQTensorStorage for e in out)
        for i, e in enumerate(out):
            assert torch.equal(e.kwargs["rowwise_scale_inv"], scales[8 * i:8 * (i + 1)].view(2, 4))
            assert e.kwargs["columnwise_scale_inv"] is None and e.kwargs["is_2D_scaled"] is True
    """,
    "block_te_offsets": """
        q = Block()
        # Columnwise scales (3, 3) per expert, at the offsets the group gives, in a longer buffer
        # (so not read as equal blocks of the whole buffer).
        buffer = torch.arange(40, dtype=torch.float32)
        grouped = NS(rowwise_data=None, columnwise_data=torch.zeros(COUNT * 24, dtype=torch.uint8),
                     scale_inv=None, scale_inv_offsets=None, columnwise_scale_inv=buffer,
                     columnwise_scale_inv_offsets=[0, 9, 18, 27], fake_dtype=torch.bfloat16)
        out = te.split_experts(grouped, q, COUNT, SHAPE)
        assert [e.kwargs["columnwise_scale_inv"].flatten()[0].item() for e in out] == [0, 9, 18]
        assert all(e.kwargs["columnwise_scale_inv"].shape == (3, 3) for e in out)
    """,
    "block_declines_what_fits_no_offsets": """
        q = Block()
        for offsets, size in ((None, 20), ([0, 9, 18, 27], 20), ([0, 5, 10, 15], 40)):
            grouped = NS(rowwise_data=None, columnwise_data=torch.zeros(COUNT * 24, dtype=torch.uint8),
                         scale_inv=None, scale_inv_offsets=None, columnwise_scale_inv=torch.zeros(size),
                         columnwise_scale_inv_offsets=offsets, fake_dtype=torch.bfloat16)
            assert te.split_experts(grouped, q, COUNT, SHAPE) is None, (offsets, size)
    """,
}


#: Runs every case in one fresh interpreter (importing torch and the
#: stand-in once), each in a namespace of its own made by the prelude, and
#: prints, per case, None or the traceback of its failure.
_RUN_ALL = _PRELUDE + """
import json, traceback
prelude = {k: v for k, v in globals().items() if not k.startswith("__")}
outcomes = {}
for name, code in json.loads(sys.stdin.read()).items():
    try:
        exec(compile(code, "case " + name, "exec"), dict(prelude))
        outcomes[name] = None
    except BaseException:
        outcomes[name] = traceback.format_exc()
print(json.dumps(outcomes))
"""


#: A case that must fail, run with the others: the runner can report a failure.
_SENTINEL = ("_fails_on_purpose", "assert SHAPE == (9, 9), 'not the shape'")


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, str | None]:
    """Case -> None where it held, else its traceback."""
    tree = write_te_tree(tmp_path_factory.mktemp("standin"))
    cases = {name: textwrap.dedent(code) for name, code in _CASES.items()}
    cases[_SENTINEL[0]] = _SENTINEL[1]
    result = subprocess.run([sys.executable, "-c", _RUN_ALL], input=json.dumps(cases), capture_output=True, text=True,
                            timeout=120, env={"PYTHONPATH": f"{tree}:{ROOT}", "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stdout + result.stderr
    found = json.loads(result.stdout.splitlines()[-1])
    assert "AssertionError: not the shape" in found.pop(_SENTINEL[0])  # each case apart: a failure is seen
    return found


@pytest.mark.parametrize("case", sorted(_CASES))
def test_split_experts_reads_te_s_layout(outcomes, case):
    assert outcomes[case] is None, outcomes[case]
