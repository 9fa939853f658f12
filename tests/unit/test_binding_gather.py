"""``te_integration.enable_quantized_gather`` (D13) where no FSDP2 run is
needed: which drop-in weights it leaves out, and why. The gloo runs
(``tests/distributed/test_gather_binding.py``) test what it sets up."""

from __future__ import annotations

import pytest
import torch.nn as nn
from _fake_te import TELinear, load_full_binding
from _fake_te_gather import RECIPES
from _fake_te_grouped import TEGroupedLinear


@pytest.fixture
def ti(monkeypatch):
    return load_full_binding(monkeypatch)


def test_weights_fsdp2_does_not_shard_and_kinds_it_does_not_gather_are_left_out_by_name(ti):
    model = ti.modules.convert_model(nn.Sequential(TELinear(8, 8), TEGroupedLinear(2, 8, 8)))
    setup = ti.gather.enable_quantized_gather(model, RECIPES.current())
    assert setup.state is None and not setup.set_up
    reasons = {c.module: c.reason for c in setup.left_out}
    assert reasons["0"] == "not sharded by FSDP2 (call fully_shard first)"
    assert reasons["1"].startswith("GroupedLinear is not gathered quantized by this binding yet")
    assert "left out (not sharded by FSDP2" in str(setup)


def test_the_model_must_be_a_module(ti):
    with pytest.raises(TypeError, match="enable_quantized_gather: model must be a torch.nn.Module"):
        ti.gather.enable_quantized_gather("model", RECIPES.current())
