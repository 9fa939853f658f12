"""The quantized FSDP2 all-gather (docs/decisions.md, D13) against stock TE:
step time, bytes all-gathered and memory, on the MoE stack and a dense stack.

    torchrun --nproc_per_node=N -m benchmarks.quantized_gather [--quick] [--out DIR]

N is the number of GPUs present (FSDP2 at world size N; 1 is a mesh of one
GPU). Stacks: ``moe`` is ``benchmarks.moe_step``'s (``--layers`` x
GroupedLinear(32, 2048, 1536) -> GELU -> GroupedLinear(32, 1536, 2048) +
residual, 16,384 tokens per microbatch routed unevenly, one parameter per
expert); ``dense`` is ``testbed.model``'s ``te.TransformerLayer`` stack at
the ``realistic`` size (hidden 4096, ffn 16384, seq 2048). bf16 parameters,
``fully_shard`` on every layer and the root, ``torch.optim.AdamW(fused=True)``
for every model (the quantized gather keeps the parameters plain tensors for
any torch optimizer; TE's FusedAdam with master weights is not used here).
"gather" is the drop-in model with the FSDP2 policy pinned with
``QuantizedGather.ON`` (at world size 1 the default rule makes workspaces in
the call) and ``te_integration.enable_quantized_gather``. Per stack, recipe
and microbatch count:

  timing   stock, gather and stock again (the control), alive together and
           stepped in turn; the median of per-round ratios with its spread.
           Targets: gather / stock at most 0.97 with 4 microbatches and 1.00
           with 1.
  profile  after the timed rounds, one more step of stock and of gather
           under torch.profiler and cProfile (``benchmarks._profile``):
           kernels, launches, GPU busy time and Python-level calls per step,
           and the kernels and functions that differ most.
  bytes    one step of stock and of gather, counting the bytes FSDP2's
           all-gathers hand the rank (``testbed.gather.GatheredBytes``).
           Target: gather / stock at most 0.53.
  memory   bf16, stock and gather, each alone: the step's peak over its start
           and the memory held between steps (over what was allocated
           before the model was built). Target: gather's peak at most
           stock's; held memory reported against bf16's.
  fp8_params  (MoE stack; not in the default sections) TE's own FP8
           parameters (``te.quantized_model_init``: each rank quantizes its
           shard once per step and FSDP2 gathers FP8) against stock with
           bf16 parameters, both with TE's FusedAdam and fp32 master
           weights (FP8 parameters need it), and stock again: the step
           time the issue's targets were set from, measured beside the
           gather's. No target.

A table then projects the measured bytes per parameter (gathered per
all-gather, and held by the quantized shard, from the largest case run) to a
dense 70B-class model and a large MoE model at world sizes 8 and 64
(:data:`PROJECTED`): computed, not measured, and labelled so.

DelayedScaling is made in the call (D13): its gather setup leaves every
weight out, so its "gather" model is the default drop-in, measured the same
way. ``--dry-run`` prints the planned configurations without CUDA or TE.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import weakref
from collections.abc import Sequence

from . import _harness as h
from ._profile import profile_rows, profile_tables
from ._runner import Job, add_plan_options, run_main

NAME = "quantized_gather"
STACKS = ("moe", "dense")
SECTIONS = ("timing", "profile", "bytes", "memory", "fp8_params")
ORDER = ("stock", "dropin", "stock_again")
DEFAULTS = {
    "stacks": (list(STACKS), ["moe"]),
    "recipes": (list(h.RECIPES), ["Float8CurrentScaling"]),
    "microbatches": ([1, 4], [4]),
    "sections": (["timing", "bytes", "memory"], ["timing", "bytes", "memory"]),
    "layers": (4, 2),
    "steps": (20, 4),
    "warmup": (3, 1),
}
#: The issue's targets: step time gather / stock, by microbatch count; bytes gathered.
TIME_LIMIT = {1: 1.00, "more": 0.97}
BYTES_LIMIT = 0.53
LR = 1e-4
#: TE picks deterministic attention kernels only where this is "0": without
#: it the dense stack's losses differ run to run, stock against stock included.
DETERMINISTIC_ENV = "NVTE_ALLOW_NONDETERMINISTIC_ALGO"
#: Models the table projects to: (name, parameters, layers), 4 microbatches, resharded after forward.
PROJECTED = (("dense 70B-class (80 layers)", 70.6e9, 80), ("MoE 235B-class (94 layers)", 235e9, 94))
PROJECTED_WORLDS = (8, 64)
PROJECTED_MICRO = 4
GIB = 2**30
#: What enable_quantized_gather set up, per drop-in model built here.
_SETUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclasses.dataclass(frozen=True)
class Case:
    stack: str
    layers: int
    recipe: str
    micro: int

    def name(self) -> str:
        return f"{self.stack} {self.layers}L {self.recipe} x{self.micro}"


def parser() -> argparse.ArgumentParser:
    p = h.base_parser(NAME, __doc__)
    p.add_argument("--stacks", type=h.csv_choices(STACKS), help="comma-separated, from moe, dense")
    p.add_argument("--recipes", type=h.csv_choices(h.RECIPES), help=f"comma-separated, from {', '.join(h.RECIPES)}")
    p.add_argument("--microbatches", type=h.int_list, help="microbatch counts (default 1,4)")
    p.add_argument("--sections", type=h.csv_choices(SECTIONS), help=f"comma-separated, from {', '.join(SECTIONS)}")
    p.add_argument("--layers", type=h.positive_int, help="layers of each stack (default 4)")
    p.add_argument("--steps", type=h.positive_int, help="timed rounds (default 20)")
    p.add_argument("--warmup", type=int, help="untimed rounds before timing, steps before a memory probe")
    add_plan_options(p)
    return p


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    return h.parse_args(parser(), argv, DEFAULTS)


def cases(args: argparse.Namespace) -> list[Case]:
    return [Case(stack, args.layers, recipe, micro)
            for stack in args.stacks for micro in args.microbatches for recipe in args.recipes]


def estimate_seconds(case: Case, steps: int, models: int) -> float:
    """Building, then per step about 45 ms (moe) or 60 ms (dense) per layer
    and microbatch on an H200 (the moe_step and step_time results)."""
    per = 0.045 if case.stack == "moe" else 0.06
    return models * (2.0 + steps * (case.micro * case.layers * per + 0.01 * case.layers))


# -- on the GPU ---------------------------------------------------------------------
def build(case: Case, variant: str):
    """The stack of ``case`` as ``variant`` (bf16, stock, dropin: the drop-in
    with the quantized all-gather), from seed 0."""
    from testbed.recipes import make_recipe

    recipe = make_recipe(case.recipe) if variant != "bf16" else None
    managed = variant == "dropin"
    if case.stack == "moe":
        from testbed.moe_mlp import build_moe_mlp_stack

        model = build_moe_mlp_stack(case.layers, 32, 2048, 1536, recipe=recipe, managed=managed)
    else:
        from testbed.model import build_stack

        from ._stack import SIZES

        s = SIZES["realistic"]
        model = build_stack(s.hidden, s.ffn, s.heads, case.layers, recipe=recipe, managed=managed)
    if managed:
        from testbed.gather import enable_on

        _SETUPS[model] = enable_on(model, recipe)
    return model


def optimizer(model):
    import torch

    return torch.optim.AdamW(model.parameters(), lr=LR, fused=True)


def batches(case: Case, step: int) -> list:
    """Inputs and targets of one step, the same for every model."""
    from testbed.model import random_pair, rank

    from ._stack import SIZES

    if case.stack == "moe":
        shape = (16384, 2048)
    else:
        s = SIZES["realistic"]
        shape = (s.seq, s.batch, s.hidden)
    return [random_pair(7_000 + 1_000 * step + 10 * m + rank(), shape) for m in range(case.micro)]


def timed(case: Case, args: argparse.Namespace, dist) -> dict:
    from ._stack import Steps, paired

    builders = {label: (lambda v="dropin" if label == "dropin" else "stock": build(case, v)) for label in ORDER}
    steps = Steps(warmup=args.warmup, probe=0, timed=args.steps if "timing" in args.sections else 0,
                  micro=case.micro)
    profile = "profile" in args.sections
    result = paired(builders, case.recipe, lambda step: batches(case, step), steps, dist, optimizer=optimizer,
                    profile=profile, kernels=profile)
    return result if "timing" in args.sections else {"profile": result["profile"]}


def fp8_params_timed(case: Case, args: argparse.Namespace, dist) -> dict:
    """Stock with bf16 parameters, stock with FP8 parameters and stock
    again, in turn, each with TE's FusedAdam (fp32 master weights)."""
    from testbed.model import optimizer_for
    from testbed.moe_mlp import build_moe_mlp_stack
    from testbed.recipes import make_recipe

    from ._stack import Steps, paired

    def stack(quantized: bool):
        return build_moe_mlp_stack(case.layers, 32, 2048, 1536, recipe=make_recipe(case.recipe),
                                   quantized_params=quantized)

    builders = {"stock": lambda: stack(False), "stock_fp8_params": lambda: stack(True),
                "stock_again": lambda: stack(False)}
    steps = Steps(warmup=args.warmup, probe=0, timed=args.steps, micro=case.micro)
    try:
        return paired(builders, case.recipe, lambda step: batches(case, step), steps, dist, optimizer=optimizer_for)
    except Exception as exc:  # noqa: BLE001 - TE's own path failing is this section's finding, recorded as such
        return {"te_failed": f"{type(exc).__name__}: {exc}"}


