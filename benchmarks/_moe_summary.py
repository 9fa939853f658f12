"""The summary of ``benchmarks.moe_memory`` (pure: raw samples in, rows and
tables out), with the issue's targets.

FSDP2, per stack, recipe and microbatch count, the drop-in against bf16's
model of the same stack and count: forward rise per block, forward-held
memory and the step's peak at most bf16's, and with several microbatches
the memory after the step too; losses identical to stock's where quantizing again in
backward reproduces forward's bytes (not under delayed scaling). Unsharded: the
drop-in holds at most stock's less 1 byte per expert parameter, the lean
model less than bf16's. Every figure is also given against stock. Step
time: the drop-in against stock, beside stock again against stock (the
control), reported without a target: under FSDP2 the drop-in quantizes
each expert weight again in backward, and that is its price.
"""

from __future__ import annotations

from collections.abc import Sequence

from . import _harness as h
from .fsdp2_memory import losses_row, quantization_row

#: "At most bf16's" allows this much (allocator rounding, small tensors of TE's own). After
#: the step, the drop-in model's recipe state (scales, amax histories) is allowed on top: it is
#: no weight copy, and under delayed scaling its amax histories alone reach MiBs (1024 steps
#: x 5 amaxes a GEMM x 4 bytes: 1.25 MiB a 64-expert block).
BF16_SLACK_MIB = 1.0
#: The unsharded drop-in's saving: 1 byte per expert parameter, to 1% (allocator rounding).
SAVING_BYTES_PER_PARAM = 1.0
SAVING_TOLERANCE = 0.99
MIB = h.MIB
#: Recipes whose weight quantization, done again, reproduces forward's bytes (docs/decisions.md):
#: a drop-in that quantizes again in backward (FSDP2, lean) then matches stock bit for bit. With
#: delayed scaling the scale moves after every forward, and NVFP4 rounds stochastically.
EXACT_REQUANTIZATION = ("Float8CurrentScaling", "Float8BlockScaling", "MXFP8BlockScaling")

#: (key, label, unit) of every figure a memory sample has.
FIGURES = (
    ("fwd_rise_mib_per_block", "forward rise per block", "MiB"),
    ("held_mib", "forward-held (after fwd - before)", "MiB"),
    ("peak_over_start_mib", "peak over the step's start", "MiB"),
    ("after_bwd_mib", "after backward (- before fwd)", "MiB"),
    ("after_step_mib", "after step (over before build)", "MiB"),
)


def group(samples: Sequence[dict]) -> tuple[dict, dict, list[dict]]:
    """Memory samples by (section, case) -> {variant: sample}; the bf16
    samples by (section, shape, blocks, micro); the timing samples."""
    cases: dict[tuple, dict] = {}
    bf16: dict[tuple, dict] = {}
    timing = []
    for s in samples:
        if s["section"] == "timing":
            timing.append(s)
            continue
        spec = s["spec"]
        if s["variant"] == "bf16":
            bf16[(s["section"], spec["shape"], spec["blocks"], spec["micro"])] = s
        else:
            cases.setdefault((s["section"], s["case"]), {})[s["variant"]] = s
    return cases, bf16, timing


def bf16_of(bf16: dict, sample: dict) -> dict | None:
    spec = sample["spec"]
    return bf16.get((sample["section"], spec["shape"], spec["blocks"], spec["micro"]))


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
    row["ratio"] = ratio(value, stock)
    return row


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b not in (None, 0) else None


def leftovers_row(case: str, dr: dict) -> dict:
    left = [p.get("leftover_workspaces", 0) for p in dr.get("probes", [])]
    return h.check_row(case, "workspaces the plan frees are gone after the step", not any(left),
                       f"leftovers per probed step: {left}", target="0 after every probed step")


def requantized_losses_row(case: str, st: dict, other: dict, metric: str = "losses identical to stock") -> dict:
    """Losses against stock for a model that quantizes its weights again in
    backward: a target where that reproduces forward's bytes, reported only
    where it does not (its plan is then not stock's in numerics either)."""
    row = losses_row(case, st, other)
    row["metric"] = metric
    if other["spec"]["recipe"] not in EXACT_REQUANTIZATION:
        row.update(ok=None, target="", note=row["note"] + f"; no target: {other['spec']['recipe']} does not "
                   "quantize again exactly, and this model quantizes again in backward where stock keeps "
                   "forward's copy")
    return row


