"""Step time, paired: stock, drop-in and stock again, trained in turn, one step each.

    torchrun --nproc_per_node=2 -m benchmarks.step_time [--quick]

The other benchmarks time stock and drop-in minutes apart, one model after
the other, so drift in clocks and load lands on one side: two stock runs of
the same realistic model differed by 50 ms (10%) there. Here the three models
of a case are alive together and take turns step by step, so drift hits all
three alike. The second stock model is the control: its ratio to the first
is the noise floor the drop-in's ratio must be read against. The models
rotate their place in each round, stock models step with te_integration's
seams taken out (stock TE's own code), and each time row also gives the
median of per-round ratios.

``--profile`` counts one more step of stock and drop-in under cProfile and
adds, per case, the functions whose Python-level call counts differ: where
the drop-in's host time goes, exactly, whatever the host's noise.

Per case (size x recipe x init x microbatches): the median step time of
each model with its spread (the slowest rank's time per step), drop-in /
stock against its target, stock again / stock as the control, and losses
identical across the three. Sizes: ``leak`` (8 layers) and ``realistic`` at
8 layers, since three realistic models deep enough to fill the GPU would not
fit at once.

One microbatch (the default) is FSDP2 with ``reshard_after_forward=True``.
``--microbatches 4,8`` adds the paired form of ``benchmarks.microbatch``:
``reshard_after_forward=False`` and that many microbatches per step. The
drop-in's target is <= 1.005 of stock's step time in both (the issue "the
drop-ins cost no step time"; its 0.97 with microbatches assumed the
microbatch cache on by default, which is now an option: see below).

``--policy NAME`` pins a policy on the drop-in model by its ``explain``
name, e.g. an option of the shipped policies that is off by default:
``keep_for_backward`` (forward's columnwise copy kept for backward, what
``te_integration.apply_workspace_budget`` pins on the layers a budget
holds), ``fsdp2_microbatch_cache`` (one quantization per weight a step
instead of one a microbatch; with ``--microbatches``) or
``fsdp2_recompute_build_once`` (a recompute pass's copy saved instead of
rebuilt in backward; every layer then runs in ``te.checkpoint``, in all
three models). The target is then <= 0.98: a default may cost memory over
stock only where it buys at least 2% of step time (docs/decisions.md); each
case also reports the step's peak against stock's. Without ``--policy``,
the drop-in plans with its defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
from collections.abc import Sequence

from . import _harness as h
from ._runner import Job, gpu_main
from ._profile import differences_table
from ._stack import SIZES, ModelSpec, Steps, add_policy_argument, estimate_seconds, paired_times

NAME = "step_time"
DEFAULTS = {
    "recipes": (list(h.RECIPES), list(h.RECIPES)),
    "sizes": (["leak", "realistic"], ["leak"]),
    "inits": (list(h.INITS), ["bf16"]),
    "steps": (30, 10),
    "warmup": (5, 2),
    "microbatches": ([1], [1]),
}
#: The three models of a case, in the order they take turns.
ORDER = ("stock", "dropin", "stock_again")
#: The step-time ratio a pinned policy must reach to pay for memory over stock as a default would.
OPTION_RATIO_MAX = 0.98
#: The drop-in with its defaults: at most 0.5% slower than stock.
DEFAULT_RATIO_MAX = 1.005
CHECKPOINTS = ("none", "nonreentrant", "reentrant")


def _is_recompute_policy(name: str | None) -> bool:
    from workspace_manager import RecomputeWorkspacePolicy, named_policy

    return name is not None and isinstance(named_policy(name), RecomputeWorkspacePolicy)


def parser() -> argparse.ArgumentParser:
    p = h.make_parser(NAME, __doc__)
    p.add_argument("--inits", type=h.csv_choices(h.INITS), help="bf16 (bf16 params), qinit (quantized_model_init)")
    p.add_argument("--seq", type=h.positive_int, default=None,
                   help="sequence length per (micro)batch instead of the size's own")
    p.add_argument("--microbatches", type=h.int_list,
                   help="microbatch counts per step (default 1); above 1, reshard_after_forward=False")
    add_policy_argument(p, f"Its step-time target is then <= {OPTION_RATIO_MAX}.")
    p.add_argument("--profile", action="store_true",
                   help="after the timed rounds, count one step of stock and drop-in under cProfile: the functions "
                        "whose Python-level call counts differ, per case, in the summary")
    p.add_argument("--checkpoint", choices=CHECKPOINTS, default=None,
                   help="te.checkpoint around every layer of all three models (default: none; nonreentrant "
                        "when --policy names a recompute policy, whose option acts only in recompute passes)")
    return p


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    args = h.parse_args(parser(), argv, DEFAULTS)
    if args.checkpoint is None:
        args.checkpoint = "nonreentrant" if _is_recompute_policy(args.policy) else "none"
    return args


def case_specs(size_name: str, layers: int, recipe: str, init: str, micro: int = 1,
               seq: int | None = None, policy: str | None = None, checkpoint: str = "none") -> dict[str, ModelSpec]:
    size = SIZES[size_name] if seq is None else dataclasses.replace(SIZES[size_name], seq=seq)
    qinit = init == "qinit"
    # Microbatches keep the gathered weight between them (the microbatch cache needs that).
    return {label: ModelSpec(size=size, layers=layers, recipe=recipe, managed=label == "dropin", quantized_init=qinit,
                             reshard_after_forward=micro == 1, checkpoint=checkpoint,
                             policy=policy if label == "dropin" else None)
            for label in ORDER}


def case_name(size_name: str, layers: int, recipe: str, init: str, micro: int, seq: int | None = None,
              policy: str | None = None, checkpoint: str = "none") -> str:
    case = f"{size_name} {layers}L {recipe} {h.INIT_LABELS[init]}" + (f" seq {seq}" if seq else "")
    case = case if micro == 1 else f"{case} x{micro} microbatches"
    if checkpoint != "none":
        case += f" te.checkpoint {checkpoint}"
    return case + (f" policy {policy}" if policy else "")


def paired_job(case: str, init: str, micro: int, specs: dict[str, ModelSpec], steps: Steps, dist,
               profile: bool = False) -> Job:
    meta = {"case": case, "init": init, "microbatches": micro, "policy": specs["dropin"].policy}
    return Job(label=f"[paired] {case}", meta=meta, spec=specs["dropin"],
               run=lambda: paired_times(specs, steps, dist, profile=profile),
               estimate_s=sum(estimate_seconds(s, steps) for s in specs.values()))


def plan(args: argparse.Namespace, dist, world: int, total_gib: float) -> list[Job]:
    jobs = []
    for size_name, micro in itertools.product(args.sizes, args.microbatches):
        layers = args.layers or SIZES[size_name].layers
        steps = Steps(warmup=args.warmup, probe=0, timed=args.steps, micro=micro)
        for recipe, init in itertools.product(args.recipes, args.inits):
            where = dict(policy=args.policy, checkpoint=args.checkpoint)
            specs = case_specs(size_name, layers, recipe, init, micro, args.seq, **where)
            name = case_name(size_name, layers, recipe, init, micro, args.seq, **where)
            jobs.append(paired_job(name, init, micro, specs, steps, dist, profile=args.profile))
    return jobs


def dropin_time_row(case: str, sample: dict) -> dict:
    t = sample["step_time_s"]
    if sample.get("policy"):
        row = h.time_row(case, t["stock"], t["dropin"], limit=OPTION_RATIO_MAX)
        why = f"{sample['policy']} pinned: <= {OPTION_RATIO_MAX} is what a default that costs memory must buy"
        row["note"] = "; ".join(n for n in (why, row["note"]) if n)
        return row
    return h.time_row(case, t["stock"], t["dropin"], limit=DEFAULT_RATIO_MAX)


def case_rows(case: str, sample: dict) -> list[dict]:
    t, losses = sample["step_time_s"], sample["losses"]
    same = losses["dropin"] == losses["stock"] and losses["stock_again"] == losses["stock"]
    rows = [h.check_row(case, "losses identical (stock, drop-in, stock again)", same,
                        f"{len(losses['stock'])} steps" + ("" if same else ": they differ")),
            dropin_time_row(case, sample), h.control_row(case, t["stock"], t["stock_again"])]
    peak = sample.get("step_peak_mib")
    if peak:  # what a pinned option costs in memory beside what it buys in time
        rows.append(h.ratio_row(case, "step peak over its start (largest timed step)", "MiB", peak["stock"],
                                peak["dropin"], limit=None, note="reported; no target"))
    return rows


def summarize(samples: list[dict], args: argparse.Namespace | None = None) -> dict:
    rows, timings, tables = [], [], []
    for s in samples:
        rows += case_rows(s["case"], s)
        timings += [{"case": s["case"], "variant": label.replace("_", " ").replace("dropin", "drop-in"),
                     "samples_ms": [1e3 * v for v in s["step_time_s"][label]]} for label in ORDER]
        if s.get("profile"):
            prof = s["profile"]
            tables.append(differences_table(f"Where the host time goes: {s['case']}, one step",
                                            prof["stock"]["calls"], prof["dropin"]["calls"], what="Python-level calls"))
    return {"rows": rows, "timings": timings, "tables": tables}


def main(argv: Sequence[str] | None = None) -> int:
    return gpu_main(NAME, parse(argv), argv, plan, summarize)


if __name__ == "__main__":
    sys.exit(main())
