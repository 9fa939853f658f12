"""The MoE expert stack of ``testbed.experts`` on CPU, without TE: the
token split, the stack's calling convention, the reference block, the
experts' weights read from either parameter layout, and the environment
switch TE's single-parameter layout needs, put back afterwards."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from testbed import experts  # noqa: E402


@pytest.mark.parametrize(("tokens", "n", "expected"), [
    (4096, 8, [512] * 8), (4096, 64, [64] * 64), (10, 4, [3, 3, 2, 2]), (0, 2, [0, 0]),
])
def test_even_splits_cover_every_token_as_evenly_as_possible(tokens, n, expected):
    splits = experts.even_splits(tokens, n)
    assert splits == expected and sum(splits) == tokens and max(splits) - min(splits) <= 1


@pytest.mark.parametrize(("tokens", "n"), [(8, 0), (-1, 2)])
def test_even_splits_refuse_impossible_splits(tokens, n):
    with pytest.raises(ValueError, match="even_splits"):
        experts.even_splits(tokens, n)


class RecordingBlock(torch.nn.Module):
    """A GroupedLinear stand-in: records what it was called with, doubles x."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple] = []

    def forward(self, x, m_splits, is_first_microbatch=None):
        self.calls.append((x.shape[0], list(m_splits), is_first_microbatch))
        return 2 * x


def test_the_stack_gives_every_block_the_even_splits_and_the_microbatch_flag():
    blocks = [RecordingBlock(), RecordingBlock()]
    stack = experts.ExpertStack(4, *blocks)
    out = stack(torch.ones(10, 3), is_first_microbatch=False)
    assert torch.equal(out, torch.full((10, 3), 4.0))
    assert [b.calls for b in blocks] == [[(10, [3, 3, 2, 2], False)]] * 2
    assert list(stack.children()) == blocks  # fully_shard wraps each block


@pytest.mark.parametrize(("mode", "reentrant"), [("reentrant", True), ("non_reentrant", False)])
def test_each_recompute_mode_runs_every_block_under_te_checkpoint_in_its_form(monkeypatch, mode, reentrant):
    seen = []

    def checkpoint(block, x, splits, *, is_first_microbatch=None, use_reentrant=True):
        seen.append(use_reentrant)
        return block(x, splits, is_first_microbatch=is_first_microbatch)

    fake_te = SimpleNamespace(checkpoint=checkpoint)
    monkeypatch.setitem(sys.modules, "transformer_engine", SimpleNamespace(pytorch=fake_te))
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", fake_te)
    blocks = [RecordingBlock(), RecordingBlock()]
    out = experts.ExpertStack(4, *blocks)(torch.ones(10, 3), is_first_microbatch=True, recompute=mode)
    assert torch.equal(out, torch.full((10, 3), 4.0)) and seen == [reentrant, reentrant]
    assert [b.calls for b in blocks] == [[(10, [3, 3, 2, 2], True)]] * 2


def test_an_unknown_recompute_mode_is_refused_by_name():
    with pytest.raises(ValueError, match="recompute must be one of .*got True"):
        experts.ExpertStack(4, RecordingBlock())(torch.ones(4, 3), recompute=True)


class Expert(torch.nn.Linear):
    """A te.Linear stand-in: takes is_first_microbatch and records it."""

    seen: list = []

    def forward(self, x, is_first_microbatch=None):
        type(self).seen.append(is_first_microbatch)
        return super().forward(x)


def test_the_reference_block_runs_each_experts_rows_through_its_own_weight():
    torch.manual_seed(0)
    block = experts.ExpertBlock([Expert(3, 3, bias=False) for _ in range(3)])
    x, splits = torch.randn(7, 3), [3, 0, 4]
    Expert.seen.clear()
    out = block(x, splits, is_first_microbatch=True)
    parts = torch.split(x, splits)
    expected = torch.cat([p @ e.weight.T for p, e in zip(parts, block)])
    assert torch.allclose(out, expected) and Expert.seen == [True] * 3


def test_the_reference_block_is_no_container_that_fully_shard_of_torch_2_11_refuses():
    """torch 2.11's ``fully_shard`` raises on any ``ModuleList`` or
    ``ModuleDict``, even one with a ``forward`` (later versions accept
    that); the GPU machine runs 2.11. The experts stay children 0, 1, ..."""
    block = experts.ExpertBlock([Expert(3, 3, bias=False) for _ in range(2)])
    assert not isinstance(block, (torch.nn.ModuleList, torch.nn.ModuleDict))
    assert [name for name, _ in block.named_children()] == ["0", "1"] and len(block) == 2
    assert [n for n, _ in block.named_parameters()] == ["0.weight", "1.weight"]


def test_expert_weights_reads_one_parameter_per_expert():
    weights = [torch.full((2, 3), float(i)) for i in range(3)]
    block = SimpleNamespace(num_gemms=3, out_features=2, in_features=3, single_grouped_weight=False,
                            **{f"weight{i}": w for i, w in enumerate(weights)})
    assert all(a is b for a, b in zip(experts.expert_weights(block), weights))


def test_expert_weights_views_the_single_grouped_parameter_expert_by_expert():
    data = torch.arange(3 * 2 * 3, dtype=torch.float32)  # the grouped tensor's flat rowwise data
    block = SimpleNamespace(num_gemms=3, out_features=2, in_features=3, single_grouped_weight=True,
                            weight=SimpleNamespace(rowwise_data=data))
    views = experts.expert_weights(block)
    assert [tuple(v.shape) for v in views] == [(2, 3)] * 3
    assert torch.equal(views[1], torch.arange(6, 12, dtype=torch.float32).view(2, 3))
    views[2].zero_()  # views, not copies: a copy into the reference reads the live weights
    assert data[12:].eq(0).all()


@pytest.mark.parametrize("before", [None, "0"])
def test_the_single_parameter_switch_is_set_for_construction_only(monkeypatch, before):
    key = "NVTE_GROUPED_LINEAR_SINGLE_PARAM"
    if before is None:
        monkeypatch.delenv(key, raising=False)
    else:
        monkeypatch.setenv(key, before)
    with experts._single_param_env(True):
        assert os.environ[key] == "1"
    assert os.environ.get(key) == before
    with experts._single_param_env(False):
        assert os.environ.get(key) == before

