"""MoE step time under FSDP2: the expert MLP stack, stock TE against
``te_integration.GroupedLinear``, with a profiled step.

    torchrun --nproc_per_node=N -m benchmarks.moe_step [--quick] [--out DIR]

N is the number of GPUs present (FSDP2 at world size N; 1 is a mesh of one
GPU). The stack is ``testbed.moe_mlp.build_moe_mlp_stack``: ``--layers`` x
(GroupedLinear(E, H, F) -> GELU -> GroupedLinear(E, F, H) + residual),
``fully_shard`` on every layer and the root, ``--tokens`` routed tokens per
microbatch split unevenly (one expert empty), TE's FusedAdam with fp32
master weights, MSE loss. Defaults: 4 layers, 32 experts, H 2048, F 1536,
16,384 tokens. Per recipe, microbatch count (``is_first_microbatch`` True on
the first, False after) and parameter kind (bf16, or made under
``quantized_model_init``):

  timing   stock, drop-in and stock again (the control), alive together and
           stepped in turn; median step time over ``--steps`` rounds and the
           median of per-round ratios with its spread. Target: drop-in /
           stock at most 1.02 with one microbatch, 1.03 with more.
  profile  after the timed rounds, one more step of stock and of the drop-in
           under torch.profiler (CUDA kernels and launch calls per step, GPU
           busy time: the kernels' summed durations) and one under cProfile
           (Python-level calls per step), with the kernels, kernel times and
           functions that differ most. Target: the drop-in launches no more
           kernels than stock.
  memory   bf16, stock and the drop-in, each alone: forward-held memory of the
           first microbatch (after its forward minus before), memory after
           the step (over what was allocated before the model was built) and
           the step's peak over its start. Target: the drop-in's forward-held
           and after-step memory at most bf16's (plus the recipe state after
           the step: scales and amax histories, no weight copy).

Losses are compared bit for bit: stock again against stock always; the
drop-in against stock where quantizing again reproduces forward's bytes
(not delayed scaling, whose scale moves between forward and backward).
``--dry-run`` prints the planned configurations and needs neither CUDA nor TE.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence

from . import _harness as h
from ._profile import profile_rows, profile_tables
from ._runner import Job, add_plan_options, run_main

NAME = "moe_step"
PARAMS = ("bf16", "quantized")
SECTIONS = ("timing", "profile", "memory")
#: The models of a timed case, in their first round's order; the second stock is the control.
ORDER = ("stock", "dropin", "stock_again")
DEFAULTS = {
    "recipes": (list(h.RECIPES), ["Float8CurrentScaling"]),
    "microbatches": ([1, 4], [4]),
    "params": (list(PARAMS), ["bf16"]),
    "sections": (list(SECTIONS), list(SECTIONS)),
    "layers": (4, 2),
    "experts": (32, 8),
    "hidden": (2048, 1024),
    "ffn": (1536, 768),
    "tokens": (16384, 4096),
    "steps": (12, 4),
    "warmup": (3, 1),
}
#: The issue's step-time targets: drop-in / stock with one microbatch, and with more.
TIME_LIMIT = {1: 1.02, "more": 1.03}
#: "At most bf16's" allows this much (allocator rounding, TE's small tensors).
BF16_SLACK_MIB = 1.0
#: Recipes whose weight quantization, done again, reproduces forward's bytes.
EXACT_REQUANTIZATION = ("Float8CurrentScaling", "Float8BlockScaling", "MXFP8BlockScaling")


@dataclasses.dataclass(frozen=True)
class Case:
    """One configuration: the stack's shape, the recipe, microbatches and parameter kind."""

    layers: int
    experts: int
    hidden: int
    ffn: int
    tokens: int
    recipe: str
    micro: int
    params: str

    def name(self) -> str:
        quantized = ", quantized params" if self.params == "quantized" else ""
        return f"{self.layers}L E{self.experts} {self.hidden}/{self.ffn} {self.recipe} x{self.micro}{quantized}"