def fsdp2_rows(case: str, st: dict, dr: dict, base: dict | None) -> list[dict]:
    micro = dr["spec"]["micro"]
    rows = [requantized_losses_row(case, st, dr)]
    for key, metric, _ in FIGURES:
        if key in ("fwd_rise_mib_per_block", "held_mib", "peak_over_start_mib") or (
                key == "after_step_mib" and micro > 1):
            rows.append(at_most_bf16(case, key, metric, st, dr, base))
        else:
            rows.append(h.ratio_row(case, metric, "MiB", st.get(key), dr.get(key), limit=None,
                                    bf16=(base or {}).get(key)))
    return rows + [quantization_row(case, st, dr), leftovers_row(case, dr)]


def unsharded_rows(case: str, variants: dict, base: dict | None) -> list[dict]:
    st, dr, lean = variants["stock"], variants.get("dropin"), variants.get("lean")
    rows = [] if dr is None else dropin_unsharded_rows(case, st, dr, base)
    return rows + ([] if lean is None else lean_rows(case, st, lean, base))


def dropin_unsharded_rows(case: str, st: dict, dr: dict, base: dict | None) -> list[dict]:
    """Losses, and D11's saving: forward-held at most stock's less 1 byte per expert parameter."""
    need = SAVING_TOLERANCE * SAVING_BYTES_PER_PARAM * dr["spec"]["params"] / MIB
    bound = st["held_mib"] - need
    held = h.bound_row(case, "forward-held, drop-in (D11)", "MiB", dr["held_mib"], bound,
                       f"<= stock - 1 B/expert param ({bound:.1f})", stock=st["held_mib"],
                       bf16=(base or {}).get("held_mib"))
    held["ratio"] = ratio(dr["held_mib"], st["held_mib"])
    peak = h.ratio_row(case, "peak over the step's start, drop-in", "MiB", st["peak_over_start_mib"],
                       dr["peak_over_start_mib"], limit=None, bf16=(base or {}).get("peak_over_start_mib"))
    return [losses_row(case, st, dr), held, peak]


def lean_rows(case: str, st: dict, lean: dict, base: dict | None) -> list[dict]:
    same = requantized_losses_row(case, st, lean, "losses identical to stock, lean")
    if base is None:
        held = h.ratio_row(case, "forward-held, lean", "MiB", st["held_mib"], lean["held_mib"], limit=None,
                           note="no bf16 model to compare with")
    else:
        held = h.bound_row(case, "forward-held, lean", "MiB", lean["held_mib"], base["held_mib"], "< bf16",
                           strict=True, stock=st["held_mib"], bf16=base["held_mib"])
        held["ratio"] = ratio(lean["held_mib"], st["held_mib"])
    return [same, held]


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


def variants_table(cases: dict, bf16: dict) -> dict:
    """Every memory sample, each figure with its ratio to stock and to bf16."""
    columns = ["section", "case", "variant"]
    for _, label, unit in FIGURES:
        columns += [f"{label} ({unit})", "/stock", "/bf16"]
    body = []
    seen_bf16 = set()
    for (section, case), variants in cases.items():
        st = variants.get("stock")
        base = bf16_of(bf16, st or next(iter(variants.values())))
        if base is not None and id(base) not in seen_bf16:
            seen_bf16.add(id(base))
            body.append([section, base["case"], "bf16", *cells(base, st, base)])
        for variant in ("stock", "dropin", "lean"):
            if variant in variants:
                body.append([section, case, variant, *cells(variants[variant], st, base)])
    note = ("Memory after the step is over what was allocated before the model was built (parameters, "
            "gradients and optimizer state included, the same in every variant); the others are over the "
            "step's start.")
    return {"title": "Every variant against stock and bf16", "columns": columns, "rows": body, "note": note}


def cells(sample: dict, st: dict | None, base: dict | None) -> list:
    out = []
    for key, _, _ in FIGURES:
        value = sample.get(key)
        out += [value, h.fmt_ratio(ratio(value, (st or {}).get(key))), h.fmt_ratio(ratio(value, (base or {}).get(key)))]
    return out


def summarize(samples: list[dict], args=None) -> dict:
    cases, bf16, timing = group(samples)
    rows, timings = [], []
    for (section, case), variants in cases.items():
        if "stock" not in variants:
            continue
        base = bf16_of(bf16, variants["stock"])
        if section == "fsdp2" and "dropin" in variants:
            rows += fsdp2_rows(case, variants["stock"], variants["dropin"], base)
        elif section == "unsharded":
            rows += unsharded_rows(case, variants, base)
    for sample in timing:
        rows += timing_rows(sample)
        timings += [{"case": sample["case"], "variant": label.replace("_", " ").replace("dropin", "drop-in"),
                     "samples_ms": [1e3 * v for v in sample["step_time_s"][label]]} for label in sample["step_time_s"]]
    return {"rows": rows, "timings": timings, "tables": [variants_table(cases, bf16)] if cases else []}
