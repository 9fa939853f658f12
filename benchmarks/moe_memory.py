"""MoE experts: memory and step time of ``te.GroupedLinear`` stacks, stock TE
vs ``te_integration.GroupedLinear`` vs bf16, under FSDP2 and unsharded.

    torchrun --nproc_per_node=N -m benchmarks.moe_memory [--quick] [--out DIR]

N is the number of GPUs present (FSDP2 at world size N; 1 is a mesh of one
GPU). Two stacks, bf16 params, ``fully_shard`` on every block and the root
(``reshard_after_forward=True``), TE's FusedAdam, MSE loss on random inputs:
``e8``, 8 x GroupedLinear(8, 2048, 2048) at 4096 tokens (33.5 M expert
parameters a block), and ``e64``, 8 x GroupedLinear(64, 1024, 1024) at 4096
tokens (67.1 M a block, 64 tokens an expert). The tokens are split evenly
over the experts.

Sections (``--sections``):
  fsdp2      bf16, stock FP8 and the drop-in per recipe, with 1 microbatch and
             with 4 (``is_first_microbatch`` True on the first, False after)
  unsharded  no fully_shard: bf16, stock, the drop-in (its default policy) and
             stock converted with ``LeanWorkspacePolicy``, 1 microbatch
  timing     stock, drop-in and stock again under FSDP2, alive together and
             trained in turn step by step (the second stock is the control)

Per model: the rise of allocated memory from one block's forward hook to the
next (mean over the blocks), forward-held memory (after forward minus before),
the peak of the step over its start, memory after backward (minus before
forward) and after the optimizer step (over what was allocated before the
model was built), weight quantizations per step and losses (bit for bit
against stock). Memory figures are rank 0's, from the first microbatch's
forward and backward.

Targets (the issue's), per sm_90 recipe: under FSDP2 the drop-in's forward
rise per block, forward-held memory and peak at most bf16's, and after the
step with 4 microbatches at most bf16's; unsharded, the drop-in holds at most
stock's less 1 byte per expert parameter, and the lean model less than
bf16's. MXFP8 and NVFP4 are listed as skipped with TE's reason where the GPU
lacks them. ``--dry-run`` prints the planned configurations and needs
neither CUDA nor TE.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Sequence

from . import _harness as h
from ._experts import SHAPES, ExpertShape, ExpertSpec, estimate_seconds, measure, paired
from ._moe_summary import summarize
from ._runner import Job, gpu_main
from ._stack import Steps

NAME = "moe_memory"
#: The sm_90 recipes, and the two an sm_90 GPU lacks (skipped with TE's reason there).
RECIPES = (*h.RECIPES, "MXFP8BlockScaling", "NVFP4BlockScaling")
SECTIONS = ("fsdp2", "unsharded", "timing")
LAYOUTS = ("discrete", "single")
DEFAULTS = {
    "recipes": (list(RECIPES), ["Float8CurrentScaling"]),
    "stacks": (list(SHAPES), list(SHAPES)),
    "sections": (list(SECTIONS), list(SECTIONS)),
    "microbatches": ([1, 4], [1, 4]),
    "blocks": (None, 2),
    "steps": (20, 5),
    "warmup": (3, 1),
    "probes": (2, 1),
}
#: The stock-again model of a timed case is the control.
ORDER = ("stock", "dropin", "stock_again")


def parser() -> argparse.ArgumentParser:
    p = h.base_parser(NAME, __doc__)
    p.add_argument("--recipes", type=h.csv_choices(RECIPES), help=f"comma-separated, from {', '.join(RECIPES)}")
    p.add_argument("--stacks", type=h.csv_choices(tuple(SHAPES)), help="comma-separated, from e8, e64")
    p.add_argument("--sections", type=h.csv_choices(SECTIONS), help=f"comma-separated, from {', '.join(SECTIONS)}")
    p.add_argument("--microbatches", type=h.int_list, help="microbatch counts of the FSDP2 and timing cases "
                   "(default 1,4)")
    p.add_argument("--blocks", type=h.positive_int, help="blocks of every stack (default 8; --quick 2)")
    p.add_argument("--layout", choices=LAYOUTS, default="discrete",
                   help="discrete: weight0..weightN-1 (default); single: single_grouped_weight=True with "
                        "use_grouped_tensor=True")
    p.add_argument("--steps", type=h.positive_int, help="timed steps per model in the timing section")
    p.add_argument("--warmup", type=int, help="untimed steps per model before probing or timing")
    p.add_argument("--probes", type=h.positive_int, help="memory-probe steps per model")
    p.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="skip the remaining configurations once this much time has passed (recorded as skipped)")
    p.add_argument("--dry-run", action="store_true", help="print the planned configurations and exit")
    return p


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    return h.parse_args(parser(), argv, DEFAULTS)


def shapes_of(args: argparse.Namespace) -> list[ExpertShape]:
    return [dataclasses.replace(SHAPES[n], blocks=args.blocks) if args.blocks else SHAPES[n] for n in args.stacks]


def case_name(spec: ExpertSpec) -> str:
    where = "FSDP2" if spec.sharded else "unsharded"
    micro = f" x{spec.micro} microbatches" if spec.micro > 1 else ""
    layout = " single-weight" if spec.single_weight else ""
    return f"{spec.shape.name} {spec.shape.blocks}B {where}{layout} {spec.recipe}{micro}"


def section_specs(section: str, shape: ExpertShape, recipes: Sequence[str], micros: Sequence[int],
                  single: bool) -> list[ExpertSpec]:
    """The bf16 baseline, then stock and the drop-in per recipe (plus lean
    unsharded), stock and drop-in alternating which goes first."""
    sharded = section == "fsdp2"
    out = []
    for micro in (micros if sharded else [1]):
        base = ExpertSpec(shape=shape, sharded=sharded, micro=micro, single_weight=single)
        out.append(base)
        for i, recipe in enumerate(recipes):
            pair = ("stock", "dropin") if i % 2 == 0 else ("dropin", "stock")
            variants = pair if sharded else (*pair, "lean")
            out += [dataclasses.replace(base, variant=v, recipe=recipe) for v in variants]
    return out


def memory_job(section: str, spec: ExpertSpec, steps: Steps) -> Job:
    meta = {"section": section, "case": case_name(spec), "variant": spec.variant}
    return Job(label=f"[{section}] {spec.label()}", meta=meta, spec=spec, run=lambda: measure(spec, steps),
               estimate_s=estimate_seconds(spec, steps.warmup + steps.probe))


def timing_job(shape: ExpertShape, recipe: str, micro: int, single: bool, steps: Steps, dist) -> Job:
    specs = {label: ExpertSpec(shape=shape, variant="dropin" if label == "dropin" else "stock", recipe=recipe,
                               micro=micro, single_weight=single) for label in ORDER}
    case = case_name(specs["stock"])
    meta = {"section": "timing", "case": case, "variant": "paired"}
    return Job(label=f"[timing] {case}", meta=meta, spec=specs["dropin"],
               run=lambda: paired(specs, Steps(warmup=steps.warmup, probe=0, timed=steps.timed, micro=micro), dist),
               estimate_s=estimate_seconds(specs["stock"], steps.warmup + steps.timed, models=len(ORDER)))


def plan(args: argparse.Namespace, dist, world: int, total_gib: float) -> list[Job]:
    """Per stack: the FSDP2 cases, the unsharded ones, then the timed pairs."""
    steps = Steps(warmup=args.warmup, probe=args.probes, timed=args.steps)
    single = args.layout == "single"
    jobs = []
    for shape in shapes_of(args):
        for section in ("fsdp2", "unsharded"):
            if section in args.sections:
                jobs += [memory_job(section, spec, steps)
                         for spec in section_specs(section, shape, args.recipes, args.microbatches, single)]
        if "timing" in args.sections:
            jobs += [timing_job(shape, recipe, micro, single, steps, dist)
                     for recipe in args.recipes for micro in args.microbatches]
    return jobs


def dry_run(args: argparse.Namespace) -> int:
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    jobs = plan(args, None, world, 141.0)
    for shape in shapes_of(args):
        print(f"{shape.name}: {shape.describe()}")
    for job in jobs:
        print(f"{job.label}  (about {job.estimate_s:.1f} s)")
    print(f"{len(jobs)} configuration(s), about {sum(j.estimate_s for j in jobs):.0f} s at world size {world}; "
          "recipes this GPU lacks are skipped at run time with TE's reason")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    if args.dry_run:
        return dry_run(args)
    rc = gpu_main(NAME, args, argv, plan, summarize, extra_config={"shapes": {s.name: s.describe()
                                                                              for s in shapes_of(args)}})
    h.print_result(NAME, args.out, args.tag)
    return rc


if __name__ == "__main__":
    sys.exit(main())
