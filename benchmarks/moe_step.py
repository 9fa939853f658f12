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
           stepped in turn; median step time over ``--steps`` rounds. Target:
           drop-in / stock at most 1.02 with one microbatch, 1.03 with more.
  profile  after the timed rounds, one more step of stock and of the drop-in
           under torch.profiler (CUDA kernels and launch calls per step, GPU
           busy time: the kernels' summed durations; tables of the kernels
           whose counts and times differ most) and one under cProfile
           (Python-level calls per step; tables of the functions whose call
           counts differ most and of the drop-in's own time by function).
           Target: the drop-in launches no more kernels than stock.
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
import os
import sys
from collections.abc import Sequence

from . import _harness as h
from . import _moe_step as run
from ._moe_step import ORDER
from ._profile import added_calls_table, largest_differences, own_time_table
from ._runner import Job, gpu_main

NAME = "moe_step"
PARAMS = ("bf16", "quantized")
SECTIONS = ("timing", "profile", "memory")
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

    def time_limit(self) -> float:
        return TIME_LIMIT[1] if self.micro == 1 else TIME_LIMIT["more"]


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
    p.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="skip the remaining configurations once this much time has passed (recorded as skipped)")
    p.add_argument("--dry-run", action="store_true", help="print the planned configurations and exit")
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


def plan(args: argparse.Namespace, dist, world: int, total_gib: float) -> list[Job]:
    """Per case its timed job, then its memory jobs: stock and the drop-in,
    and bf16 once per microbatch count (its memory depends on nothing else)."""
    jobs, bf16_done = [], set()
    for case in cases(args):
        meta = {"case": case.name(), "spec": dataclasses.asdict(case)}
        if "timing" in args.sections or "profile" in args.sections:
            jobs.append(Job(label=f"[timing] {case.name()}", meta={**meta, "section": "timing"},
                            run=lambda c=case: run.timed(c, args, dist),
                            estimate_s=estimate_seconds(case, args.warmup + args.steps + 3, len(ORDER))))
        if "memory" not in args.sections:
            continue
        variants = ("stock", "dropin") if case.micro in bf16_done else ("bf16", "stock", "dropin")
        bf16_done.add(case.micro)
        jobs += [Job(label=f"[memory] {case.name()} {variant}", spec=case,
                     meta={**meta, "section": "memory", "variant": variant},
                     run=lambda c=case, v=variant: run.memory(c, v, args.warmup),
                     estimate_s=estimate_seconds(case, args.warmup + 1, 1)) for variant in variants]
    return jobs


# -- summary (pure: samples in, rows and tables out) ------------------------------
def summarize(samples: list[dict], args=None) -> dict:
    rows, timings, tables = [], [], []
    memory: dict[str, dict] = {}
    bf16 = {s["spec"]["micro"]: s for s in samples if s["section"] == "memory" and s["variant"] == "bf16"}
    for s in samples:
        if s["section"] == "memory" and s["variant"] != "bf16":
            memory.setdefault(s["case"], {"bf16": bf16.get(s["spec"]["micro"])})[s["variant"]] = s
    for s in samples:
        if s["section"] != "timing":
            continue
        if "step_time_s" in s:
            rows += timing_rows(s)
        timings += [{"case": s["case"], "variant": label.replace("_", " ").replace("dropin", "drop-in"),
                     "samples_ms": [1e3 * v for v in times]} for label, times in s.get("step_time_s", {}).items()]
        if s.get("profile"):
            rows += profile_rows(s)
            tables += [kernel_table(s), *kernel_time_table(s), *host_tables(s)]
    for case, variants in memory.items():
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


def profile_rows(sample: dict) -> list[dict]:
    case, p = sample["case"], sample["profile"]
    st, dr = p["stock"], p["dropin"]
    return [h.ratio_row(case, "CUDA kernels per step", "", st["kernels"], dr["kernels"], limit=1.0),
            h.ratio_row(case, "kernel launch calls per step", "", st["launch_calls"], dr["launch_calls"], limit=None),
            h.ratio_row(case, "GPU busy per step (kernels' summed time)", "ms", st["busy_ms"], dr["busy_ms"],
                        limit=None),
            h.ratio_row(case, "Python-level calls per step", "", st["python_calls"], dr["python_calls"], limit=None)]


