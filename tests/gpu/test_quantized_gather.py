"""The quantized FSDP2 all-gather (docs/decisions.md, D13) on GPUs: the
drop-ins with ``enable_quantized_gather`` against stock TE with bf16
parameters, Float8CurrentScaling and Float8BlockScaling (2D weight blocks),
at world size = GPUs present (1 or 2); DelayedScaling, which the policy
makes in the call (D13 says why), against stock as the default plan.

One torchrun launch (``_quantized_gather.py``) runs every case; the tests
read its report. Skips without a GPU or TE, and Float8BlockScaling with
TE's own reason where this GPU lacks it. Keep the report with
``TE_WM_GATHER_REPORT=path``.
"""

from __future__ import annotations

import pytest
from _launch import two_rank_report
from conftest import recipe_skip_reason

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning",
                                                        "ignore::FutureWarning")]

KINDS = ("Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear")
EXACT = ("Float8CurrentScaling", "Float8BlockScaling")
STEPS = 2
#: Per kind, the weights the quantized all-gather is set up for (two layers).
WEIGHTS = {"Linear": ["0.weight", "1.weight"], "LayerNormLinear": ["0.weight", "1.weight"],
           "LayerNormMLP": ["0.fc1_weight", "0.fc2_weight", "1.fc1_weight", "1.fc2_weight"],
           "GroupedLinear": [f"{layer}.experts.weight{e}" for layer in (0, 1) for e in range(4)]}
TRAINING = [(rc, k, mb, r, o) for rc in EXACT for k in KINDS for mb in (1, 4) for r in (True, False)
            for o in ("adamw", "sgd")]
#: TE's FusedAdam, which writes the local tensors' memory below the dispatcher.
TRAINING += [(rc, k, 4, True, "te_fused_adam") for rc in EXACT for k in KINDS]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return two_rank_report("_quantized_gather.py", tmp_path_factory.mktemp("gather"), keep_env="TE_WM_GATHER_REPORT",
                           timeout=900)


def _skip_unsupported(recipe: str) -> None:
    reason = recipe_skip_reason(recipe)
    if reason:
        pytest.skip(f"{recipe}: {reason}")


def _errors(report) -> str:
    return "\n".join(e["where"] + "\n" + e["traceback"] for e in report["errors"])


def _config(report, recipe, kind, microbatches, reshard, optimizer, checkpoint=False) -> dict:
    _skip_unsupported(recipe)
    for c in report["configs"]:
        if (c["recipe"], c["kind"], c["microbatches"], c["reshard"], c["optimizer"], c["checkpoint"]) == (
                recipe, kind, microbatches, reshard, optimizer, checkpoint):
            return c
    pytest.fail(f"no result for {recipe} {kind} mb={microbatches} reshard={reshard} {optimizer} "
                f"checkpoint={checkpoint}; errors: " + _errors(report))


def test_the_worker_ran_every_case(report, capsys):
    with capsys.disabled():
        print(f"\ntest_quantized_gather: world size {report['world_size']}")
    assert not report["errors"], _errors(report)


@pytest.mark.parametrize("recipe", EXACT)
def test_the_shard_path_gives_te_s_bytes_and_scale(report, recipe):
    """The kernels the binding quantizes a shard with give what TE's own
    weight quantizer gives the same whole weight, also when they write over
    what the last refresh kept, and (2D blocks) the columnwise form the
    gathered weight derives is the one TE quantizes: what every other test
    here rests on."""
    _skip_unsupported(recipe)
    cases = [c for c in report["bytes"] if c["recipe"] == recipe]
    assert cases, "no byte case ran: " + _errors(report)
    wrong = [c for c in cases if not all(v for k, v in c.items() if k.endswith("_equal"))]
    assert not wrong, wrong
    # The second round wrote each weight over what the first kept (as every refresh after the first).
    again = [c for c in cases if c["weight"].endswith("(kept)")]
    assert again and all("kept_memory_equal" in c for c in again), cases


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


@pytest.mark.parametrize("recipe, kind, microbatches, reshard, optimizer", TRAINING,
                         ids=[f"{rc}-{k}-mb{m}-reshard{r}-{o}" for rc, k, m, r, o in TRAINING])
def test_bit_exact_with_stock_bf16_parameters(report, recipe, kind, microbatches, reshard, optimizer):
    """Every microbatch's output and input gradient, every step's sharded
    gradients and the parameters after each step, bit for bit."""
    _check_parity(_config(report, recipe, kind, microbatches, reshard, optimizer), kind, microbatches, reshard)


@pytest.mark.parametrize("recipe", EXACT)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("reshard", [True, False])
def test_bit_exact_under_activation_recompute(report, recipe, kind, reshard):
    """``torch.utils.checkpoint`` around each layer: the recompute forward
    runs after FSDP2's backward gather, whose weight keeps its rowwise data."""
    _check_parity(_config(report, recipe, kind, 1, reshard, "adamw", checkpoint=True), kind, 1, reshard)


@pytest.mark.parametrize("kind", KINDS)
def test_delayed_scaling_is_made_in_the_call(report, kind):
    """DelayedScaling: nothing is set up (the plan's reason is named), and
    the dense drop-ins compute what stock computes. (GroupedLinear's drop-in
    requantizes delayed scaling in backward under FSDP2 where stock's keeps
    forward's copy: docs/decisions.md, "GroupedLinear: the dense modules'
    plans, for every expert".)"""
    c = _config(report, "DelayedScaling", kind, 4, True, "adamw")
    assert c["set_up"] == [] and c["left_out"], c
    assert all("float8_delayed_scaling does not quantize a shard" in reason for reason in c["left_out"]), c["left_out"]
    if kind != "GroupedLinear":
        assert not c["differences"], c["differences"]


@pytest.mark.parametrize("recipe", EXACT)
def test_a_checkpoint_of_the_drop_in_loads_into_stock_te(report, recipe):
    """DCP: the drop-in's model and optimizer state dicts, saved after two
    steps, load into stock TE with bf16 parameters; the loaded weights equal
    the drop-in's, and one more step of each gives the same bits."""
    _skip_unsupported(recipe)
    found = [c for c in report["checkpoints"] if c["recipe"] == recipe]
    assert found, "no checkpoint case ran: " + _errors(report)
    (c,) = found
    assert c["set_up"] == WEIGHTS["LayerNormMLP"], c
    assert c["loaded_equal"] and not c["differences"], c
