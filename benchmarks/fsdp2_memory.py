"""FSDP2 memory and step time: a ``te.TransformerLayer`` stack, stock TE vs
drop-in vs bf16, for each sm_90 recipe x {bf16 params, quantized_model_init}.

    torchrun --nproc_per_node=2 -m benchmarks.fsdp2_memory [--quick]

Sizes: ``leak`` (TE's leak-test model: hidden 256, ffn 1024, 8 heads, seq
32, batch 2, 8 layers) and ``realistic`` (hidden 4096, ffn 16384, 32 heads,
seq 2048, batch 1, as many layers as fit in ``--memory-budget-gib``). A
depth sweep (2, 4, 8, 16 layers of the leak model) shows how memory grows
with depth. Per model: peak allocated and allocated after the step (over
what was allocated before the model was built), the per-layer forward
increment, the backward delta as TE's leak tests measure it (after backward
minus after forward) and what forward+backward keeps (after backward minus
before forward), and the median step time with its spread.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from . import _harness as h
from ._runner import Job, gpu_main
from ._stack import SIZES, ModelSpec, Size, Steps, auto_layers, estimate_seconds, measure

NAME = "fsdp2_memory"
DEFAULTS = {
    "recipes": (list(h.RECIPES), list(h.RECIPES)),
    "sizes": (["leak", "realistic"], ["leak"]),
    "inits": (list(h.INITS), list(h.INITS)),
    "steps": (10, 3),
    "warmup": (3, 1),
    "probes": (3, 1),
    "depths": ([2, 4, 8, 16], [2, 4]),
    "depth_recipes": (list(h.RECIPES), ["Float8CurrentScaling"]),
    "memory_budget_gib": (100.0, 100.0),
    "max_layers": (64, 64),
}


def parser() -> argparse.ArgumentParser:
    p = h.make_parser(NAME, __doc__)
    p.add_argument("--inits", type=h.csv_choices(h.INITS), help="bf16 (bf16 params), qinit (quantized_model_init)")
    p.add_argument("--probes", type=h.positive_int, help="memory-probe steps per model, after warm-up")
    p.add_argument("--depths", type=h.int_list, help="layer counts of the depth sweep (leak model)")
    p.add_argument("--depth-recipes", type=h.csv_choices(h.RECIPES), help="recipes of the depth sweep")
    p.add_argument("--no-depth-sweep", action="store_true", help="skip the depth sweep")
    p.add_argument("--memory-budget-gib", type=float, help="memory per GPU the realistic model may fill")
    p.add_argument("--max-layers", type=h.positive_int, help="upper bound on the realistic model's layers")
    return p


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    return h.parse_args(parser(), argv, DEFAULTS)


def case_label(size: Size, layers: int, recipe: str, init: str | None = None) -> str:
    label = f"{size.name} {layers}L {recipe}"
    return f"{label} {h.INIT_LABELS[init]}" if init else label


def layers_for(size: Size, args: argparse.Namespace, world: int, total_gib: float) -> int:
    if args.layers:
        return args.layers
    if size.name == "realistic":
        return auto_layers(size, world, args.memory_budget_gib, total_gib, args.max_layers)
    return size.layers


def case_specs(section: str, size: Size, layers: int, recipes: Sequence[str],
               inits: Sequence[str]) -> list[tuple[dict, ModelSpec]]:
    """The bf16 baseline, then stock and drop-in per recipe x init. The order
    of stock and drop-in alternates from case to case, so neither always
    runs first."""
    out = [({"section": section, "case": case_label(size, layers, "bf16"), "init": "bf16"},
            ModelSpec(size=size, layers=layers))]
    i = 0
    for recipe in recipes:
        for init in inits:
            meta = {"section": section, "case": case_label(size, layers, recipe, init), "init": init}
            for managed in ((False, True) if i % 2 == 0 else (True, False)):
                out.append((meta, ModelSpec(size=size, layers=layers, recipe=recipe, managed=managed,
                                            quantized_init=init == "qinit")))
            i += 1
    return out


def plan(args: argparse.Namespace, dist, world: int, total_gib: float) -> list[Job]:
    """The sizes' cases, then the depth sweep (memory only; a depth model
    already measured in the sizes' cases is not measured again)."""
    specs: list[tuple[dict, ModelSpec]] = []
    for name in args.sizes:
        size = SIZES[name]
        specs += case_specs("sizes", size, layers_for(size, args, world, total_gib), args.recipes, args.inits)
    if not args.no_depth_sweep:
        seen = {spec for _, spec in specs}
        recipes = [r for r in args.depth_recipes if r in args.recipes]
        for depth in args.depths:
            specs += [(m, s) for m, s in case_specs("depth", SIZES["leak"], depth, recipes, ["bf16"]) if s not in seen]
    steps = Steps(warmup=args.warmup, probe=args.probes, timed=args.steps)
    depth_steps = Steps(warmup=args.warmup, probe=args.probes, timed=1)  # memory only: one timed step
    jobs = []
    for meta, spec in specs:
        mine = steps if meta["section"] == "sizes" else depth_steps
        jobs.append(Job(label=f"[{meta['section']}] {spec.label()}", meta=meta, spec=spec,
                        run=lambda spec=spec, mine=mine: measure(spec, mine, dist),
                        estimate_s=estimate_seconds(spec, mine)))
    return jobs


