"""Bad input gets a ValueError/TypeError subclass that says what arrived and what is allowed."""

from __future__ import annotations

import pytest

from workspace_manager import (
    BackwardOverride,
    BackwardSource,
    CacheAction,
    ColumnwiseSource,
    ContextTypeError,
    FSDP2WorkspacePolicy,
    InvalidContextError,
    InvalidPlanError,
    Microbatch,
    PolicyMismatchError,
    QuantizerCapabilities,
    RecomputePass,
    RecomputeWorkspacePolicy,
    Release,
    Sharding,
    Usage,
    WorkspaceContext,
    WorkspacePlan,
    WorkspacePolicy,
    resolve_policy,
)
from workspace_manager._profiles import MXFP8
from workspace_manager.testing.plans import DrawnPlanPolicy

CAPS = MXFP8


def test_wrong_enum_type_names_field_value_and_allowed_members():
    with pytest.raises(ContextTypeError) as info:
        WorkspaceContext(capabilities=CAPS, sharding="fsdp2")
    msg = str(info.value)
    assert "WorkspaceContext.sharding" in msg and "'fsdp2'" in msg and "Sharding.FSDP2_RESHARD" in msg
    assert isinstance(info.value, TypeError)


@pytest.mark.parametrize("value", [1, 0, None, "yes"])
def test_booleans_are_checked_exactly(value):
    with pytest.raises(ContextTypeError, match="grad_enabled must be a bool"):
        WorkspaceContext(capabilities=CAPS, grad_enabled=value)


def test_capabilities_must_be_capabilities():
    with pytest.raises(ContextTypeError, match="capabilities must be a QuantizerCapabilities"):
        WorkspaceContext(capabilities="mxfp8")


def test_capabilities_validate_their_fields():
    with pytest.raises(ContextTypeError, match="columnwise_derivable must be a bool"):
        QuantizerCapabilities(name="x", columnwise_derivable="yes", derived_caches=False, requantization_safe=True)
    with pytest.raises(InvalidContextError, match="non-empty"):
        QuantizerCapabilities(name=" ", columnwise_derivable=True, derived_caches=False, requantization_safe=True)


def test_recompute_pass_without_grad_is_invalid():
    with pytest.raises(InvalidContextError, match="requires grad_enabled=True") as info:
        WorkspaceContext(capabilities=CAPS, recompute=RecomputePass.RECOMPUTE, grad_enabled=False)
    assert isinstance(info.value, ValueError)


def test_te_adapters():
    assert Microbatch.from_is_first_microbatch(None) is Microbatch.NONE
    assert Microbatch.from_is_first_microbatch(True) is Microbatch.FIRST
    assert Microbatch.from_is_first_microbatch(False) is Microbatch.LATER
    with pytest.raises(ContextTypeError, match="is_first_microbatch must be None, True or False"):
        Microbatch.from_is_first_microbatch(1)
    assert BackwardOverride.from_te(None) is BackwardOverride.NONE
    assert BackwardOverride.from_te("dequantized") is BackwardOverride.DEQUANTIZED
    with pytest.raises(InvalidContextError, match="'high_precision', 'dequantized'"):
        BackwardOverride.from_te("fp32")


def test_fsdp2_policy_on_an_unsharded_weight_says_what_to_do():
    with pytest.raises(PolicyMismatchError) as info:
        FSDP2WorkspacePolicy().plan(WorkspaceContext(capabilities=CAPS))
    msg = str(info.value)
    assert "FSDP2WorkspacePolicy" in msg and "Sharding.NONE" in msg and "fully_shard" in msg


@pytest.mark.parametrize(
    "sharding, expected",
    [
        (Sharding.FSDP2_RESHARD, "Pin FSDP2WorkspacePolicy()"),
        (Sharding.FSDP2_KEEP, "Pin FSDP2WorkspacePolicy()"),
        (Sharding.DISTRIBUTED_WEIGHT, "Pin DistributedWeightWorkspacePolicy()"),
    ],
)
def test_a_policy_on_a_sharded_weight_names_the_policy_for_that_sharding(sharding, expected):
    ctx = WorkspaceContext(capabilities=CAPS, sharding=sharding)
    with pytest.raises(PolicyMismatchError) as info:
        WorkspacePolicy().plan(ctx)
    assert expected in str(info.value)