def parser() -> argparse.ArgumentParser:
    p = h.base_parser(NAME, __doc__)
    p.add_argument("--recipes", type=h.csv_choices(h.RECIPES), help=f"comma-separated, from {', '.join(h.RECIPES)}")
    p.add_argument("--microbatches", type=h.int_list, help="microbatch counts (default 1,4)")
    p.add_argument("--params", type=h.csv_choices(PARAMS), help="comma-separated, from bf16, quantized")
    p.add_argument("--sections", type=h.csv_choices(SECTIONS), help=f"comma-separated, from {', '.join(SECTIONS)}")
    for name, what in (("layers", "MoE MLP layers"), ("experts", "experts per GroupedLinear"),
                       ("hidden", "hidden size"), ("ffn", "expert FFN size"), ("tokens", "tokens per microbatch")):
        p.add_argument(f"--{name}", type=h.positive_int, help=f"{what} (default {DEFAULTS[name][0]})")
    p.add_argument("--steps", type=h.positive_int, help="timed rounds (default 12)")
    p.add_argument("--warmup", type=int, help="untimed rounds before timing, steps before a memory probe")
    add_plan_options(p)
    return p


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    args = h.parse_args(parser(), argv, DEFAULTS)
    if args.tokens % 16:
        parser().error(f"--tokens must be a multiple of 16 (TE's FP8 grouped GEMMs); received {args.tokens}")
    return args


def cases(args: argparse.Namespace) -> list[Case]:
    return [Case(args.layers, args.experts, args.hidden, args.ffn, args.tokens, recipe, micro, params)
            for params in args.params for micro in args.microbatches for recipe in args.recipes]


def estimate_seconds(case: Case, steps: int, models: int) -> float:
    """Building, then per step the larger of a launch-bound floor (about 60
    us per expert GEMM pass) and the GEMMs at ~400 TFLOP/s, plus the optimizer."""
    params = 2 * case.layers * case.experts * case.hidden * case.ffn
    gemm_s = max(6 * case.layers * case.experts * 6e-5, 6 * case.tokens * params / case.experts / 4e14)
    return models * (1.0 + params / 4e8 + steps * (case.micro * gemm_s + params * 16 / 3e12))


# -- on the GPU ---------------------------------------------------------------------
def build(case: Case, variant: str):
    """The stack of ``case`` as ``variant`` (bf16, stock, dropin), from seed 0."""
    from testbed.moe_mlp import build_moe_mlp_stack
    from testbed.recipes import make_recipe

    fp8 = variant != "bf16"
    return build_moe_mlp_stack(case.layers, case.experts, case.hidden, case.ffn,
                               recipe=make_recipe(case.recipe) if fp8 else None, managed=variant == "dropin",
                               quantized_params=fp8 and case.params == "quantized")


def batches(case: Case, step: int) -> list:
    """Inputs and targets of one step, the same for every model."""
    from testbed.model import random_pair, rank

    return [random_pair(5_000 + 1_000 * step + 10 * m + rank(), (case.tokens, case.hidden)) for m in range(case.micro)]


def timed(case: Case, args: argparse.Namespace, dist) -> dict:
    """Stock, drop-in and stock again in turn, then the profiled steps (``_stack.paired``)."""
    from ._stack import Steps, paired

    builders = {label: (lambda v="dropin" if label == "dropin" else "stock": build(case, v)) for label in ORDER}
    steps = Steps(warmup=args.warmup, probe=0, timed=args.steps if "timing" in args.sections else 0,
                  micro=case.micro)
    result = paired(builders, case.recipe, lambda step: batches(case, step), steps, dist,
                    profile="profile" in args.sections, kernels=True)
    return result if "timing" in args.sections else {"profile": result["profile"]}


def memory(case: Case, variant: str, warmup: int) -> dict:
    """One model alone: ``warmup`` steps, then one probed step (``_stack.probe_model``)."""
    from ._stack import Steps, probe_model

    return probe_model(lambda: build(case, variant), case.recipe if variant != "bf16" else "bf16",
                       lambda step: batches(case, step), Steps(warmup=warmup, probe=1, timed=0))


def plan(args: argparse.Namespace, dist, world: int, total_gib: float) -> list[Job]:
    """Per case its timed job, then its memory jobs: stock and the drop-in,
    and bf16 once per microbatch count (its memory depends on nothing else)."""
    jobs, bf16_done = [], set()
    for case in cases(args):
        meta = {"case": case.name(), "spec": dataclasses.asdict(case)}
        if "timing" in args.sections or "profile" in args.sections:
            jobs.append(Job(label=f"[timing] {case.name()}", meta={**meta, "section": "timing"},
                            run=lambda c=case: timed(c, args, dist),
                            estimate_s=estimate_seconds(case, args.warmup + args.steps + 3, len(ORDER))))
        if "memory" not in args.sections:
            continue
        variants = ("stock", "dropin") if case.micro in bf16_done else ("bf16", "stock", "dropin")
        bf16_done.add(case.micro)
        jobs += [Job(label=f"[memory] {case.name()} {variant}", spec=case,
                     meta={**meta, "section": "memory", "variant": variant},
                     run=lambda c=case, v=variant: memory(c, v, args.warmup),
                     estimate_s=estimate_seconds(case, args.warmup + 1, 1)) for variant in variants]
    return jobs


