"""GroupedLinear drop-in on the GPU: numerics and what backward is handed.

One torchrun launch (``_grouped_worker.py``, world size = GPUs present)
trains a two-block expert stack for every case; the tests read its report.
Numerics: bit-exact (equal digests of all losses and final parameters)
against stock ``te.GroupedLinear`` where the plan is stock's (unsharded,
quantized parameters; there against stock with the stale transposes
removed, which equals stock wherever stock reads none: D12), and against the same experts as stock ``te.Linear``
modules under the same FSDP2 setup where the plan quantizes again in
backward (bf16 weights under FSDP2), as the dense modules do there.
Conformance: what each block's autograd ctx holds in the place of its
experts' workspaces after forward, and the cache after the step.
"""

from __future__ import annotations

import re

import pytest
from _launch import two_rank_report

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning",
                                                        "ignore::FutureWarning")]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return two_rank_report("_grouped_worker.py", tmp_path_factory.mktemp("grouped"), keep_env="TE_WM_GROUPED_REPORT")


def _last_line(traceback: str) -> str:
    lines = [line for line in traceback.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def _shared_with_stock(report) -> dict:
    """Cases where stock GroupedLinear and the drop-in raise the same error:
    TE's own failure (nothing to compare there), by case, with the error."""
    by_case: dict = {}
    for error in report["errors"]:
        case, _, variant = error["where"].rpartition(" ")
        by_case.setdefault(case, {})[variant] = _last_line(error["traceback"])
    return {case: got["stock"] for case, got in by_case.items()
            if "stock" in got and got.get("managed") == got["stock"]}


def _cases(report, **match):
    for entry in report["cases"]:
        case = entry["case"]
        if all(case[k] == v for k, v in match.items()) and "stock" in entry and "managed" in entry:
            yield case, entry


def test_every_case_ran(report, capsys):
    """Every case ran in every variant, except where stock and the drop-in
    raise the same error: TE's own failure (listed in the output), such as
    its Block-scaling failure with quantized parameters at world size 1."""
    shared = _shared_with_stock(report)
    errors = [e for e in report["errors"] if e["where"].rpartition(" ")[0] not in shared]
    assert not errors, "\n\n".join(e["where"] + "\n" + e["traceback"][-3000:] for e in errors)
    assert len(list(_cases(report))) >= 48
    # Every recompute mode, te.checkpoint's non-reentrant form too, ran in both variants.
    assert {case["recompute"] for case, _ in _cases(report)} == {None, "reentrant", "non_reentrant"}
    with capsys.disabled():
        print(f"\ngrouped: world size {report['world_size']}, cuBLASLt {report['cublaslt']}, grouped-tensor path "
              f"{report['grouped_tensor_path']}, {len(report['cases'])} cases")
        for case, error in shared.items():
            print(f"stock TE fails too (not compared): {case}: {error[:200]}")


def _same(a: dict, b: dict) -> bool:
    return a["losses"] == b["losses"] and a["params"] == b["params"]


def _stock_plan(case) -> bool:
    """Cases whose plan is stock GroupedLinear's: unsharded, and quantized
    parameters under FSDP2 with resharding (with ``reshard_after_forward=False``
    the plan also frees the gathered parameters' columnwise data after
    backward, see the test below)."""
    return case["sharding"] == "none" or (case["qinit"] and case["sharding"] == "fsdp2_reshard")


def test_bit_exact_against_stock_where_the_plan_is_stock_s(report):
    """Against stock where stock reads nothing stale; with quantized
    parameters, against the reference (stock with its transposes reset after
    each step), which equals stock wherever stock's reads are fresh (D12)."""
    cases = [(c, e) for c, e in _cases(report) if _stock_plan(c)]
    bad = [c for c, e in cases if not _same(e.get("reference", e["stock"]), e["managed"])]
    assert len(cases) >= 24 and not bad, bad


def test_fsdp2_bit_exact_against_the_same_experts_as_te_linear(report):
    checked, bad = 0, []
    for case, entry in _cases(report, qinit=False, single=False):
        if case["sharding"] == "none" or "linears" not in entry:
            continue
        checked += 1
        if not _same(entry["linears"], entry["managed"]):
            bad.append(case)
    assert checked and not bad, bad


@pytest.mark.parametrize("recipe", ["Float8CurrentScaling", "Float8BlockScaling"])
def test_fsdp2_exact_requantization_also_equals_stock(report, recipe):
    """Formats that quantize again exactly give stock GroupedLinear's bits
    although nothing was saved (docs/decisions.md, "GroupedLinear: the dense
    modules' plans, for every expert")."""
    cases = [(c, e) for c, e in _cases(report, recipe=recipe, qinit=False) if c["sharding"] != "none"]
    bad = [c for c, e in cases if not _same(e["stock"], e["managed"])]
    assert cases and not bad, bad


def _kinds(got: dict) -> dict:
    """The saved tensors by what they are: ``hp`` (a high-precision weight,
    the registered parameter or FSDP2's unsharded copy), ``qparam`` (a
    quantized parameter, as registered or gathered), ``col``/``row`` (a fresh
    workspace's data), ``cached`` (a cache entry)."""
    names = {"hp": "hp", "param": "hp", "col": "col", "row": "row", "cached": "cached", "qparam": "qparam",
             "quantized": "qparam"}
    merged: dict = {}
    for kind, count in got.items():
        if kind in names:
            merged[names[kind]] = merged.get(names[kind], 0) + count
    return merged


def _expected_slots(case, plan: str) -> dict:
    """What the plan says backward is handed, per block of 4 experts."""
    backward = re.search(r"backward=(\w+)", plan).group(1)
    if backward == "requantize":
        return {"hp": 4}
    if backward == "saved_parameter":
        return {"qparam": 4}
    return {"cached": 4} if case["microbatches"] else {"col": 4}


def test_what_backward_is_handed_matches_the_plan(report):
    bad, checked = [], 0
    for case, entry in _cases(report, single=False, recompute=None):
        want = _expected_slots(case, entry["managed"]["plan"])
        assert len(entry["managed"]["saved"]) == 2, case
        for block, got in enumerate(entry["managed"]["saved"]):
            checked += 1
            if _kinds(got) != want:
                bad.append((case, block, got, want))
    assert checked >= 48 and not bad, "\n".join(map(str, bad))


def test_stock_saves_both_usages_where_the_drop_in_saves_less(report):
    """The contrast the drop-in's savings are measured against."""
    seen = 0
    for case, entry in _cases(report, single=False, recompute=None, qinit=False, microbatches=False):
        seen += 1
        for got in entry["stock"]["saved"]:
            assert got.get("row") == 4 and got.get("col") == 4, (case, got)
    assert seen


def test_fsdp2_leaves_no_cache_after_the_step(report):
    cases = [(c, e) for c, e in _cases(report, microbatches=True) if c["sharding"] != "none"]
    bad = [c for c, e in cases if e["managed"]["cache"]]
    assert cases and not bad, bad


def test_unsharded_microbatches_cache_every_expert_as_stock(report):
    cases = list(_cases(report, microbatches=True, sharding="none", qinit=False, single=False))
    assert cases
    for case, entry in cases:
        assert entry["managed"]["cache"] == entry["stock"]["cache"], case
        assert len(entry["managed"]["cache"]) == 8, case


def _entry(report, **match):
    found = [e for _, e in _cases(report, **match)]
    return found[0] if found else None


def test_fsdp2_keep_quantized_params_train_as_with_resharding_where_stock_reads_a_stale_transpose(report):
    """With ``reshard_after_forward=False`` FSDP2 keeps the gathered
    quantized parameters, and stock GroupedLinear keeps the transpose its
    backward derived on them: after an optimizer step the next backward
    reads that stale copy (the worker finds it saved for backward, unequal
    to the new data's transpose). The drop-in frees it after backward
    (``Release.DERIVED_COLUMNWISE``), so its training equals the resharding
    run's, which gathers afresh."""
    checked = 0
    for recipe in ("DelayedScaling", "Float8CurrentScaling"):
        for mb in (False, True):
            keep = _entry(report, recipe=recipe, sharding="fsdp2_keep", qinit=True, microbatches=mb, recompute=None,
                          single=False)
            reshard = _entry(report, recipe=recipe, sharding="fsdp2_reshard", qinit=True, microbatches=mb,
                             recompute=None, single=False)
            if keep is None or reshard is None:
                continue
            checked += 1
            assert _same(keep["managed"], reshard["managed"]), (recipe, mb)
            assert not any(got.get("stale_columnwise") for got in keep["managed"]["saved"]), (recipe, mb)
            assert any(got.get("stale_columnwise") for got in keep["stock"]["saved"]), (recipe, mb, keep["stock"])
    assert checked == 4