# -- summary (pure) ----------------------------------------------------------------
def _group(samples: list[dict]) -> tuple[dict, dict]:
    """Samples by (section, case) -> {variant: sample}, and the bf16
    baselines by (section, size, layers)."""
    cases: dict[tuple, dict] = {}
    bf16: dict[tuple, dict] = {}
    for s in samples:
        spec = s["spec"]
        if s["variant"] == "bf16":
            bf16[(s["section"], spec["size"], spec["layers"])] = s
        else:
            cases.setdefault((s["section"], s["case"]), {})[s["variant"]] = s
    return cases, bf16


def losses_row(case: str, st: dict, dr: dict) -> dict:
    a, b = st["losses"], dr["losses"]
    if a == b:
        return h.check_row(case, "losses identical to stock", True, f"{len(a)} steps, bit for bit")
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    detail = f"first difference at step {first}" + (f": {a[first]!r} vs {b[first]!r}" if first < min(len(a), len(b))
                                                   else f" (lengths {len(a)} and {len(b)})")
    return h.check_row(case, "losses identical to stock", False, detail)


def memory_rows(case: str, st: dict, dr: dict, base: dict | None) -> list[dict]:
    """Peak and after-step (<= stock), the forward increment (<= bf16 + 50
    KiB), and the two backward measures (reported, no target)."""
    b = base or {}
    rows = [h.ratio_row(case, "peak allocated over baseline", "MiB", st["peak_mib"], dr["peak_mib"],
                        bf16=b.get("peak_mib")),
            h.ratio_row(case, "allocated after step over baseline", "MiB", st["after_step_mib"],
                        dr["after_step_mib"], bf16=b.get("after_step_mib"))]
    fwd = dr.get("fwd_kib_per_layer")
    if base is not None and base.get("fwd_kib_per_layer") is not None and fwd is not None:
        bound = base["fwd_kib_per_layer"] + h.FWD_KIB_OVER_BF16_MAX
        rows.append(h.bound_row(case, "forward increment per layer", "KiB", fwd, bound,
                                f"<= bf16 + {h.FWD_KIB_OVER_BF16_MAX:.0f} KiB ({bound:.1f})",
                                stock=st.get("fwd_kib_per_layer"), bf16=base["fwd_kib_per_layer"]))
    else:
        rows.append(h.ratio_row(case, "forward increment per layer", "KiB", st.get("fwd_kib_per_layer"), fwd,
                                limit=None, note="no bf16 baseline in this run"))
    rows.append(h.ratio_row(case, "backward delta (TE: after bwd - after fwd)", "MiB", st["bwd_mib"],
                            dr["bwd_mib"], limit=None, bf16=b.get("bwd_mib"),
                            note="offset by what forward saved; see kept after backward"))
    rows.append(h.ratio_row(case, "kept after backward (after bwd - before fwd)", "MiB", st["kept_after_bwd_mib"],
                            dr["kept_after_bwd_mib"], limit=None, bf16=b.get("kept_after_bwd_mib")))
    return rows


def attribution_rows(case: str, st: dict, dr: dict, base: dict | None) -> list[dict]:
    """Issue 6: from workspace_report at the probe marks. No workspace the
    plan frees may be alive after the step; the forward allocation over
    bf16 is split into live workspaces and the rest (activations)."""
    if dr.get("workspace_after_fwd_mib") is None:
        return []
    left = dr.get("leftover_workspaces") or []
    rows = [h.check_row(case, "workspaces the plan frees are gone after the step", not any(left),
                        f"leftovers per probed step: {left}", target="0 after every probed step"),
            h.ratio_row(case, "live workspaces after forward (workspace_report)", "MiB",
                        st.get("workspace_after_fwd_mib"), dr["workspace_after_fwd_mib"], limit=None,
                        bf16=(base or {}).get("workspace_after_fwd_mib"))]
    if base is not None and base.get("fwd_total_mib") is not None:
        def rest(v: dict) -> float | None:
            if v.get("fwd_total_mib") is None or v.get("workspace_after_fwd_mib") is None:
                return None
            return v["fwd_total_mib"] - base["fwd_total_mib"] - v["workspace_after_fwd_mib"]

        rows.append(h.ratio_row(case, "forward allocation over bf16, less live workspaces", "MiB", rest(st), rest(dr),
                                limit=None, note="what the workspaces do not explain: saved activations "
                                                 "in another format"))
    return rows


