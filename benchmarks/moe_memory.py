"""MoE experts: memory and step time of ``te.GroupedLinear`` stacks, stock TE
vs ``te_integration.GroupedLinear`` vs bf16, under FSDP2 and unsharded.

    torchrun --nproc_per_node=N -m benchmarks.moe_memory [--quick] [--out DIR]

N is the number of GPUs present (FSDP2 at world size N; 1 is a mesh of one
GPU). Two stacks of ``testbed.experts.build_expert_stack``, bf16 params, the
tokens split evenly over the experts, ``fully_shard`` on every block and the
root (``reshard_after_forward=True``), TE's FusedAdam, MSE loss: ``e8``, 8 x
GroupedLinear(8, 2048, 2048) at 4096 tokens, and ``e64``, 8 x
GroupedLinear(64, 1024, 1024) at 4096 tokens (64 tokens an expert).

Sections (``--sections``):
  fsdp2      bf16, stock FP8 and the drop-in per recipe, with 1 microbatch and
             with 4 (``is_first_microbatch`` True on the first, False after)
  unsharded  no fully_shard: bf16, stock, the drop-in (its default policy) and
             stock converted with ``LeanWorkspacePolicy``, 1 microbatch
  timing     stock, drop-in and stock again under FSDP2, alive together and
             trained in turn step by step (the second stock is the control)

Per model (``_stack.probe_model``, rank 0's, the first microbatch): the rise
of allocated memory from one block's forward to the next, forward-held
memory, the step's peak over its start, memory after backward and after the
optimizer step (over what was allocated before the model was built), weight
quantizations per step and losses. Targets, per sm_90 recipe: under FSDP2 the
drop-in's forward rise per block, forward-held memory and peak at most
bf16's (+1 MiB), and after the step with 4 microbatches at most bf16's plus
its recipe state; unsharded, the drop-in holds at most stock's less 1 byte
per expert parameter (D11), the lean model less than bf16's; losses
identical to stock's where quantizing again reproduces forward's bytes. Step
time is reported beside its control without a target: under FSDP2 the
drop-in quantizes each expert again in backward, which is its price. MXFP8
and NVFP4 are skipped with TE's reason where the GPU lacks them.
``--dry-run`` prints the plan and needs neither CUDA nor TE.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Sequence

from . import _harness as h
from ._runner import Job, add_plan_options, gpu_main
from ._stack import Steps, paired as _paired, probe_model
from .fsdp2_memory import losses_row, quantization_row

NAME = "moe_memory"
#: The sm_90 recipes, and the two an sm_90 GPU lacks (skipped with TE's reason there).
RECIPES = (*h.RECIPES, "MXFP8BlockScaling", "NVFP4BlockScaling")
SECTIONS = ("fsdp2", "unsharded", "timing")
LAYOUTS = ("discrete", "single")
DEFAULTS = {
    "recipes": (list(RECIPES), ["Float8CurrentScaling"]),
    "stacks": (["e8", "e64"], ["e8", "e64"]),
    "sections": (list(SECTIONS), list(SECTIONS)),
    "microbatches": ([1, 4], [1, 4]),
    "blocks": (None, 2),
    "steps": (20, 5),
    "warmup": (3, 1),
    "probes": (2, 1),
}
#: The stock-again model of a timed case is the control.
ORDER = ("stock", "dropin", "stock_again")
#: "At most bf16's" allows this much (allocator rounding, small tensors of TE's own); after the
#: step, the drop-in model's recipe state (scales, amax histories: no weight copy) on top.
BF16_SLACK_MIB = 1.0
#: The unsharded drop-in's saving: 1 byte per expert parameter, to 1% (allocator rounding).
SAVING_TOLERANCE = 0.99
#: Recipes whose weight quantization, done again, reproduces forward's bytes (docs/decisions.md):
#: a model that quantizes again in backward (FSDP2, lean) then matches stock bit for bit.
EXACT_REQUANTIZATION = ("Float8CurrentScaling", "Float8BlockScaling", "MXFP8BlockScaling")
#: (key, label) of every figure a memory sample has, in MiB.
FIGURES = (("fwd_rise_mib_per_block", "forward rise per block"), ("held_mib", "forward-held (after fwd - before)"),
           ("peak_over_start_mib", "peak over the step's start"), ("after_bwd_mib", "after backward (- before fwd)"),
           ("after_step_mib", "after step (over before build)"))


@dataclasses.dataclass(frozen=True)
class ExpertShape:
    """``blocks`` x GroupedLinear(``experts``, ``hidden``, ``hidden``) at ``tokens`` tokens a microbatch."""

    name: str
    blocks: int
    experts: int
    hidden: int
    tokens: int

    @property
    def params(self) -> int:
        """Expert parameters of the whole stack (unsharded)."""
        return self.blocks * self.experts * self.hidden**2

    def describe(self) -> str:
        return (f"{self.blocks} x GroupedLinear({self.experts}, {self.hidden}, {self.hidden}), "
                f"{self.tokens} tokens ({self.tokens // self.experts} per expert)")


SHAPES = {"e8": ExpertShape("e8", blocks=8, experts=8, hidden=2048, tokens=4096),
          "e64": ExpertShape("e64", blocks=8, experts=64, hidden=1024, tokens=4096)}


@dataclasses.dataclass(frozen=True)
class ExpertSpec:
    """One model: ``variant`` bf16 (no FP8), stock, dropin (its default
    policies) or lean (stock converted with LeanWorkspacePolicy, unsharded)."""

    shape: ExpertShape
    variant: str = "bf16"
    recipe: str = "bf16"
    sharded: bool = True
    micro: int = 1
    single_weight: bool = False

    def label(self) -> str:
        parts = [self.shape.name, f"{self.shape.blocks}B", "FSDP2" if self.sharded else "unsharded",
                 "" if self.variant == "bf16" else self.recipe, f"x{self.micro}" if self.micro > 1 else "",
                 "single-weight" if self.single_weight else "", self.variant]
        return " ".join(p for p in parts if p)

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "shape": self.shape.name, "blocks": self.shape.blocks,
                "experts": self.shape.experts, "hidden": self.shape.hidden, "tokens": self.shape.tokens,
                "params": self.shape.params}


def estimate_seconds(spec: ExpertSpec, n_steps: int, models: int = 1) -> float:
    """Building, then per step and microbatch the larger of a launch-bound
    floor (20 us a GEMM, three an expert) and the GEMMs at ~400 TFLOP/s, plus
    the optimizer (memory-bound)."""
    s = spec.shape
    gemm_s = max(3 * s.blocks * s.experts * 2e-5, 6 * s.tokens * s.params / s.experts / 4e14)
    return models * (0.5 + s.params / 1e9 + n_steps * (spec.micro * gemm_s + s.params * 16 / 3e12))


# -- on the GPU ---------------------------------------------------------------------
def build(spec: ExpertSpec):
    """The stack of ``spec``, from seed 0 (every variant starts from the same weights)."""
    from testbed.experts import build_expert_stack
    from testbed.recipes import make_recipe

    s = spec.shape
    model = build_expert_stack(s.blocks, s.experts, s.hidden, recipe=make_recipe(spec.recipe),
                               managed=spec.variant == "dropin", single_grouped_weight=spec.single_weight,
                               sharded=spec.sharded)
    if spec.variant != "lean":
        return model
    import te_integration as ti
    from workspace_manager import LeanWorkspacePolicy

    return ti.convert_model(model, policy=LeanWorkspacePolicy())


def batches_for(spec: ExpertSpec):
    """Inputs and targets (tokens, hidden) of a step: per rank, step and microbatch; the same for every model."""
    from testbed.model import random_pair, rank

    shape = (spec.shape.tokens, spec.shape.hidden)
    return lambda step: [random_pair(2_000 + 1_000 * step + 10 * m + rank(), shape) for m in range(spec.micro)]


def measure(spec: ExpertSpec, steps: Steps) -> dict:
    return {**probe_model(lambda: build(spec), spec.recipe, batches_for(spec), steps), "spec": spec.as_dict()}


def paired(specs: dict[str, ExpertSpec], steps: Steps, dist) -> dict:
    first = specs["stock"]
    result = _paired({label: (lambda spec=spec: build(spec)) for label, spec in specs.items()}, first.recipe,
                        batches_for(first), steps, dist)
    return {**result, "specs": {label: spec.as_dict() for label, spec in specs.items()}}


# -- the plan --------------------------------------------------------------------------
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
    add_plan_options(p)
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
            out += [dataclasses.replace(base, variant=v, recipe=recipe) for v in (pair if sharded else (*pair, "lean"))]
    return out


def plan(args: argparse.Namespace, dist, world: int, total_gib: float) -> list[Job]:
    """Per stack: the FSDP2 cases, the unsharded ones, then the timed cases."""
    steps = Steps(warmup=args.warmup, probe=args.probes, timed=args.steps)
    single = args.layout == "single"
    jobs = []
    for shape in shapes_of(args):
        for section in ("fsdp2", "unsharded"):
            if section in args.sections:
                jobs += [Job(label=f"[{section}] {spec.label()}", spec=spec,
                             meta={"section": section, "case": case_name(spec), "variant": spec.variant},
                             run=lambda spec=spec: measure(spec, steps),
                             estimate_s=estimate_seconds(spec, steps.warmup + steps.probe))
                         for spec in section_specs(section, shape, args.recipes, args.microbatches, single)]
        if "timing" in args.sections:
            jobs += [timing_job(shape, recipe, micro, single, steps, dist)
                     for recipe in args.recipes for micro in args.microbatches]
    return jobs


def timing_job(shape: ExpertShape, recipe: str, micro: int, single: bool, steps: Steps, dist) -> Job:
    specs = {label: ExpertSpec(shape=shape, variant="dropin" if label == "dropin" else "stock", recipe=recipe,
                               micro=micro, single_weight=single) for label in ORDER}
    timed = dataclasses.replace(steps, probe=0, micro=micro)
    return Job(label=f"[timing] {case_name(specs['stock'])}", spec=specs["dropin"],
               meta={"section": "timing", "case": case_name(specs["stock"]), "variant": "paired"},
               run=lambda: paired(specs, timed, dist),
               estimate_s=estimate_seconds(specs["stock"], steps.warmup + steps.timed, models=len(ORDER)))


# -- the summary (pure) ----------------------------------------------------------------
def summarize(samples: list[dict], args=None) -> dict:
    bf16 = {(s["section"], s["spec"]["shape"], s["spec"]["blocks"], s["spec"]["micro"]): s for s in samples
            if s["section"] != "timing" and s["variant"] == "bf16"}
    cases: dict[tuple, dict] = {}
    for s in samples:
        if s["section"] != "timing" and s["variant"] != "bf16":
            cases.setdefault((s["section"], s["case"]), {})[s["variant"]] = s
    rows, timings = [], []
    for (section, case), variants in cases.items():
        if "stock" not in variants:
            continue
        st = variants["stock"]
        base = bf16.get((section, st["spec"]["shape"], st["spec"]["blocks"], st["spec"]["micro"]))
        if section == "fsdp2" and "dropin" in variants:
            rows += fsdp2_rows(case, st, variants["dropin"], base)
        elif section == "unsharded":
            rows += unsharded_rows(case, variants, base)
    for sample in (s for s in samples if s["section"] == "timing"):
        rows += timing_rows(sample)
        timings += [{"case": sample["case"], "variant": label.replace("_", " ").replace("dropin", "drop-in"),
                     "samples_ms": [1e3 * v for v in times]} for label, times in sample["step_time_s"].items()]
    return {"rows": rows, "timings": timings}


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b not in (None, 0) else None


def at_most_bf16(case: str, key: str, metric: str, st: dict, dr: dict, base: dict | None) -> dict:
    """The drop-in's figure against bf16's (+ :data:`BF16_SLACK_MIB`; after
    the step, which counts from before the build, + the drop-in model's own
    recipe state too); the ratio column is still drop-in/stock."""
    value, stock = dr.get(key), st.get(key)
    if base is None or base.get(key) is None or value is None:
        return h.ratio_row(case, metric, "MiB", stock, value, limit=None, note="no bf16 model to compare with")
    state = (dr.get("quantizer_state_mib") or 0.0) if key == "after_step_mib" else 0.0
    bound = base[key] + state + BF16_SLACK_MIB
    extra = f" + recipe state {state:.2f}" if state else ""
    row = h.bound_row(case, metric, "MiB", value, bound, f"<= bf16{extra} + {BF16_SLACK_MIB:g} MiB ({bound:.1f})",
                      stock=stock, bf16=base[key], note=f"drop-in/bf16 {h.fmt_ratio(ratio(value, base[key]))}")
    return {**row, "ratio": ratio(value, stock)}


def requantized_losses_row(case: str, st: dict, other: dict, metric: str = "losses identical to stock") -> dict:
    """Losses against stock for a model that quantizes its weights again in
    backward: a target where that reproduces forward's bytes, reported only
    where it does not (its plan is then not stock's in numerics either)."""
    row = {**losses_row(case, st, other), "metric": metric}
    if other["spec"]["recipe"] not in EXACT_REQUANTIZATION:
        row.update(ok=None, target="", note=row["note"] + f"; no target: {other['spec']['recipe']} does not "
                   "quantize again exactly, and this model quantizes again in backward where stock keeps "
                   "forward's copy")
    return row


def fsdp2_rows(case: str, st: dict, dr: dict, base: dict | None) -> list[dict]:
    bounded = {"fwd_rise_mib_per_block", "held_mib", "peak_over_start_mib"} | (
        {"after_step_mib"} if dr["spec"]["micro"] > 1 else set())
    rows = [requantized_losses_row(case, st, dr)]
    for key, metric in FIGURES:
        rows.append(at_most_bf16(case, key, metric, st, dr, base) if key in bounded else
                    h.ratio_row(case, metric, "MiB", st.get(key), dr.get(key), limit=None,
                                bf16=(base or {}).get(key)))
    left = [p.get("leftover_workspaces", 0) for p in dr.get("probes", [])]
    return rows + [quantization_row(case, st, dr),
                   h.check_row(case, "workspaces the plan frees are gone after the step", not any(left),
                               f"leftovers per probed step: {left}", target="0 after every probed step")]


def unsharded_rows(case: str, variants: dict, base: dict | None) -> list[dict]:
    """D11's saving (forward-held at most stock's less 1 byte per expert
    parameter) and the lean model held strictly under bf16's."""
    st, dr, lean, b = variants["stock"], variants.get("dropin"), variants.get("lean"), base or {}
    rows = []
    if dr is not None:
        bound = st["held_mib"] - SAVING_TOLERANCE * dr["spec"]["params"] / h.MIB
        held = h.bound_row(case, "forward-held, drop-in (D11)", "MiB", dr["held_mib"], bound,
                           f"<= stock - 1 B/expert param ({bound:.1f})", stock=st["held_mib"], bf16=b.get("held_mib"))
        rows += [losses_row(case, st, dr), {**held, "ratio": ratio(dr["held_mib"], st["held_mib"])},
                 h.ratio_row(case, "peak over the step's start, drop-in", "MiB", st["peak_over_start_mib"],
                             dr["peak_over_start_mib"], limit=None, bf16=b.get("peak_over_start_mib"))]
    if lean is not None:
        if base is None:
            held = h.ratio_row(case, "forward-held, lean", "MiB", st["held_mib"], lean["held_mib"], limit=None,
                               note="no bf16 model to compare with")
        else:
            held = {**h.bound_row(case, "forward-held, lean", "MiB", lean["held_mib"], base["held_mib"], "< bf16",
                                  strict=True, stock=st["held_mib"], bf16=base["held_mib"]),
                    "ratio": ratio(lean["held_mib"], st["held_mib"])}
        rows += [requantized_losses_row(case, st, lean, "losses identical to stock, lean"), held]
    return rows


def timing_rows(sample: dict) -> list[dict]:
    case, t, losses = sample["case"], sample["step_time_s"], sample["losses"]
    same = losses["dropin"] == losses["stock"] and losses["stock_again"] == losses["stock"]
    row = h.time_row(case, t["stock"], t["dropin"], limit=None)
    price = ("under FSDP2 the drop-in quantizes every expert weight again in backward in place of the copy "
             "stock keeps from forward: that is its price; no target")
    row["note"] = "; ".join(n for n in (price, row["note"]) if n)
    return [h.check_row(case, "losses identical (stock, drop-in, stock again)", same,
                        f"{len(losses['stock'])} steps" + ("" if same else ": they differ")),
            row, h.control_row(case, t["stock"], t["stock_again"])]


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
    rc = gpu_main(NAME, args, argv, plan, summarize,
                  extra_config={"shapes": {s.name: s.describe() for s in shapes_of(args)}})
    h.print_result(NAME, args.out, args.tag)
    return rc


if __name__ == "__main__":
    sys.exit(main())
