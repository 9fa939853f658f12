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
    model = ti.modules.convert_model(nn.Sequential(TELinear(8, 8), TEGroupedLinear(2, 8, 8),
                                                   TEGroupedLinear(2, 8, 8, single_grouped_weight=True)))
    setup = ti.gather.enable_quantized_gather(model, RECIPES.current())
    assert setup.state is None and not setup.set_up
    reasons = {(c.module, c.weight): c.reason for c in setup.left_out}
    assert set(reasons) == {("0", "weight"), ("1", "weight0"), ("1", "weight1"), ("2", "weight")}
    assert reasons["0", "weight"] == "not sharded by FSDP2 (call fully_shard first)"
    assert reasons["1", "weight1"] == "not sharded by FSDP2 (call fully_shard first)"
    assert reasons["2", "weight"].startswith("GroupedLinear(single_grouped_weight=True): one grouped weight is not "
                                             "gathered quantized by this binding yet")
    assert "left out (not sharded by FSDP2" in str(setup)


def test_recipes_without_a_shard_quantizer_here_are_named(ti):
    """The TE layer has shard quantizers for per-tensor current scaling and
    2D blocks; any other recipe whose plan would make the workspace from the
    shard is left out with this binding's reason."""
    gather = ti.gather
    assert gather._shard_format(gather.te.weight_quantizer_of(RECIPES.block()))[0].__class__.__name__ == \
        "BlockScalingShards"
    assert gather._shard_format(gather.te.weight_quantizer_of(RECIPES.current()))[0].__class__.__name__ == \
        "CurrentScalingShards"
    assert gather.te.weight_quantizer_of(RECIPES.delayed()) is None


@pytest.mark.parametrize("rows, world, cut", [(256, 1, False), (200, 1, False), (256, 2, False), (511, 4, False),
                                              (256, 4, True), (200, 2, True), (1536, 8, True)])
def test_block_shards_must_start_on_block_boundaries(ti, rows, world, cut):
    """2D blocks: a weight is set up only where FSDP2's shard boundaries
    (ceil(rows / world) rows a rank) fall on 128-row block boundaries."""
    refusal = ti.gather.BlockScalingShards.refusal((rows, 64), world)
    assert (refusal is not None) == cut, refusal
    if cut:
        assert f"shards of {-(-rows // world)} over {world} ranks, inside its 128-row blocks" in refusal


def test_the_model_must_be_a_module(ti):
    with pytest.raises(TypeError, match="enable_quantized_gather: model must be a torch.nn.Module"):
        ti.gather.enable_quantized_gather("model", RECIPES.current())


def test_the_block_statistic_is_the_scale_grid_with_this_shard_s_rows_and_no_padding(ti, monkeypatch):
    """A shard of rows 256-383 of a 511 x 300 weight fills grid row 2 with
    its block scales; rows it does not hold stay zero, and so do the padding
    columns TE leaves as allocated (here: 7.0), which would otherwise enter
    the all-reduce."""
    import torch

    from workspace_manager.gather import ShardLayout

    gather = ti.gather
    real = gather.te.block_quantize_rows

    def with_dirty_padding(shard, quantizer, kept=None):
        data, scale_inv, kept = real(shard, quantizer, kept)
        scale_inv[:, 3:] = 7.0
        return data, scale_inv, kept

    monkeypatch.setattr(gather.te, "block_quantize_rows", with_dirty_padding)
    shards = gather.BlockScalingShards(gather.te.weight_quantizer_of(RECIPES.block()))
    layout = ShardLayout.of((511, 300), rank=2, world=4)
    shard = torch.randn(layout.rows, 300)
    grid = shards.statistic(shard, layout).reshape(4, 4)
    expected = real(shard, None)[1][:, :3]
    assert torch.equal(grid[2, :3], expected[0]) and bool((grid[2, :3] > 0).all())
    assert not grid[[0, 1, 3]].any() and not grid[:, 3].any()
    data, scale_inv = shards.quantize(shard, grid.reshape(-1), layout)
    assert torch.equal(scale_inv, grid) and data.shape == (layout.rows, 300)
