"""Conformance on one GPU: the real tensors of every managed call match
its plans (``tests/gpu/_conformance.py`` says what is read and why it is
sound), and every output, input gradient, parameter gradient and updated
parameter equals a stock twin's (torch.equal), over two optimizer steps.

One test item per recipe (sm_90's three), module and weight kind runs a
fixed list of settings in one process, chosen so that every value of each
dimension appears and every pair that matters meets (microbatch position x
recompute mode, backward_override x microbatches, input grad x
microbatches); the full product would be about ten times as long. FSDP2's
reshard and keep modes run in ``test_conformance_fsdp2.py``.

Run: ``pytest -m gpu tests/gpu/test_conformance.py`` (2 to 2.5 minutes per recipe on one H200,
measured with the three recipes in parallel processes, ``-k <recipe>`` each).
"""

from __future__ import annotations

import pytest

from conftest import recipe_skip_reason

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning",
                                                        "ignore::FutureWarning")]

RECIPES_SM90 = ["Float8CurrentScaling", "Float8BlockScaling", "DelayedScaling"]
MODULES = ["Linear", "LayerNormLinear", "LayerNormMLP"]
MB = (True, False, False)
#: (microbatches, recompute, override, input_grad, no_grad)
SETTINGS = (
    ((None,), "none", None, True, False),
    (MB, "none", None, False, False),
    ((None,), "reentrant", None, True, False),
    (MB, "reentrant", None, True, False),
    ((None,), "non_reentrant", None, True, False),
    (MB, "non_reentrant", None, True, False),
    ((None,), "own", None, True, False),
    (MB, "own", None, True, False),
    ((None,), "none", "high_precision", True, False),
    (MB, "none", "dequantized", True, False),
    ((None,), "none", "dequantized", False, False),
    (MB, "none", "high_precision", False, False),
    # Recompute with an override (the drawn-plan test's first finding of round 5).
    ((None,), "non_reentrant", "high_precision", True, False),
    ((None,), "reentrant", "high_precision", True, False),
    (MB, "none", None, True, True),
)


def cases(recipe: str, kind: str, quantized_init: bool):
    from _conformance_run import Case

    for microbatches, recompute, override, input_grad, no_grad in SETTINGS:
        if recompute == "own" and kind != "LayerNormMLP":
            continue  # checkpoint=True is a LayerNormMLP option
        if override is not None and (recipe == "DelayedScaling" or kind == "LayerNormMLP"):
            continue  # TE 2.20: delayed scaling and LayerNormMLP take no backward_override
        if not input_grad and kind != "Linear":
            continue  # LayerNormLinear/LayerNormMLP always compute dgrad (for the norm)
        yield Case(recipe, kind, quantized_init, microbatches, recompute, override, input_grad, no_grad)


@pytest.mark.parametrize("quantized_init", [False, True], ids=["bf16_params", "quantized_init"])
@pytest.mark.parametrize("kind", MODULES)
@pytest.mark.parametrize("recipe_name", RECIPES_SM90)
def test_every_call_matches_its_plan_and_stock(recipe_name, kind, quantized_init):
    from _conformance_run import StockTEFails, report_stock_failures, run_case

    reason = recipe_skip_reason(recipe_name)
    if reason:
        pytest.skip(reason)
    problems, stock_fails, ran = [], [], 0
    for case in cases(recipe_name, kind, quantized_init):
        try:
            problems += run_case(case)
            ran += 1
        except StockTEFails as err:
            stock_fails.append(str(err))  # TE's own failure: listed, not ours
        except Exception as err:  # noqa: BLE001  (one failing setting must not hide the others)
            problems.append(f"{case.label}: raised {type(err).__name__}: {err}")
    report_stock_failures(stock_fails)  # in pytest's warnings summary, which a passing test's print is not
    assert not problems, "\n".join(problems)
    if not ran:
        pytest.skip("stock TE fails every setting: " + "; ".join(stock_fails))


def test_layernorm_mlp_whose_fc1_and_fc2_save_differently_conforms():
    """FC1's weight under delayed scaling, FC2's under current scaling, with
    LeanWorkspacePolicy pinned: FC1's workspace is saved (requantizing it is
    not exact), FC2 is quantized again in backward. TE 2.20.2 has one switch
    for both; the binding carries out each plan (docs/te-integration.md,
    "Plans TE cannot carry out"), checked call by call and bit for bit."""
    import te_integration as ti
    from _conformance_run import MIXED_FC1_DELAYED, Case, run_case

    from workspace_manager import BackwardSource, LeanWorkspacePolicy

    reason = recipe_skip_reason("Float8CurrentScaling") or recipe_skip_reason("DelayedScaling")
    if reason:
        pytest.skip(reason)
    managed = []
    case = Case(MIXED_FC1_DELAYED, "LayerNormMLP", False, microbatches=(None,))
    problems = run_case(case, LeanWorkspacePolicy(),
                        prepare=lambda m: managed.append(m) if isinstance(m, ti.LayerNormMLP) else None)
    assert not problems, "\n".join(problems)
    sources = {key: plan.backward_source for key, (_, plan) in ti.last_plans(managed[0]).items()}
    assert sources == {"fc1_weight": BackwardSource.SAVED_WORKSPACE, "fc2_weight": BackwardSource.REQUANTIZE}
