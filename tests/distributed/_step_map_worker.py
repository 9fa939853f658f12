"""torchrun worker (gloo, CPU): which drop-ins an optimizer step writes under FSDP2.

Two models of drop-in Linears (the CPU stand-in TE, ``tests/unit/_fake_te``),
each ``fully_shard``-ed with its own AdamW over the sharded parameters. A
step must move the clock (``ModuleWorkspaceState.writes``) of exactly the
drop-ins whose parameters its optimizer holds, found through FSDP2's own
records; an optimizer holding a DTensor no FSDP2 record names moves every
clock (docs/decisions.md, D12). Writes ``{"ranks": [{"rank", "rows"}]}``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))

from _pytest.monkeypatch import MonkeyPatch  # noqa: E402  (the stand-in's loader takes one)

from _fake_te import TELinear, load_full_binding  # noqa: E402

from tests.distributed._ranks import report, rows_of, run  # noqa: E402

TI = load_full_binding(MonkeyPatch())


def _model(seed: int, mesh, reshard: bool) -> nn.Module:
    model = TI.modules.convert_model(nn.Sequential(TELinear(8, 8, seed=seed), TELinear(8, 8, seed=seed + 1)))
    for layer in model:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    return model


def _clocks(model: nn.Module) -> list[int]:
    return [layer._wm_state.writes for layer in model]


def _train(model: nn.Module, microbatches: int) -> None:
    for i in range(microbatches):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * dist.get_rank() + i))
        model(x).sum().backward()


def _row(case: str, what: str, expected, got) -> dict:
    return {"case": case, "what": what, "expected": expected, "got": got, "passed": expected == got}


def steps_write_their_own_model(mesh, reshard: bool, accumulate: bool) -> list[dict]:
    """Each model's step moves its own drop-ins' clocks and no other's. With
    ``accumulate``: reshard_after_backward off, so at step time the modules
    hold the unsharded parameters FSDP2 gathered, and only FSDP2's records
    tie them to the sharded ones the optimizer holds."""
    case = f"reshard_after_forward={reshard}" + (", set_reshard_after_backward(False), 2 microbatches"
                                                 if accumulate else "")
    a, b = _model(1, mesh, reshard), _model(3, mesh, reshard)
    if accumulate:
        for model in (a, b):
            model.set_reshard_after_backward(False)
    opts = [torch.optim.AdamW(m.parameters(), lr=0.1) for m in (a, b)]
    for model in (a, b):
        _train(model, 2 if accumulate else 1)
    registered = type(a[0]._parameters["weight"]).__name__
    rows = [_row(case, "a's weight at step time", "Parameter" if accumulate else "DTensor", registered)]
    opts[1].step()
    rows.append(_row(case, "clocks after b's step (a, b)", [[0, 0], [1, 1]], [_clocks(a), _clocks(b)]))
    opts[0].step()
    rows.append(_row(case, "clocks after a's step (a, b)", [[1, 1], [1, 1]], [_clocks(a), _clocks(b)]))
    rows.append(_row(case, "stale copies in a after both steps", [], [str(s) for s in TI.stale.stale_workspaces(a)]))
    return rows


def an_unplaceable_parameter_writes_every_model(mesh) -> list[dict]:
    from torch.distributed.tensor import Replicate, distribute_tensor

    case = "a DTensor no FSDP2 record names"
    a, b = _model(1, mesh, True), _model(3, mesh, True)
    for model in (a, b):
        _train(model, 1)
    foreign = nn.Parameter(distribute_tensor(torch.zeros(4), mesh, [Replicate()]))
    opt = torch.optim.SGD([foreign], lr=0.1)
    step = TI.step_hook.Step.of(opt)
    rows = [_row(case, "the step counts as writing everything", True, step.everything)]
    opt.step()
    rows.append(_row(case, "clocks after its step (a, b)", [[1, 1], [1, 1]], [_clocks(a), _clocks(b)]))
    return rows


def main() -> int:
    import importlib

    TI.stale = importlib.import_module("te_integration.runtime._stale")
    out_path = sys.argv[1]
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    cases = [lambda: steps_write_their_own_model(mesh, True, False),
             lambda: steps_write_their_own_model(mesh, False, False),
             lambda: steps_write_their_own_model(mesh, False, True),
             lambda: an_unplaceable_parameter_writes_every_model(mesh)]
    rows = rows_of(cases, lambda error: _row("setup", "no error", None, error))
    return report(Path(out_path), {"rank": dist.get_rank(), "rows": rows})


if __name__ == "__main__":
    run(main)
