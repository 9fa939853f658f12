"""The quantized FSDP2 all-gather (docs/decisions.md, D13) on GPUs: the
drop-ins with ``enable_quantized_gather`` against stock TE with bf16
parameters, Float8CurrentScaling, at world size = GPUs present (1 or 2).

One torchrun launch (``_quantized_gather.py``) runs every case; the tests
read its report. Skips without a GPU or TE. Keep the report with
``TE_WM_GATHER_REPORT=path``.
"""

from __future__ import annotations

import pytest
from _launch import two_rank_report

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning",
                                                        "ignore::FutureWarning")]

KINDS = ("Linear", "LayerNormLinear", "LayerNormMLP")
STEPS = 2
#: Per kind, the weights the quantized all-gather is set up for (two layers).
WEIGHTS = {"Linear": ["0.weight", "1.weight"], "LayerNormLinear": ["0.weight", "1.weight"],
           "LayerNormMLP": ["0.fc1_weight", "0.fc2_weight", "1.fc1_weight", "1.fc2_weight"]}
TRAINING = [(k, mb, r, o) for k in KINDS for mb in (1, 4) for r in (True, False) for o in ("adamw", "sgd")]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return two_rank_report("_quantized_gather.py", tmp_path_factory.mktemp("gather"), keep_env="TE_WM_GATHER_REPORT",
                           timeout=600)


def _config(report, kind, microbatches, reshard, optimizer, checkpoint=False) -> dict:
    for c in report["configs"]:
        if (c["kind"], c["microbatches"], c["reshard"], c["optimizer"], c["checkpoint"]) == (
                kind, microbatches, reshard, optimizer, checkpoint):
            return c
    pytest.fail(f"no result for {kind} mb={microbatches} reshard={reshard} {optimizer} checkpoint={checkpoint}; "
                f"errors: " + "\n".join(e["where"] + "\n" + e["traceback"] for e in report["errors"]))


def test_the_worker_ran_every_case(report, capsys):
    with capsys.disabled():
        print(f"\ntest_quantized_gather: world size {report['world_size']}")
    assert not report["errors"], "\n".join(e["where"] + "\n" + e["traceback"] for e in report["errors"])


def test_the_shard_path_gives_te_s_bytes_and_scale(report):
    """The kernels the binding quantizes a shard with (amax, the scale from
    it, the scaled cast) give what TE's Float8CurrentScalingQuantizer gives
    the same whole weight: what every other test here rests on."""
    assert report["bytes"], "no byte case ran"
    wrong = [c for c in report["bytes"] if not (c["data_equal"] and c["scale_inv_equal"])]
    assert not wrong, wrong


def _check_parity(c: dict, kind: str, microbatches: int, reshard: bool) -> None:
    assert c["set_up"] == WEIGHTS[kind], (c["set_up"], c["left_out"])
    assert not c["differences"], c["differences"]
    # Each shard made once per step by the step task; only the first gather's in the all-gather hook.
    assert c["counts"] == {"refreshes": STEPS, "hook_remakes": len(WEIGHTS[kind]),
                           "refreshed_shards": STEPS * len(WEIGHTS[kind])}, c["counts"]
    # Gathered quantized, each weight element is 1 byte instead of bf16's 2, in every all-gather;
    # scales travel as metadata. Gathers per step: forward and backward each microbatch when
    # resharding after forward, forward only otherwise.
    # Bytes are per rank: each rank receives the whole (padded) weight, at any world size.
    gathers = microbatches * (2 if reshard else 1)
    saved = [s - o for s, o in zip(c["bytes"]["stock"], c["bytes"]["ours"])]
    assert saved == [sum(c["weight_numels"]) * gathers] * STEPS, (c["bytes"], c["weight_numels"], gathers)


@pytest.mark.parametrize("kind, microbatches, reshard, optimizer", TRAINING,
                         ids=[f"{k}-mb{m}-reshard{r}-{o}" for k, m, r, o in TRAINING])
def test_bit_exact_with_stock_bf16_parameters(report, kind, microbatches, reshard, optimizer):
    """Every microbatch's output and input gradient, every step's sharded
    gradients and the parameters after each step, bit for bit."""
    _check_parity(_config(report, kind, microbatches, reshard, optimizer), kind, microbatches, reshard)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("reshard", [True, False])
def test_bit_exact_under_activation_recompute(report, kind, reshard):
    """``torch.utils.checkpoint`` around each layer: the recompute forward
    runs after FSDP2's backward gather, whose weight keeps its rowwise data."""
    _check_parity(_config(report, kind, 1, reshard, "adamw", checkpoint=True), kind, 1, reshard)
