"""FSDP2 worker: switching resharding modes mid-training, stock TE vs drop-ins.

Run as ``torchrun --nproc_per_node=N tests/gpu/_mode_switch.py OUT.json`` (N = 1 or 2).
For each sm_90 recipe it builds the stack of ``_fsdp2_stack`` (8 x
TransformerLayer(256, 1024, 8 heads), bf16 params, ``fully_shard`` per
layer and at the root with ``reshard_after_forward=False``) three times:
stock, with drop-ins (their defaults), and with drop-ins that have the
microbatch cache option pinned (:data:`DROP_INS`; off by default,
docs/decisions.md D4, so only this stack keeps a cache across a keep
phase's microbatches), and trains each through the same :data:`PHASES`, switching
``set_reshard_after_forward`` and ``set_reshard_after_backward`` between
them. Per phase it records the losses, the sharding the drop-ins planned
for, what ``workspace_report`` lists before and after each optimizer step,
and, where forward reshards, the per-layer forward increment; a bf16 stack
(FP8 off) goes through the same phases as the memory baseline.
Rank 0 writes the report to OUT.json.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass

from _fsdp2_stack import CACHE_OPTION, RECIPES, build, forward_backward  # first: puts the repo root on sys.path

from testbed.dist import guard, run_worker
from testbed.model import allocated, optimizer_for, release_memory
from testbed.recipes import make_recipe, supported_recipes

STEPS_PER_PHASE = 2
#: The drop-in stacks by report key: their defaults, and the microbatch cache option pinned.
DROP_INS = {"managed": None, "managed_cache": CACHE_OPTION}
#: The layer whose drop-ins' plans are recorded (any inner one would do).
PLAN_LAYER = 3


@dataclass(frozen=True)
class Phase:
    """One stretch of training between two switches."""

    name: str
    reshard_after_forward: bool
    microbatches: int
    #: Gradient accumulation as FSDP2 documents ``set_reshard_after_backward``:
    #: False before every microbatch but the step's last, True before the
    #: last, so the parameters stay gathered from each backward to the next
    #: microbatch's forward and are resharded before the optimizer step.
    accumulate: bool = False
    #: After setting the phase's mode on the root, the last layer alone is
    #: set to keep its weights gathered after forward (FSDP2's per-module
    #: switch, as for a last layer whose backward runs first).
    last_layer_keeps: bool = False


#: The model is built with reshard_after_forward=False; each phase first sets
#: its mode on the root (which recurses into every layer), then, in the last
#: phase, keeps the last layer gathered on its own, then trains.
PHASES = (
    Phase("keep", False, 4),
    Phase("reshard", True, 1),
    Phase("keep again", False, 4),
    Phase("keep, backward keeps", False, 4, accumulate=True),
    Phase("keep, backward reshards", False, 4),
    Phase("reshard, backward keeps", True, 4, accumulate=True),
    Phase("reshard, backward reshards", True, 4),
    Phase("reshard, last layer keeps", True, 4, last_layer_keeps=True),
)


class ForwardIncrement:
    """Mean rise of ``memory_allocated`` between consecutive layers' forward
    pre-hooks. The hooks are added after ``fully_shard``'s, so each mark is
    taken with that layer's weight already gathered."""

    def __init__(self, model):
        self.marks: list[int] = []
        self.rises: list[float] = []
        self.handles = [layer.register_forward_pre_hook(lambda *_: self.marks.append(allocated()))
                        for layer in model.children()]

    def close_forward(self) -> None:
        if len(self.marks) > 1:
            self.rises.extend(b - a for a, b in zip(self.marks, self.marks[1:]))
        self.marks.clear()

    def take_kib(self) -> float | None:
        rises, self.rises = self.rises, []
        return sum(rises) / len(rises) / 1024 if rises else None

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _drop_ins(module) -> list:
    """(name, module) of every drop-in inside ``module``."""
    import te_integration as ti

    kinds = (ti.Linear, ti.LayerNormLinear, ti.LayerNormMLP)
    return [(name, m) for name, m in module.named_modules() if isinstance(m, kinds)]


