"""No weight copy outlives its source, on the GPU (docs/decisions.md, D12).

One torchrun launch (``_freshness_worker.py``, world size = GPUs present)
trains every module kind with quantized parameters under each sm_90
recipe, optimizer and sharding, as stock TE, as the reference (stock with
TE's own ``_reset_caches()`` after each step, and FSDP2's gathered
transposes cleared) and as the drop-in; and moves or releases models with
cached workspaces. The parity rule: the drop-in equals the reference bit
for bit everywhere; stock equals the reference where it reads nothing stale.
"""

from __future__ import annotations

import pytest
from _launch import two_rank_report

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning",
                                                        "ignore::FutureWarning")]

#: Bytes a moved or released model may keep over the same model trained
#: without a cache: none of a workspace (the smallest is 128 x 128 FP8, 16 KiB).
SLACK = 4096


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return two_rank_report("_freshness_worker.py", tmp_path_factory.mktemp("fresh"), keep_env="TE_WM_FRESH_REPORT",
                           timeout=1500)


def _last_line(traceback: str) -> str:
    lines = [line for line in traceback.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def _te_failures(report) -> dict:
    """Cases where every variant, stock included, raised the same error:
    TE's own failure (e.g. Block scaling with quantized parameters under
    FSDP2 at world size 1), with the error."""
    by_case: dict = {}
    for error in report["errors"]:
        case, _, variant = error["where"].rpartition(" ")
        by_case.setdefault(case, {})[variant] = _last_line(error["traceback"])
    return {case: got["stock"] for case, got in by_case.items()
            if set(got) == {"stock", "reference", "managed"} and len(set(got.values())) == 1}


def _compared(report):
    return [entry for entry in report["cases"] if "managed_equals_reference" in entry]


def test_every_case_ran(report, capsys):
    te_own = _te_failures(report)
    errors = [e for e in report["errors"] if e["where"].rpartition(" ")[0] not in te_own]
    assert not errors, "\n\n".join(e["where"] + "\n" + e["traceback"][-3000:] for e in errors)
    ran = _compared(report)
    assert len(ran) + len(te_own) == len(report["cases"])
    assert {e["case"]["kind"] for e in ran} == {"Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear", "ops"}
    with capsys.disabled():
        print(f"\nfreshness: world size {report['world_size']}, {len(ran)} cases compared; "
              f"unsupported here: {report['unsupported']}")
        for case, error in te_own.items():
            print(f"stock TE fails too (not compared): {case}: {error[:160]}")


def test_the_drop_in_equals_the_reference_bit_for_bit_in_every_case(report):
    differing = [e["case"] for e in _compared(report) if not e["managed_equals_reference"]]
    assert not differing, differing


def test_the_drop_in_reads_no_stale_copy_and_holds_none_between_steps(report):
    for entry in _compared(report):
        assert entry["stale_reads"]["managed"] == 0, entry["case"]
        assert not any(entry["stale_found"]["managed"]), entry["case"]


def test_stocks_stale_reads_are_found_by_the_watch_and_the_detector(report, capsys):
    """Where stock leaves the reference, the GEMM watch counted its stale
    reads and the detector found its stale copies; the list is printed (the
    parity tests' exceptions: there the drop-in equals the reference, not stock)."""
    stale = [e for e in _compared(report) if not e["stock_equals_reference"]]
    # TE's FP8-parameter flow: FusedAdam with DelayedScaling, unsharded, in every kind.
    expected = {(kind, "DelayedScaling", "FusedAdam", "none")
                for kind in ("Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear", "ops")}
    found = {(e["case"]["kind"], e["case"]["recipe"], e["case"]["optimizer"], e["case"]["sharding"]) for e in stale}
    assert expected <= found, expected - found
    for entry in stale:
        assert entry["stale_reads"]["stock"] > 0, entry["case"]
        assert any(entry["stale_found"]["stock"]), entry["case"]
    for entry in _compared(report):
        assert entry["stale_reads"]["reference"] == 0, entry["case"]  # the reference removes the fault
    with capsys.disabled():
        print("\nstock reads stale copies (drop-in = reference, not stock):")
        for entry in stale:
            case = entry["case"]
            print(f"  {case['kind']:16} {case['recipe']:21} {case['optimizer']:9} {case['sharding']:14} "
                  f"input-grad error {entry['stock_dx_error']:.4f}, stale reads {entry['stale_reads']['stock']}, "
                  f"final loss stock {entry['losses']['stock'][-1]:.6f} reference {entry['losses']['reference'][-1]:.6f}")


def _leftover(entry: dict, variant: str, how: str) -> int:
    got = entry[variant]
    return got[f"{how}_cached"]["residue"] - got[f"{how}_uncached"]["residue"]


def test_a_moved_or_released_drop_in_keeps_no_workspace_on_the_gpu(report, capsys):
    assert {m["kind"] for m in report["moves"]} == {"Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear"}
    for entry in report["moves"]:
        param_bytes = entry["managed"]["moved_cached"]["param_bytes"]
        # Stock leaves its FP8 cache on the GPU after .cpu(): at least one byte per parameter.
        assert _leftover(entry, "stock", "moved") >= param_bytes // 2, entry
        assert _leftover(entry, "managed", "moved") <= SLACK, entry
        for variant in ("stock", "managed"):  # release_workspaces frees stock modules' caches too
            assert entry[variant]["released_cached"]["released"] >= param_bytes // 2, entry
            assert _leftover(entry, variant, "released") <= SLACK, entry
        with capsys.disabled():
            print(f"\n{entry['kind']}: after .cpu() stock keeps {_leftover(entry, 'stock', 'moved')} B of "
                  f"workspaces on the GPU, the drop-in {_leftover(entry, 'managed', 'moved')} B; "
                  f"release_workspaces freed {entry['managed']['released_cached']['released']} B")
