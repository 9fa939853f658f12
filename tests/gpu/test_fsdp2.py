"""FSDP2 on one or two GPUs: the drop-in TransformerLayer stack against stock TE.

One torchrun launch (``_fsdp2_stack.py``, at world size = GPUs present, 1 or
2) measures every configuration; the tests below read its report. Skips
without a GPU.
"""

from __future__ import annotations

import pytest
from _launch import TE_WORLD1_BLOCK_QINIT, skip_known_te_failure, two_rank_report

# TE and torch.distributed warn freely (deprecations, experimental features); the
# GPU tier checks numbers, not their warnings.
pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning",
                                                        "ignore::FutureWarning")]

RECIPES = ["DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling"]
FWD_KIB_PER_LAYER = 50
BWD_KIB = 256


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return two_rank_report("_fsdp2_stack.py", tmp_path_factory.mktemp("fsdp2"), keep_env="TE_WM_FSDP2_REPORT")


def _config(report, recipe, qinit):
    for c in report["configs"]:
        if c["recipe"] == recipe and c["quantized_init"] == qinit:
            return c
    skip_known_te_failure(report, recipe, qinit)
    pytest.fail(f"no result for {recipe} quantized_init={qinit}; errors: {report['errors']}")


def test_world_size_is_reported(report, capsys):
    assert report["world_size"] in (1, 2), report["world_size"]
    with capsys.disabled():
        print(f"\ntest_fsdp2 (memory, microbatch, recompute, attribution): world size {report['world_size']}")


def test_worker_ran_every_configuration(report):
    errors = [e for e in report["errors"] if TE_WORLD1_BLOCK_QINIT not in e["traceback"] or report["world_size"] != 1]
    assert not errors, "\n".join(e["where"] + "\n" + e["traceback"] for e in errors)


