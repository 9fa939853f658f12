"""The workspace manager on a CPU: plan calls, read the decision table, check a quantizer.

Needs neither a GPU nor TransformerEngine. Run it from the repository root::

    python3 examples/policies_on_cpu.py

It plans one call of a weight that FSDP2 reshards after forward, the same
call under the plain and the lean policy, prints the FSDP2 policy's
decision table for one TE recipe, and runs the quantizer testing kit on the
reference FP8 quantizer that ships with the package.
"""

from __future__ import annotations

from workspace_manager import (
    RECIPE_PROFILES,
    Microbatch,
    Sharding,
    WorkspaceContext,
    explain,
    named_policy,
    plan_call,
    select_policy,
)
from workspace_manager.testing import check_quantizer
from workspace_manager.testing.reference import REFERENCE_CAPABILITIES, Float8PerTensorQuantizer


def plan_one_call() -> None:
    """A weight of an MXFP8 recipe that FSDP2 reshards after forward: the
    policy picked for it, its plan and the reasons."""
    ctx = WorkspaceContext(capabilities=RECIPE_PROFILES["MXFP8BlockScaling"], sharding=Sharding.FSDP2_RESHARD)
    policy = select_policy(ctx)
    plan = policy.plan(ctx)
    print(f"{type(policy).__name__}: {plan.summary()}")
    for note in plan.notes:
        print(f"  why: {note}")


def compare_two_policies() -> None:
    """A later microbatch of a whole weight: the plain policy reuses its
    cached copy, the lean one keeps none and quantizes again in backward."""
    ctx = WorkspaceContext(capabilities=RECIPE_PROFILES["Float8CurrentScaling"], microbatch=Microbatch.LATER)
    for name in ("plain", "lean"):
        print(f"{name}: {plan_call(ctx, named_policy(name)).summary()}")


def check_the_reference_quantizer() -> None:
    """The kit a quantizer author runs, on the package's reference quantizer."""
    report = check_quantizer(Float8PerTensorQuantizer, REFERENCE_CAPABILITIES, examples=2, steps=20)
    print(str(report).splitlines()[0])
    report.raise_for_failures()


def main() -> None:
    plan_one_call()
    print()
    compare_two_policies()
    print()
    print(explain("fsdp2", recipe="MXFP8BlockScaling"))
    check_the_reference_quantizer()


if __name__ == "__main__":
    main()