def test_plain_policy_refuses_recompute_and_names_the_wrapper():
    ctx = WorkspaceContext(capabilities=CAPS, recompute=RecomputePass.FIRST)
    with pytest.raises(PolicyMismatchError, match=r"RecomputeWorkspacePolicy\(inner=WorkspacePolicy\(\)\)"):
        WorkspacePolicy().plan(ctx)


def test_plan_rejects_a_non_context():
    with pytest.raises(ContextTypeError, match="expects a WorkspaceContext; received dict"):
        WorkspacePolicy().plan({})


def test_recompute_wrapper_needs_a_plain_inner_policy():
    with pytest.raises(ContextTypeError, match="inner must be a non-recompute policy"):
        RecomputeWorkspacePolicy(inner=RecomputeWorkspacePolicy())
    with pytest.raises(ContextTypeError):
        RecomputeWorkspacePolicy(inner="fsdp2")
    with pytest.raises(ContextTypeError, match="inner must be a non-recompute policy"):  # plans passes itself
        RecomputeWorkspacePolicy(inner=DrawnPlanPolicy(chooser=lambda ctx, plans: plans[0]))


def test_resolve_policy_wraps_a_pinned_policy_for_recompute_and_rejects_non_policies():
    ctx = WorkspaceContext(capabilities=CAPS, sharding=Sharding.FSDP2_RESHARD, recompute=RecomputePass.RECOMPUTE)
    assert resolve_policy(ctx, FSDP2WorkspacePolicy()) == RecomputeWorkspacePolicy(inner=FSDP2WorkspacePolicy())
    with pytest.raises(ContextTypeError, match="pinned policy must be a Policy instance") as info:
        resolve_policy(ctx, "fsdp2")
    # a policy's name where the policy belongs: the message says how to get it
    assert str(info.value).endswith("; for a shipped policy by its name, pass named_policy('fsdp2')")
    with pytest.raises(ContextTypeError) as info:
        resolve_policy(ctx, 3)
    assert "named_policy" not in str(info.value)
    with pytest.raises(PolicyMismatchError):
        resolve_policy(ctx, WorkspacePolicy()).plan(ctx)


@pytest.mark.parametrize(
    "kwargs, problem",
    [
        (dict(forward_usage=Usage.COLUMNWISE), "must include rowwise"),
        (dict(backward_source=BackwardSource.NONE), "reads no quantized weight"),
        (dict(columnwise_source=ColumnwiseSource.NOT_NEEDED), "not_needed exactly when"),
        (dict(forward_usage=Usage.ROWWISE), "needs a saved workspace built with columnwise"),
        (dict(backward_source=BackwardSource.REQUANTIZE), "requantiz"),
    ],
)
def test_inconsistent_plans_are_rejected(kwargs, problem):
    good = dict(
        cache=CacheAction.BYPASS,
        forward_usage=Usage.BOTH,
        backward_source=BackwardSource.SAVED_WORKSPACE,
        backward_usage=Usage.COLUMNWISE,
        columnwise_source=ColumnwiseSource.FORWARD,
        release=Release.NOTHING,
    )
    WorkspacePlan(**good)
    with pytest.raises(InvalidPlanError, match=problem):
        WorkspacePlan(**{**good, **kwargs})


def test_an_unknown_recipe_names_the_recipes_that_exist():
    from collections.abc import Mapping

    from workspace_manager import RECIPE_PROFILES, UnknownRecipeError
    from workspace_manager.extending import PROFILES

    with pytest.raises(UnknownRecipeError) as info:
        RECIPE_PROFILES["fp8"]
    assert isinstance(info.value, KeyError)
    message = str(info.value)
    assert message.startswith("'fp8' is no TE recipe; RECIPE_PROFILES knows DelayedScaling, Float8CurrentScaling, "
                              "Float8BlockScaling, MXFP8BlockScaling, NVFP4BlockScaling")
    assert "PROFILES" in message
    with pytest.raises(UnknownRecipeError, match="did you mean 'MXFP8BlockScaling'"):
        RECIPE_PROFILES["mxfp8blockscaling"]
    # still a read-only Mapping: `in`, .get, iteration behave as for a dict
    assert isinstance(RECIPE_PROFILES, Mapping) and not hasattr(RECIPE_PROFILES, "__setitem__")
    assert "fp8" not in RECIPE_PROFILES and RECIPE_PROFILES.get("fp8") is None
    assert RECIPE_PROFILES["MXFP8BlockScaling"] is PROFILES["mxfp8"] and len(RECIPE_PROFILES) == 5