def quantization_row(case: str, st: dict, dr: dict, *, strict: bool = False, limit: float | None = None) -> dict:
    q_st, q_dr = h.mean(st.get("quantizations_per_step") or []), h.mean(dr.get("quantizations_per_step") or [])
    return h.ratio_row(case, "weight quantizations per step", "", q_st, q_dr, limit=limit, strict=strict)


def timing_entries(case: str, samples: dict) -> list[dict]:
    return [{"case": case, "variant": h.VARIANT_LABELS[v], "samples_ms": [1e3 * t for t in s.get("step_time_s") or []]}
            for v, s in samples.items()]


def _is_depth_point(s: dict) -> bool:
    """Depth-sweep samples, and leak-model samples with bf16 params from the sizes' cases."""
    spec = s["spec"]
    return s["section"] == "depth" or (s["section"] == "sizes" and spec["size"] == "leak"
                                       and not spec["quantized_init"])


def depth_series(samples: list[dict]) -> tuple[list[dict], list[dict]]:
    """Peak and after-step memory against depth, one line per recipe and
    variant (and bf16) with at least two depths; rows with the growth per
    layer (least-squares slope)."""
    lines: dict[str, dict[int, dict]] = {}
    for s in filter(_is_depth_point, samples):
        label = "bf16" if s["variant"] == "bf16" else f"{s['spec']['recipe']} {h.VARIANT_LABELS[s['variant']]}"
        lines.setdefault(label, {})[s["spec"]["layers"]] = s
    lines = {label: by_depth for label, by_depth in lines.items() if len(by_depth) >= 2}
    series, slopes = [], {}
    for key, title in (("peak_mib", "peak allocated"), ("after_step_mib", "allocated after step")):
        plotted = []
        for label, by_depth in sorted(lines.items()):
            xs = sorted(by_depth)
            ys = [by_depth[x][key] for x in xs]
            plotted.append({"label": label, "x": xs, "y": ys})
            slopes[(key, label)] = h.slope(xs, ys)
        series.append({"id": f"depth_{key.removesuffix('_mib')}", "title": f"{title} vs depth (leak model, FSDP2)",
                       "xlabel": "layers", "ylabel": "MiB over baseline", "lines": plotted})
    return (series if lines else []), _slope_rows(slopes)


def _slope_rows(slopes: dict) -> list[dict]:
    rows = []
    recipes = sorted({label.rsplit(" ", 1)[0] for (_, label) in slopes if label != "bf16"})
    for key, metric in (("peak_mib", "peak growth per layer"), ("after_step_mib", "after-step growth per layer")):
        for recipe in recipes:
            st, dr = slopes.get((key, f"{recipe} stock")), slopes.get((key, f"{recipe} drop-in"))
            if st is None or dr is None:
                continue
            rows.append(h.ratio_row(f"depth sweep {recipe}", metric, "MiB/layer", st, dr, limit=None,
                                    bf16=slopes.get((key, "bf16"))))
    return rows


def comparison_rows(cases: dict, bf16: dict, *, timed) -> tuple[list[dict], list[dict]]:
    """Rows and timing entries of every case measured both stock and
    drop-in; ``timed(section)`` says whether that section's step times are
    compared (shared by the FSDP2 and recompute benchmarks)."""
    rows, timings = [], []
    for (section, case), variants in cases.items():
        if "stock" not in variants or "dropin" not in variants:
            continue
        st, dr = variants["stock"], variants["dropin"]
        base = bf16.get((section, st["spec"]["size"], st["spec"]["layers"]))
        rows += [losses_row(case, st, dr), *memory_rows(case, st, dr, base), quantization_row(case, st, dr),
                 *attribution_rows(case, st, dr, base)]
        if timed(section):
            rows.append(h.time_row(case, st["step_time_s"], dr["step_time_s"]))
            timings += timing_entries(case, {"stock": st, "dropin": dr})
    return rows, timings


def summarize(samples: list[dict], args: argparse.Namespace | None = None) -> dict:
    cases, bf16 = _group(samples)
    rows, timings = comparison_rows(cases, bf16, timed=lambda section: section == "sizes")
    for (section, size, layers), s in bf16.items():
        if section == "sizes":
            timings += timing_entries(f"{size} {layers}L bf16", {"bf16": s})
    series, slope_rows = depth_series(samples)
    return {"rows": rows + slope_rows, "series": series, "timings": timings}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    return gpu_main(NAME, args, argv, plan, summarize)


if __name__ == "__main__":
    sys.exit(main())
