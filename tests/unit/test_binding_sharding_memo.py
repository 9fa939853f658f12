"""The binding's memo follows FSDP2's reshard switch (CPU, gloo, world size 1).

A drop-in's levers are memoized per call shape, and the shape holds the
sharding read from FSDP2's own state on every call: toggling
``set_reshard_after_forward`` must re-plan (a new shape) the first time,
and hit the memo when toggled back.
"""

from __future__ import annotations

import torch
from _fake_te import TELinear, load_full_binding

from workspace_manager import Sharding


def test_toggling_reshard_after_forward_replans_once_then_hits_the_memo(monkeypatch, gloo):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    ti = load_full_binding(monkeypatch)
    model = torch.nn.Sequential(TELinear(8, 8, seed=1), TELinear(8, 8, seed=2))
    ti.modules.convert_model(model)
    mesh = init_device_mesh("cpu", (1,))
    for layer in model:
        fully_shard(layer, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    state = ti.modules.workspace_state(model[0])

    def step() -> Sharding:
        model(torch.randn(4, 8, requires_grad=True)).sum().backward()
        return ti.modules.last_plans(model[0])["weight"][0].sharding

    assert step() is Sharding.FSDP2_KEEP and state.shapes_planned() == 1
    model.set_reshard_after_forward(True)
    assert step() is Sharding.FSDP2_RESHARD and state.shapes_planned() == 2
    model.set_reshard_after_forward(False)
    assert step() is Sharding.FSDP2_KEEP and state.shapes_planned() == 2  # seen before: a lookup
    assert model[0].is_fsdp2