def _plan_shardings(layer) -> dict[str, list[str]]:
    """``{module name: [ctx.sharding of each weight]}`` for the drop-ins of
    one layer, from ``last_plans``."""
    import te_integration as ti

    return {name: sorted(ctx.sharding.value for ctx, _ in ti.last_plans(m).values())
            for name, m in _drop_ins(layer)}


def _in_flight(model) -> int:
    """Drop-in call records still on this thread's stack (none between
    calls: ``ACTIVE.record is None``; a weight left in a record would stay
    alive). ``model`` is unused: a call's state is its record, not its
    module's."""
    from te_integration.runtime._call import ACTIVE

    depth, record = 0, ACTIVE.record
    while record is not None:
        depth, record = depth + 1, record.previous
    return depth


def _train_phase(model, opt, recipe, phase: Phase, first_step: int, managed: bool, meter: ForwardIncrement) -> dict:
    import te_integration as ti

    model.set_reshard_after_forward(phase.reshard_after_forward)
    model.set_reshard_after_backward(True)
    last_layer = list(model.children())[-1]
    if phase.last_layer_keeps:
        last_layer.set_reshard_after_forward(False)
    last = phase.microbatches - 1

    def before_each(m: int) -> None:
        meter.close_forward()  # the marks of the previous microbatch's forward
        if phase.accumulate:
            model.set_reshard_after_backward(m == last)

    out = {"losses": [], "report_entries_before_step": [], "report_entries_after_step": [],
           "after_step_tables": [], "plan_sharding": [], "plan_sharding_last": [], "in_flight_after_step": []}
    for step in range(first_step, first_step + STEPS_PER_PHASE):
        out["losses"].append(forward_backward(model, recipe, step, phase.microbatches, before_each))
        meter.close_forward()
        if managed:
            out["plan_sharding"].append(_plan_shardings(model[PLAN_LAYER]))
            out["plan_sharding_last"].append(_plan_shardings(last_layer))
            out["report_entries_before_step"].append(len(ti.workspace_report(model).entries))
        opt.step()
        opt.zero_grad(set_to_none=True)
        if managed:
            after = ti.workspace_report(model)
            out["report_entries_after_step"].append(len(after.entries))
            out["after_step_tables"].append(after.table() if after.entries else "")
            out["in_flight_after_step"].append(_in_flight(model))
    # Memory figures only where forward reshards: in keep mode each layer's
    # gathered weight stays through forward, so the increment there is
    # dominated by the weights, not by what a workspace plan keeps.
    fwd = meter.take_kib()
    out["fwd_kib_per_layer"] = fwd if phase.reshard_after_forward else None
    return out


def run_stack(name: str, managed: bool, policy: str | None = None) -> list[dict]:
    """One stack through every phase (``policy`` pinned on the drop-ins, if
    given); one result per phase."""
    recipe = make_recipe(name)
    model = build(managed, recipe, False, reshard_after_forward=False, policy=policy)
    opt = optimizer_for(model)
    meter = ForwardIncrement(model)
    try:
        results = []
        for i, phase in enumerate(PHASES):
            results.append(_train_phase(model, opt, recipe, phase, i * STEPS_PER_PHASE, managed, meter))
        return results
    finally:
        meter.remove()
        del model, opt
        release_memory()


def run_cases(report: dict) -> None:
    import torch.distributed as dist

    # The launcher adds "world_size" as it counted the GPUs; the tests check both agree.
    report["dist_world_size"] = dist.get_world_size()
    if dist.get_rank() == 0:
        print(f"_mode_switch.py: world size {report['dist_world_size']}", flush=True)
    # Each stack's failure is recorded (guard), so the tests show it rather than a missing report.
    guard(report, "bf16", lambda: report.update(bf16=run_stack("bf16", managed=False)))
    for name in supported_recipes(RECIPES, report["unsupported"]):
        guard(report, name, lambda: report["recipes"].update({name: {
            "stock": run_stack(name, managed=False),
            **{key: run_stack(name, managed=True, policy=policy) for key, policy in DROP_INS.items()}}}))


def main() -> int:
    return run_worker(sys.argv[1], run_cases, phases=[asdict(p) for p in PHASES], steps_per_phase=STEPS_PER_PHASE,
                      bf16=None, recipes={}, unsupported={})


if __name__ == "__main__":
    sys.exit(main())