def gathered(case: Case, args: argparse.Namespace) -> dict:
    """Bytes the all-gathers of one step hand this rank, stock and gather,
    after ``args.warmup`` steps of each (each model alone)."""
    from testbed.gather import GatheredBytes
    from testbed.model import release_memory
    from testbed.recipes import make_recipe

    from ._stack import run_step

    out, held = {}, 0
    for variant in ("stock", "dropin"):
        release_memory()
        model = build(case, variant)
        opt, recipe = optimizer(model), make_recipe(case.recipe)
        for step in range(max(1, args.warmup)):
            run_step(model, opt, recipe, batches(case, step))
        with GatheredBytes() as counted:
            run_step(model, opt, recipe, batches(case, 100))
        out[variant] = counted.bytes
        params = sum(p.numel() for p in model.parameters())
        setup = _SETUPS.get(model)
        if setup is not None and setup.state is not None:
            held = setup.state.held_bytes()
        del model, opt, setup
    release_memory()
    # Each rank receives every parameter at every gather: forward and backward of each microbatch.
    import torch.distributed as dist

    return {"gathered_bytes": out, "parameters": params, "gathers": 2 * case.micro, "shard_bytes": held,
            "world_size": dist.get_world_size()}


def memory(case: Case, variant: str, warmup: int) -> dict:
    from ._stack import Steps, probe_model

    return probe_model(lambda: build(case, variant), case.recipe if variant != "bf16" else "bf16",
                       lambda step: batches(case, step), Steps(warmup=warmup, probe=1, timed=0, micro=case.micro),
                       optimizer=optimizer)