# -- summary (pure: samples in, rows and tables out) ------------------------------
def summarize(samples: list[dict], args=None) -> dict:
    rows, timings, tables = [], [], []
    memory_cases: dict[str, dict] = {}
    bf16 = {s["spec"]["micro"]: s for s in samples if s["section"] == "memory" and s["variant"] == "bf16"}
    for s in samples:
        if s["section"] == "memory" and s["variant"] != "bf16":
            memory_cases.setdefault(s["case"], {"bf16": bf16.get(s["spec"]["micro"])})[s["variant"]] = s
    for s in samples:
        if s["section"] != "timing":
            continue
        if "step_time_s" in s:
            rows += timing_rows(s)
        timings += [{"case": s["case"], "variant": label.replace("_", " ").replace("dropin", "drop-in"),
                     "samples_ms": [1e3 * v for v in times]} for label, times in s.get("step_time_s", {}).items()]
        if s.get("profile"):
            rows += profile_rows(s)
            tables += profile_tables(s)
    for case, variants in memory_cases.items():
        rows += memory_rows(case, variants)
    return {"rows": rows, "timings": timings, "tables": tables}


def timing_rows(sample: dict) -> list[dict]:
    case, spec, t, losses = sample["case"], sample["spec"], sample["step_time_s"], sample["losses"]
    rows = [h.check_row(case, "losses identical (stock again / stock)", losses["stock_again"] == losses["stock"],
                        f"{len(losses['stock'])} losses")]
    same = losses["dropin"] == losses["stock"]
    if spec["recipe"] in EXACT_REQUANTIZATION and spec["params"] == "bf16":
        rows.append(h.check_row(case, "losses identical (drop-in / stock)", same, f"{len(losses['stock'])} losses"))
    else:
        gap = max((abs(a - b) for a, b in zip(losses["stock"], losses["dropin"])), default=0.0)
        rows.append({**h.check_row(case, "losses (drop-in / stock)", same, "identical" if same else
                                   f"largest difference {gap:.3g}: requantizing does not reproduce forward's bytes "
                                   "here (delayed scaling), or stock reads a stale transpose (D12)"),
                     "ok": None, "target": ""})
    limit = TIME_LIMIT[1] if spec["micro"] == 1 else TIME_LIMIT["more"]
    return rows + [h.time_row(case, t["stock"], t["dropin"], limit=limit),
                   h.control_row(case, t["stock"], t["stock_again"])]


def memory_rows(case: str, variants: dict) -> list[dict]:
    base, st, dr = variants.get("bf16"), variants.get("stock"), variants.get("dropin")
    if dr is None:
        return []
    b, s = base or {}, st or {}
    rows = [h.ratio_row(case, "forward-held, first microbatch", "MiB", s.get("held_mib"), dr["held_mib"],
                        limit=None, bf16=b.get("held_mib")),
            h.ratio_row(case, "after the step (over before build)", "MiB", s.get("after_step_mib"),
                        dr["after_step_mib"], limit=None, bf16=b.get("after_step_mib")),
            h.ratio_row(case, "peak over the step's start", "MiB", s.get("peak_over_start_mib"),
                        dr["peak_over_start_mib"], limit=None, bf16=b.get("peak_over_start_mib"),
                        note="reported; no target")]
    if base:
        held_bound = b["held_mib"] + BF16_SLACK_MIB
        step_bound = b["after_step_mib"] + BF16_SLACK_MIB + dr["quantizer_state_mib"]
        rows.append(h.bound_row(case, "forward-held <= bf16's", "MiB", dr["held_mib"], held_bound,
                                f"<= bf16 + {BF16_SLACK_MIB:g} MiB", stock=s.get("held_mib"), bf16=b["held_mib"]))
        rows.append(h.bound_row(case, "after the step <= bf16's", "MiB", dr["after_step_mib"], step_bound,
                                "<= bf16 + recipe state + 1 MiB", stock=s.get("after_step_mib"),
                                bf16=b["after_step_mib"]))
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    return run_main(NAME, parse(argv), argv, plan, summarize)


if __name__ == "__main__":
    sys.exit(main())