def kernel_table(sample: dict, top: int = 12) -> dict:
    """The kernels whose counts per step differ most, drop-in minus stock."""
    st, dr = sample["profile"]["stock"]["by_kernel"], sample["profile"]["dropin"]["by_kernel"]
    rows = [[k[:90], st.get(k, 0), dr.get(k, 0), f"{d:+d}"] for d, k in largest_differences(st, dr, top) if d]
    return {"title": f"{sample['case']}: kernels per step, drop-in against stock",
            "columns": ["kernel", "stock", "drop-in", "added"], "rows": rows,
            "note": f"the {top} largest differences in one profiled step"}


def kernel_time_table(sample: dict, top: int = 12) -> list[dict]:
    """The kernels whose summed GPU time per step differs most, drop-in
    minus stock: where the drop-in's GPU busy time goes (none where the
    sample predates per-kernel times)."""
    st, dr = sample["profile"]["stock"].get("busy_by"), sample["profile"]["dropin"].get("busy_by")
    if st is None or dr is None:
        return []
    rows = [[k[:90], f"{st.get(k, 0.0):.2f}", f"{dr.get(k, 0.0):.2f}", f"{d:+.2f}"]
            for d, k in largest_differences(st, dr, top)]
    total = sum(dr.values()) - sum(st.values())
    return [{"title": f"{sample['case']}: GPU time per kernel (ms per step), drop-in against stock",
             "columns": ["kernel", "stock", "drop-in", "added"], "rows": rows,
             "note": f"the {top} largest differences in one profiled step; GPU busy added in all: {total:+.2f} ms"}]


def host_tables(sample: dict) -> list[dict]:
    """Where the host time of the profiled step goes: the functions whose
    Python-level call counts differ most, and the drop-in's own time by
    function (none where the sample predates these fields)."""
    st, dr = sample["profile"]["stock"], sample["profile"]["dropin"]
    if "calls_by" not in st or "calls_by" not in dr:
        return []
    case = sample["case"]
    return [added_calls_table(f"{case}: Python-level calls per step, drop-in against stock", st["calls_by"],
                              dr["calls_by"], top=20),
            own_time_table(f"{case}: own time per function in the profiled step", st["own_by"], dr["own_by"])]


def memory_rows(case: str, variants: dict) -> list[dict]:
    base, st, dr = variants.get("bf16"), variants.get("stock"), variants.get("dropin")
    if dr is None:
        return []
    b, s = base or {}, st or {}
    held_bound = b["held_mib"] + BF16_SLACK_MIB if base else None
    step_bound = b["after_step_mib"] + BF16_SLACK_MIB + dr["recipe_state_mib"] if base else None
    rows = [h.ratio_row(case, "forward-held, first microbatch", "MiB", s.get("held_mib"), dr["held_mib"],
                        limit=None, bf16=b.get("held_mib")),
            h.ratio_row(case, "after the step (over before build)", "MiB", s.get("after_step_mib"),
                        dr["after_step_mib"], limit=None, bf16=b.get("after_step_mib")),
            h.ratio_row(case, "peak over the step's start", "MiB", s.get("peak_mib"), dr["peak_mib"], limit=None,
                        bf16=b.get("peak_mib"), note="reported; no target")]
    if base:
        rows.append(h.bound_row(case, "forward-held <= bf16's", "MiB", dr["held_mib"], held_bound,
                                f"<= bf16 + {BF16_SLACK_MIB:g} MiB", stock=s.get("held_mib"), bf16=b["held_mib"]))
        rows.append(h.bound_row(case, "after the step <= bf16's", "MiB", dr["after_step_mib"], step_bound,
                                "<= bf16 + recipe state + 1 MiB", stock=s.get("after_step_mib"),
                                bf16=b["after_step_mib"]))
    return rows


def dry_run(args: argparse.Namespace) -> int:
    jobs = plan(args, None, int(os.environ.get("WORLD_SIZE", "1") or 1), 141.0)
    for job in jobs:
        print(f"{job.label}  (about {job.estimate_s:.1f} s)")
    print(f"{len(jobs)} configuration(s), about {sum(j.estimate_s for j in jobs):.0f} s")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    if args.dry_run:
        return dry_run(args)
    rc = gpu_main(NAME, args, argv, plan, summarize)
    h.print_result(NAME, args.out, args.tag)
    return rc


if __name__ == "__main__":
    sys.exit(main())