def plan(args: argparse.Namespace, dist, world: int, total_gib: float) -> list[Job]:
    jobs = []
    for case in cases(args):
        meta = {"case": case.name(), "spec": dataclasses.asdict(case)}
        if "timing" in args.sections or "profile" in args.sections:
            jobs.append(Job(label=f"[timing] {case.name()}", meta={**meta, "section": "timing"},
                            run=lambda c=case: timed(c, args, dist),
                            estimate_s=estimate_seconds(case, args.warmup + args.steps, len(ORDER))))
        if "fp8_params" in args.sections and case.stack == "moe":
            jobs.append(Job(label=f"[fp8_params] {case.name()}", meta={**meta, "section": "fp8_params"},
                            run=lambda c=case: fp8_params_timed(c, args, dist),
                            estimate_s=estimate_seconds(case, args.warmup + args.steps, 3)))
        if "bytes" in args.sections:
            jobs.append(Job(label=f"[bytes] {case.name()}", meta={**meta, "section": "bytes"},
                            run=lambda c=case: gathered(c, args), estimate_s=estimate_seconds(case, 2, 2)))
        if "memory" in args.sections:
            jobs += [Job(label=f"[memory] {case.name()} {v}", meta={**meta, "section": "memory", "variant": v},
                         run=lambda c=case, v=v: memory(c, v, args.warmup),
                         estimate_s=estimate_seconds(case, args.warmup + 1, 1)) for v in ("bf16", "stock", "dropin")]
    return jobs