@pytest.mark.parametrize("qinit", [False, True], ids=["bf16_params", "quantized_init"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_losses_identical_to_stock(report, recipe, qinit):
    c = _config(report, recipe, qinit)
    assert c["managed"]["losses"] == c["stock"]["losses"]


@pytest.mark.parametrize("qinit", [False, True], ids=["bf16_params", "quantized_init"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_forward_increment_within_50_kib_of_bf16(report, recipe, qinit):
    base = _config(report, "bf16", False)["stock"]["fwd_kib_per_layer"]
    got = _config(report, recipe, qinit)["managed"]["fwd_kib_per_layer"]
    assert got - base <= FWD_KIB_PER_LAYER, f"{got:.1f} KiB/layer vs bf16 {base:.1f}"


@pytest.mark.parametrize("qinit", [False, True], ids=["bf16_params", "quantized_init"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_backward_retained_within_256_kib_of_bf16(report, recipe, qinit):
    """Retention measured as allocated after backward minus before forward.

    TE's own measure (after backward minus after forward) shows +0.49 MiB for
    the per-tensor recipes even in stock TE: the FP8 stack saves 62 KiB per
    layer less in forward (FP8 activations), so backward frees that much less.
    The allocation-site diff in the report's ``evidence`` shows the blocks
    left after backward are the same as bf16's (FSDP2's reduce-scattered
    gradients). That measure is reported as ``bwd_mib`` but not asserted on.
    """
    base = _config(report, "bf16", False)["stock"]["kept_after_bwd_mib"]
    got = _config(report, recipe, qinit)["managed"]["kept_after_bwd_mib"]
    assert (got - base) * 1024 <= BWD_KIB, f"{got:.3f} MiB vs bf16 {base:.3f} MiB"


def test_backward_blocks_left_are_the_same_as_bf16(report):
    """The evidence run: what backward leaves allocated, by allocation site,
    is the same for the FP8 stacks (stock and drop-in) as for bf16."""
    by = {(e["recipe"], e["managed"]): e for e in report["evidence"]}
    base = by[("bf16", False)]
    for key in [("Float8CurrentScaling", False), ("Float8CurrentScaling", True)]:
        assert abs(by[key]["retained_mib"] - base["retained_mib"]) * 1024 <= BWD_KIB, by[key]["retained"]


@pytest.mark.parametrize("qinit", [False, True], ids=["bf16_params", "quantized_init"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_memory_no_more_than_stock(report, recipe, qinit):
    c = _config(report, recipe, qinit)
    for key in ("peak_mib", "after_step_mib"):
        assert c["managed"][key] <= c["stock"][key], (key, c["managed"][key], c["stock"][key])


def _microbatch_run(report, recipe):
    runs = [r for r in report["microbatches"] if r["recipe"] == recipe]
    assert runs, report["errors"]
    return runs[0]


@pytest.mark.parametrize("recipe", RECIPES)
def test_microbatches_quantize_as_stock_does_by_default(report, recipe):
    """The microbatch cache is an option, off by default (docs/decisions.md,
    D4): the drop-ins quantize every weight on every microbatch, as stock TE
    does under FSDP2, and keep no cache."""
    r = _microbatch_run(report, recipe)
    assert r["managed"]["losses"] == r["stock"]["losses"]
    assert r["managed"]["quantizations_per_step"] == r["stock"]["quantizations_per_step"]
    assert r["managed"]["cached_workspaces_after_step"] == [0, 0, 0]
    assert r["managed"]["after_step_mib"] <= r["stock"]["after_step_mib"]


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_microbatch_cache_option_reuses_workspaces_and_frees_them_after_the_step(report, recipe):
    """``fsdp2_microbatch_cache`` pinned: one quantization per weight a step
    for formats that requantize exactly, losses identical, nothing cached
    after the step."""
    r = _microbatch_run(report, recipe)
    assert r["managed_cache"]["losses"] == r["stock"]["losses"]
    pairs = list(zip(r["managed_cache"]["quantizations_per_step"], r["stock"]["quantizations_per_step"]))
    if recipe == "DelayedScaling":
        # Not requantization-safe: the option declines to cache (docs/decisions.md D4).
        assert all(m == s for m, s in pairs), pairs
    else:
        assert all(m < s for m, s in pairs), pairs
    assert r["managed_cache"]["cached_workspaces_after_step"] == [0, 0, 0]
    assert r["managed_cache"]["after_step_mib"] <= r["stock"]["after_step_mib"]


# -- workspace attribution (issue 6) -------------------------------------------------------
ATTRIBUTION_KIB_PER_LAYER = 64


def _attribution(report, recipe, qinit, micro=1, policy=None):
    for a in report["attribution"]:
        if (a["recipe"], a["quantized_init"], a["microbatches"], a.get("policy")) == (recipe, qinit, micro, policy):
            return a
    skip_known_te_failure(report, recipe, qinit)
    pytest.fail(f"no attribution run for {recipe} qinit={qinit} microbatches={micro} policy={policy}; "
                f"errors: {report['errors']}")


#: The recipes the microbatch cache option caches (they requantize exactly).
CACHING = ["Float8CurrentScaling", "Float8BlockScaling"]
CACHE_OPTION = "fsdp2_microbatch_cache"
ATTRIBUTION_CASES = ([(r, q, 1, None) for r in RECIPES for q in (False, True)] + [(r, False, 4, None) for r in RECIPES]
                     + [(r, False, 4, CACHE_OPTION) for r in CACHING])
ATTRIBUTION_IDS = [f"{r}-{'qinit' if q else 'bf16'}-{m}mb" + (f"-{p}" if p else "") for r, q, m, p in ATTRIBUTION_CASES]


@pytest.mark.parametrize("recipe, qinit, micro, policy", ATTRIBUTION_CASES, ids=ATTRIBUTION_IDS)
def test_report_after_a_step_lists_no_leftover_workspace(report, recipe, qinit, micro, policy):
    run = _attribution(report, recipe, qinit, micro, policy)["managed"]
    assert run["leftovers_per_step"] == [[], [], []], run["after_step_table"]
    assert len(run["timeline"]) > 8 * 4, "the recording saw too few boundaries"


@pytest.mark.parametrize("recipe, qinit, micro, policy", ATTRIBUTION_CASES, ids=ATTRIBUTION_IDS)
def test_reported_bytes_agree_with_allocated_memory(report, recipe, qinit, micro, policy):
    """At every forward/backward boundary of the recorded step, the
    difference in live workspace bytes between stock and drop-in equals the
    difference in ``torch.cuda.memory_allocated`` (each over what was
    allocated before its model was built), within 64 KiB per layer."""
    from testbed.attribution import disagreement

    run = _attribution(report, recipe, qinit, micro, policy)
    stock, managed = run["stock"], run["managed"]
    assert [p["label"] for p in stock["timeline"]] == [p["label"] for p in managed["timeline"]]
    assert all(p["allocated_bytes"] is not None for p in stock["timeline"] + managed["timeline"])
    worst = disagreement(run)
    assert worst <= ATTRIBUTION_KIB_PER_LAYER * 1024 * 8, f"worst disagreement {worst / 1024:.1f} KiB"


@pytest.mark.parametrize("recipe", CACHING)
def test_microbatch_cache_option_is_attributed_and_gone_after_the_step(report, recipe):
    """The cache the drop-in keeps for the step's microbatches, with the
    microbatch cache option pinned, shows in the timeline as cached
    workspace bytes, and is gone after the step."""
    run = _attribution(report, recipe, False, 4, CACHE_OPTION)["managed"]
    assert max(p["total_bytes"] for p in run["timeline"]) > 0
    assert run["after_step"]["by_kind"].get("cached", 0) == 0, run["after_step_table"]


@pytest.mark.parametrize("recipe", RECIPES)
def test_microbatches_keep_no_workspace_in_the_step_by_default(report, recipe):
    """Without the option, the drop-in holds no workspace of a high-precision
    weight at any boundary of a microbatched step, as stock TE does (at
    c06af9d, DelayedScaling, which the option never caches, showed 0 MiB)."""
    run = _attribution(report, recipe, False, 4)["managed"]
    assert max(p["total_bytes"] for p in run["timeline"]) == 0, run["after_step_table"]


@pytest.mark.parametrize("policy", [None, "fsdp2_recompute_build_once"], ids=["defaults", "build_once"])
@pytest.mark.parametrize("mode", ["nonreentrant", "reentrant"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_recompute_gradients_identical_to_stock(report, recipe, mode, policy):
    """te.checkpoint around every layer under FSDP2: every gradient shard is
    bit-identical to stock's at every step, and so are the losses, with the
    drop-ins' defaults (the recompute pass leaves dgrad's copy to TE's
    backward rebuild, as TE does) and with the option that builds it once
    and saves it (decisions.md, D3): for DelayedScaling the option still
    leaves it to the rebuild, for the others the saved copy equals the
    rebuild bit for bit. Both passed on 2x H200 at c06af9d, when building
    once was the default (benchmarks/results/gpu_tests/two_gpus/)."""
    runs = [r for r in report["recompute"]
            if r["recipe"] == recipe and r["mode"] == mode and r.get("policy") == policy]
    assert runs, report["errors"]
    run = runs[0]
    assert run["managed"]["losses"] == run["stock"]["losses"]
    assert run["grads_missing"] == 0, "a parameter got no gradient: the comparison would be vacuous"
    assert run["grads_differing"] == [0] * len(run["grads_differing"]), f"of {run['grads']} shards per step"