@pytest.mark.parametrize("field, value, member", [
    ("cache", "bypass", "CacheAction.BYPASS"),
    ("forward_usage", "rowwise", "Usage.ROWWISE"),
    ("backward_source", None, "BackwardSource.SAVED_WORKSPACE"),
    ("backward_usage", 2, "Usage.COLUMNWISE"),
    ("columnwise_source", "forward", "ColumnwiseSource.FORWARD"),
    ("release", "nothing", "Release.NOTHING"),
    ("parameter_keeps", "none", "Usage.NONE"),
])
def test_a_plan_field_of_the_wrong_type_names_field_value_and_members(field, value, member):
    good = dict(cache=CacheAction.BYPASS, forward_usage=Usage.BOTH, backward_source=BackwardSource.SAVED_WORKSPACE,
                backward_usage=Usage.COLUMNWISE, columnwise_source=ColumnwiseSource.FORWARD, release=Release.NOTHING)
    with pytest.raises(ContextTypeError) as info:
        WorkspacePlan(**{**good, field: value})
    message = str(info.value)
    assert f"WorkspacePlan.{field} must be a" in message and f"received {value!r}" in message
    assert member in message, message  # a Flag's NONE and combined members are named too
    assert isinstance(info.value, TypeError)


def test_a_plan_of_strings_is_refused_at_its_first_field():
    """The issue's call: every field a string, refused naming ``cache``."""
    with pytest.raises(ContextTypeError,
                       match=r"WorkspacePlan.cache must be a CacheAction member \(CacheAction.BYPASS"):
        WorkspacePlan(cache="bypass", forward_usage="rowwise", backward_source="none", backward_usage="none",
                      columnwise_source="not_needed", release="nothing")


@pytest.mark.parametrize("notes", [["a list"], ("ok", 3), "one string"])
def test_plan_notes_are_a_tuple_of_strings(notes):
    with pytest.raises(ContextTypeError, match="WorkspacePlan.notes must be a tuple of str"):
        WorkspacePlan(cache=CacheAction.BYPASS, forward_usage=Usage.ROWWISE, backward_source=BackwardSource.NONE,
                      backward_usage=Usage.NONE, columnwise_source=ColumnwiseSource.NOT_NEEDED,
                      release=Release.NOTHING, notes=notes)


def test_an_unknown_profile_names_the_profiles_and_the_recipe_table():
    from workspace_manager import RECIPE_PROFILES
    from workspace_manager.extending import PROFILES, UnknownProfileError

    with pytest.raises(UnknownProfileError) as info:
        PROFILES["Float8CurrentScaling"]
    assert isinstance(info.value, KeyError)
    message = str(info.value)
    assert message.startswith("'Float8CurrentScaling' is no capability profile; PROFILES knows "
                              "float8_delayed_scaling, float8_current_scaling, ")
    assert "RECIPE_PROFILES['Float8CurrentScaling']" in message
    with pytest.raises(UnknownProfileError, match="did you mean 'mxfp8'"):
        PROFILES["MXFP8"]
    # still a dict: `in` and .get do not raise, and a known name is found
    assert "Float8CurrentScaling" not in PROFILES and PROFILES.get("Float8CurrentScaling") is None
    assert PROFILES["float8_current_scaling"] is RECIPE_PROFILES["Float8CurrentScaling"]


def test_registering_none_is_refused_and_registers_nothing():
    from workspace_manager import InvalidCapabilitiesError, register_quantizer
    from workspace_manager.extending import QuantizerRegistry

    registry = QuantizerRegistry()
    with pytest.raises(InvalidCapabilitiesError, match="register_quantizer received None for the quantizer") as info:
        register_quantizer(None, capabilities=CAPS, registry=registry)
    assert isinstance(info.value, TypeError) and "@register_quantizer(capabilities=...)" in str(info.value)
    assert len(registry) == 0

    @register_quantizer(capabilities=CAPS, registry=registry)  # the decorator form still works
    class Decorated:
        pass

    assert registry.lookup(Decorated) is CAPS