# -- summary (pure: samples in, rows out) -------------------------------------------
def summarize(samples: list[dict], args=None) -> dict:
    rows, timings, memories, tables = [], [], {}, []
    for s in samples:
        if s["section"] == "timing":
            if "step_time_s" in s:
                rows += timing_rows(s)
                timings += [{"case": s["case"], "variant": {"dropin": "gather"}.get(label, label.replace("_", " ")),
                             "samples_ms": [1e3 * v for v in times]} for label, times in s["step_time_s"].items()]
            if s.get("profile"):
                rows += profile_rows(s)
                tables += profile_tables(s)
        elif s["section"] == "fp8_params":
            rows += fp8_params_rows(s)
            timings += [{"case": s["case"], "variant": label.replace("_", " ") + " (FusedAdam)",
                         "samples_ms": [1e3 * v for v in times]} for label, times in s.get("step_time_s", {}).items()]
        elif s["section"] == "bytes":
            b = s["gathered_bytes"]
            rows.append(h.ratio_row(s["case"], "bytes all-gathered per step", "MiB", b["stock"] / h.MIB,
                                    b["dropin"] / h.MIB, limit=BYTES_LIMIT))
        else:
            memories.setdefault(s["case"], {})[s["variant"]] = s
    for case, variants in memories.items():
        rows += memory_rows(case, variants)
    sized = [s for s in samples if s["section"] == "bytes" and s.get("shard_bytes")]
    tables += [projection_table(max(sized, key=lambda s: s["parameters"]))] if sized else []
    return {"rows": rows, "timings": timings, "tables": tables}


def per_parameter(sample: dict) -> dict:
    """Measured bytes per parameter: received per all-gather (stock, gather)
    and held by the quantized shard (per parameter of this rank's shard
    times the world size, i.e. per parameter of the model at world 1)."""
    params, gathers = sample["parameters"], sample["gathers"]
    b = sample["gathered_bytes"]
    world = sample["world_size"]
    return {"stock": b["stock"] / (params * gathers), "gather": b["dropin"] / (params * gathers),
            "shard": sample["shard_bytes"] * world / params}


def projection_table(sample: dict) -> dict:
    """Per-rank figures of :data:`PROJECTED` models, computed from
    :func:`per_parameter` of ``sample`` (measured)."""
    m = per_parameter(sample)
    rows = []
    for name, params, layers in PROJECTED:
        for world in PROJECTED_WORLDS:
            gathered = lambda per: per * params * 2 * PROJECTED_MICRO / GIB  # noqa: E731
            rows.append([name, world, f"{2 * params / world / GIB:.1f}", f"{m['shard'] * params / world / GIB:.2f}",
                         f"{gathered(m['stock']):.0f}", f"{gathered(m['gather']):.0f}",
                         f"{3 * params / layers / GIB:.2f}", f"{params / layers / GIB:.2f}"])
    note = (f"Computed, not measured: from the bytes per parameter measured in '{sample['case']}' "
            f"(per all-gather: stock {m['stock']:.4f}, gather {m['gather']:.4f}; quantized shard held "
            f"{m['shard']:.4f} per parameter over the world), {PROJECTED_MICRO} microbatches, "
            "reshard_after_forward=True (two all-gathers a microbatch). bf16 shard: 2 bytes per parameter over "
            "the world (both). Forward transient per layer: stock gathers bf16 (2 bytes) and quantizes it "
            "(1 byte); the gather's gathered FP8 (1 byte) is the workspace. Optimizer state is not counted.")
    return {"title": "Projected per rank (computed from measured bytes per parameter)",
            "columns": ["model", "world", "bf16 shard GiB", "quantized shard GiB (gather)",
                        "all-gathered GiB per step, stock", "all-gathered GiB per step, gather",
                        "forward transient per layer GiB, stock", "forward transient per layer GiB, gather"],
            "rows": rows, "note": note}


