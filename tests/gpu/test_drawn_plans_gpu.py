"""Drawn plans on one GPU, bounded: Hypothesis draws a setting and, per
context, a meaningful plan (``workspace_manager.testing.plans``), pinned
through :class:`DrawnPlanPolicy`. Each run either conforms to its plans
(``_conformance``) and, for Float8CurrentScaling and Float8BlockScaling
(which requantize exactly, so every valid plan gives stock's numbers), is
bit-exact against a stock twin; or is refused at the module call with a
PolicyMismatchError naming a plan field and the context. DelayedScaling is
checked for conformance only: its scale moves after every forward, so a
plan that quantizes at another time than stock (a backward rebuild, a
cache read) gives other bytes. The CPU test ``tests/unit/test_drawn_plans.py``
covers the plan space widely; this one runs 25 derandomized examples.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, given, note, reject, settings
from hypothesis import strategies as st

from conftest import recipe_skip_reason

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning",
                                                        "ignore::FutureWarning")]

RECIPES_SM90 = ["Float8CurrentScaling", "Float8BlockScaling", "DelayedScaling"]
PLAN_FIELDS = ("cache", "forward_usage", "backward_source", "backward_usage", "columnwise_source", "release",
               "parameter_keeps")


def _draw_case(data):
    from _conformance_run import Case

    recipes = [r for r in RECIPES_SM90 if recipe_skip_reason(r) is None]
    if not recipes:
        pytest.skip("no sm_90 FP8 recipe is supported here")
    recipe = data.draw(st.sampled_from(recipes), label="recipe")
    kind = data.draw(st.sampled_from(["Linear", "LayerNormLinear", "LayerNormMLP"]), label="module")
    modes = ["none", "reentrant", "non_reentrant"] + (["own"] if kind == "LayerNormMLP" else [])
    recompute = data.draw(st.sampled_from(modes), label="recompute")
    overrides = [None] if recipe == "DelayedScaling" or kind == "LayerNormMLP" else [None, "high_precision",
                                                                                     "dequantized"]
    return Case(
        recipe, kind, data.draw(st.booleans(), label="quantized_init"),
        data.draw(st.sampled_from([(None,), (True, False, False)]), label="microbatches"), recompute,
        data.draw(st.sampled_from(overrides), label="backward_override"),
        True if recompute != "none" or kind != "Linear" else data.draw(st.booleans(), label="input_grad"),
        data.draw(st.booleans(), label="no_grad") if recompute == "none" else False,
    )


@settings(max_examples=25, derandomize=True, deadline=None, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_drawn_plans_conform_and_match_stock_or_are_refused(data):
    from _conformance_run import StockTEFails, run_case

    from workspace_manager import PolicyMismatchError
    from workspace_manager.testing.plans import DrawnPlanPolicy, PickedPlans

    case = _draw_case(data)
    # Picks drawn up front: a recompute pass is planned in backward, which
    # autograd runs on another thread on a GPU, where Hypothesis cannot draw.
    chooser = PickedPlans(data.draw(st.lists(st.integers(0, 2**16), min_size=16, max_size=16), label="plan picks"))
    policy = DrawnPlanPolicy(chooser=chooser)
    try:
        problems = run_case(case, policy, numerics=case.recipe != "DelayedScaling")
    except StockTEFails as err:
        note(str(err))
        reject()  # stock TE cannot run this setting: nothing to match
    except PolicyMismatchError as err:
        text = str(err)
        assert any(name in text for name in PLAN_FIELDS), f"the refusal names no plan field: {text}"
        assert "context" in text.lower(), f"the refusal names no context: {text}"
        return
    finally:
        note(f"plans chosen:\n{chooser.describe()}")
    assert not problems, "\n".join(problems)