def timing_rows(sample: dict) -> list[dict]:
    case, spec, t, losses = sample["case"], sample["spec"], sample["step_time_s"], sample["losses"]
    limit = TIME_LIMIT[1] if spec["micro"] == 1 else TIME_LIMIT["more"]
    comparable = spec["stack"] != "dense" or os.environ.get(DETERMINISTIC_ENV) == "0"
    n = len(losses["stock"])
    rows = [_losses_row(case, "losses identical (stock again / stock)", losses["stock_again"] == losses["stock"], n,
                        comparable)]
    if spec["recipe"] != "DelayedScaling":
        rows.append(_losses_row(case, "losses identical (gather / stock)", losses["dropin"] == losses["stock"], n,
                                comparable))
    return rows + [h.time_row(case, t["stock"], t["dropin"], limit=limit),
                   h.control_row(case, t["stock"], t["stock_again"])]


def fp8_params_rows(sample: dict) -> list[dict]:
    """FP8 parameters / bf16 parameters, stock TE and FusedAdam both; no
    target. Where TE's own FP8-parameter training failed, the row says how."""
    case = sample["case"] + " FusedAdam"
    metric = "median step time, stock FP8 parameters / stock bf16 parameters"
    if "te_failed" in sample:
        return [h.ratio_row(case, metric, "ms", None, None, limit=None,
                            note=f"TE's FP8-parameter training failed here: {sample['te_failed'][:300]}")]
    t = sample["step_time_s"]
    row = h.time_row(case, t["stock"], t["stock_fp8_params"], limit=None)
    row.update(metric=metric,
               note=row["note"] + "; TE's own FP8-parameter path (quantized_model_init), no target")
    return [row, h.control_row(case, t["stock"], t["stock_again"])]


def _losses_row(case: str, metric: str, same: bool, n: int, comparable: bool) -> dict:
    """A losses check; reported without a target where the stack's own
    kernels may differ run to run (two stock models then differ too)."""
    row = h.check_row(case, metric, same, f"{n} losses")
    if not comparable:
        row.update(ok=None, target="", note=f"{n} losses; no target: the dense stack's attention may run "
                   f"nondeterministic kernels unless {DETERMINISTIC_ENV}=0, and then stock differs from stock "
                   "too (tests/gpu/test_quantized_gather.py compares the dense kinds bit for bit)")
    return row


def memory_rows(case: str, variants: dict) -> list[dict]:
    b, s, d = (variants.get(k) or {} for k in ("bf16", "stock", "dropin"))
    if not d:
        return []
    return [h.ratio_row(case, "peak over the step's start", "MiB", s.get("peak_over_start_mib"),
                        d["peak_over_start_mib"], limit=1.0, bf16=b.get("peak_over_start_mib")),
            h.ratio_row(case, "held between steps (over before build)", "MiB", s.get("after_step_mib"),
                        d["after_step_mib"], limit=None, bf16=b.get("after_step_mib"),
                        note="reported against bf16's: the quantized shard, 1 byte per parameter per rank")]


def main(argv: Sequence[str] | None = None) -> int:
    return run_main(NAME, parse(argv), argv, plan, summarize)


if __name__ == "__main__":
    sys.exit(main())
