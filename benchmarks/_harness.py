"""What every benchmark shares: arguments, environment, statistics, the
comparison rows with their targets, the result (JSON and Markdown, written
into the benchmark's current result folder), progress.

Nothing here needs CUDA or TransformerEngine: torch is imported inside the
functions that ask it something, and TE is never imported (its version is
read from the installed package's metadata or from an already imported
module). The environment a result records and its JSON values come from
``testbed.record``. The CPU test ``benchmarks/tests/test_harness.py`` covers it.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TextIO

from testbed.record import capture_env, jsonable

#: Every benchmark's current result: ``RESULTS / <benchmark>``.
RESULTS = Path(__file__).resolve().parent / "results"
SCHEMA = "te-wm-benchmark/1"

#: The recipes an sm_90 GPU (H100/H200) runs.
RECIPES = ("DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling")
#: Model sizes (see ``_stack.SIZES``): TE's leak-test model and a realistic one.
SIZES = ("leak", "realistic")
INITS = ("bf16", "qinit")
INIT_LABELS = {"bf16": "bf16 params", "qinit": "quantized_model_init"}
VARIANT_LABELS = {"stock": "stock", "dropin": "drop-in", "bf16": "bf16"}
MIB = 2**20

# Targets of the benchmarks issue (ratio drop-in / stock, same run).
MEMORY_RATIO_MAX = 1.00
TIME_RATIO_MAX = 1.01
FWD_KIB_OVER_BF16_MAX = 50.0


# -- arguments -----------------------------------------------------------------
def csv_choices(choices: Sequence[str]) -> Callable[[str], list[str]]:
    """An argparse type: a comma-separated list whose items are in ``choices``."""

    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in choices]
        if not items or bad:
            raise argparse.ArgumentTypeError(
                f"expected a comma-separated list of {', '.join(choices)}; received {text!r}"
            )
        return items

    return parse


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer; received {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer; received {value}")
    return value


def int_list(text: str) -> list[int]:
    """An argparse type: comma-separated positive integers, e.g. ``2,4,8,16``."""
    values = [positive_int(t.strip()) for t in text.split(",") if t.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers; received {text!r}")
    return values


def base_parser(name: str, description: str) -> argparse.ArgumentParser:
    """The options of every benchmark: --quick, --out, --tag, --quiet."""
    p = argparse.ArgumentParser(prog=f"python -m benchmarks.{name}", description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a short run (under a minute): fewer configs and steps")
    p.add_argument("--out", type=Path, default=RESULTS / name,
                   help=f"folder of the result (default: benchmarks/results/{name}/, the current result, "
                        "which this run replaces)")
    p.add_argument("--tag", default="", help="one more configuration beside the result: <name>-TAG.*, replacing "
                   "only that tag's files (default: 'quick' with --quick)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    return p


def make_parser(name: str, description: str) -> argparse.ArgumentParser:
    """:func:`base_parser` plus the options of the GPU benchmarks. Defaults
    are None here and filled by :func:`parse_args` from the benchmark's full
    and ``--quick`` values."""
    p = base_parser(name, description)
    p.add_argument("--recipes", type=csv_choices(RECIPES), help=f"comma-separated, from {', '.join(RECIPES)}")
    p.add_argument("--sizes", type=csv_choices(SIZES), help=f"comma-separated, from {', '.join(SIZES)}")
    p.add_argument("--steps", type=positive_int, help="timed steps per model, after warm-up (>= 10 for a spread)")
    p.add_argument("--warmup", type=int, help="untimed warm-up steps per model")
    p.add_argument("--layers", type=positive_int, help="layers of every model (default: per size)")
    p.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="skip the remaining configurations once this much time has passed (recorded as skipped)")
    return p


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None,
               defaults: dict[str, tuple[Any, Any]]) -> argparse.Namespace:
    """Parse, then fill every option left unset from ``defaults[name] =
    (full, quick)``. Usage errors exit with status 2 and argparse's message."""
    args = parser.parse_args(argv)
    for key, (full, quick) in defaults.items():
        if getattr(args, key, None) is None:
            setattr(args, key, quick if args.quick else full)
    if isinstance(getattr(args, "warmup", None), int) and args.warmup < 0:
        parser.error(f"--warmup must be >= 0; received {args.warmup}")
    if not args.tag and args.quick:
        args.tag = "quick"
    return args


def config_of(args: argparse.Namespace, **extra: Any) -> dict:
    """The full configuration of a run, for the JSON: every option and ``extra``."""
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in sorted(vars(args).items())}
    config.update(extra)
    return config


# -- statistics ----------------------------------------------------------------
def quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile (numpy's default), ``0 <= q <= 1``."""
    xs = sorted(values)
    if not xs:
        raise ValueError("quantile of an empty sample")
    pos = (len(xs) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def spread(values: Sequence[float]) -> dict:
    """Median, min, max, quartiles and IQR of a sample."""
    xs = [float(v) for v in values]
    if not xs:
        return {"n": 0}
    q1, q3 = quantile(xs, 0.25), quantile(xs, 0.75)
    return {"n": len(xs), "median": statistics.median(xs), "mean": statistics.fmean(xs), "min": min(xs),
            "max": max(xs), "q1": q1, "q3": q3, "iqr": q3 - q1}


def mean(values: Iterable[float]) -> float | None:
    xs = [float(v) for v in values]
    return statistics.fmean(xs) if xs else None


def slope(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Least-squares slope of ys over xs (None with fewer than two points)."""
    if len(xs) < 2 or len(set(xs)) < 2:
        return None
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    num = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    return num / sum((x - mx) ** 2 for x in xs)


# -- comparison rows -----------------------------------------------------------
def ratio_row(case: str, metric: str, unit: str, stock: float | None, dropin: float | None, *,
              limit: float | None = MEMORY_RATIO_MAX, strict: bool = False, bf16: float | None = None,
              spread_text: str = "", note: str = "") -> dict:
    """A drop-in/stock comparison. Target: ratio <= limit (< with ``strict``);
    ``limit=None`` reports without a target. With stock <= 0 the ratio is
    undefined and the target is read as drop-in <= stock."""
    ratio = dropin / stock if stock not in (None, 0) and dropin is not None and stock > 0 else None
    ok = None
    if limit is not None and stock is not None and dropin is not None:
        bound = stock * limit if ratio is not None else stock
        ok = dropin < bound if strict else dropin <= bound
    target = "" if limit is None else f"ratio {'<' if strict else '<='} {limit:g}"  # 1.005 stays 1.005
    return {"case": case, "metric": metric, "unit": unit, "stock": stock, "dropin": dropin, "bf16": bf16,
            "ratio": ratio, "target": target, "ok": ok, "spread": spread_text, "note": note}


def bound_row(case: str, metric: str, unit: str, value: float | None, bound: float, target: str, *,
              strict: bool = False, stock: float | None = None, bf16: float | None = None, note: str = "") -> dict:
    """An absolute check of a drop-in figure: ``value <= bound`` (< with ``strict``)."""
    ok = None if value is None else (value < bound if strict else value <= bound)
    return {"case": case, "metric": metric, "unit": unit, "stock": stock, "dropin": value, "bf16": bf16,
            "ratio": None, "target": target, "ok": ok, "spread": "", "note": note}


def check_row(case: str, metric: str, ok: bool, detail: str, target: str = "") -> dict:
    """A yes/no check (losses identical, no cache left after the step)."""
    return {"case": case, "metric": metric, "unit": "", "stock": None, "dropin": None, "bf16": None,
            "ratio": None, "target": target or "holds", "ok": bool(ok), "spread": "", "note": detail}


def describe_times(label: str, seconds: Sequence[float]) -> str:
    s = spread([1e3 * t for t in seconds])
    if not s["n"]:
        return f"{label}: no samples"
    return (f"{label} {s['median']:.3f} ms (IQR {s['q1']:.3f}-{s['q3']:.3f}, "
            f"min-max {s['min']:.3f}-{s['max']:.3f}, n={s['n']})")


def time_row(case: str, stock_s: Sequence[float], dropin_s: Sequence[float], *,
             limit: float | None = TIME_RATIO_MAX, strict: bool = False, min_samples: int = 10) -> dict:
    """Median step time, drop-in against stock, with both spreads. A miss
    whose interquartile ranges overlap says so: the difference is then inside
    step-to-step noise."""
    st, dr = spread([1e3 * t for t in stock_s]), spread([1e3 * t for t in dropin_s])
    if not st["n"] or not dr["n"]:
        return ratio_row(case, "median step time", "ms", None, None, limit=limit, note="no timed steps")
    notes = []
    if min(st["n"], dr["n"]) < min_samples:
        notes.append(f"only {min(st['n'], dr['n'])} timed steps (< {min_samples}): indicative")
    row = ratio_row(case, "median step time", "ms", st["median"], dr["median"], limit=limit, strict=strict,
                    spread_text=f"{describe_times('stock', stock_s)}; {describe_times('drop-in', dropin_s)}")
    if len(stock_s) == len(dropin_s):
        # Paired rounds (the models step in turn): the median of per-round
        # ratios cancels drift that hits a round's models alike.
        ratios = [d / s for s, d in zip(stock_s, dropin_s) if s > 0]
        notes.append(f"median of per-round ratios {statistics.median(ratios):.4f} "
                     f"(IQR {quantile(ratios, 0.25):.4f}-{quantile(ratios, 0.75):.4f})")
    if row["ok"] is False:
        overlap = dr["q1"] <= st["q3"] and st["q1"] <= dr["q3"]
        notes.append(f"+{dr['median'] - st['median']:.3f} ms per step; IQRs "
                     + ("overlap: within step-to-step noise" if overlap else "do not overlap"))
    row["note"] = "; ".join(notes)
    return row


def control_row(case: str, stock_s: Sequence[float], again_s: Sequence[float]) -> dict:
    """The paired benchmarks' control: a second stock model against the
    first, the noise floor a drop-in's time ratio is read against; no target."""
    row = time_row(case, stock_s, again_s, limit=None)
    row.update(metric="median step time, control: stock again / stock",
               note="the noise floor of this comparison; no target")
    return row


def explain_miss(row: dict) -> str:
    """One line, with numbers, for a row that misses its target."""
    unit = f" {row['unit']}" if row["unit"] else ""
    parts = [f"**{row['case']}: {row['metric']}**"]
    if row["dropin"] is not None:
        parts.append(f"drop-in {fmt(row['dropin'])}{unit}")
    if row["stock"] is not None:
        delta = row["dropin"] - row["stock"] if row["dropin"] is not None else None
        parts.append(f"stock {fmt(row['stock'])}{unit}" + (f" (delta {delta:+.4g}{unit})" if delta is not None
                                                            else ""))
    if row["bf16"] is not None:
        parts.append(f"bf16 {fmt(row['bf16'])}{unit}")
    if row["ratio"] is not None:
        parts.append(f"ratio {fmt_ratio(row['ratio'])}")
    text = ", ".join(parts) + f"; target {row['target']}."
    return text + (f" {row['note']}." if row["note"] else "")


def fmt_ratio(ratio: float | None) -> str:
    """Four decimals; six where four would hide a difference from 1."""
    if ratio is None:
        return "-"
    text = f"{ratio:.4f}"
    return f"{ratio:.6f}" if text == "1.0000" and ratio != 1.0 else text


def fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e5 else f"{value:.0f}"
    return str(value)


# -- results: JSON and Markdown ------------------------------------------------
def new_result(name: str, config: dict) -> dict:
    """An empty result: fill ``samples`` (raw), ``rows``, ``series``,
    ``timings``, ``bars``, ``tables``, ``skipped`` and ``errors`` (and
    ``text``, a plain-text summary of a benchmark's own, if it has one)."""
    return {"schema": SCHEMA, "benchmark": name,
            "created_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "command": command_line(name),
            "config": config, "env": capture_env(), "samples": [], "rows": [], "series": [], "timings": [],
            "bars": [], "tables": [], "skipped": [], "errors": [], "wall_s": None}


def command_line(name: str, argv: Sequence[str] | None = None) -> str:
    """How this run was launched (``argv``: its arguments, default the
    process's), as a command to repeat it."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    # torchrun sets LOCAL_RANK: at world size 1 the run was still a torchrun one
    launcher = f"torchrun --nproc_per_node={world} -m" if world > 1 or "LOCAL_RANK" in os.environ else "python3 -m"
    return f"{launcher} benchmarks.{name} {shlex.join(sys.argv[1:] if argv is None else argv)}".rstrip()


def summary_counts(rows: Sequence[dict]) -> dict:
    checked = [r for r in rows if r["ok"] is not None]
    return {"targets": len(checked), "met": sum(1 for r in checked if r["ok"]),
            "missed": sum(1 for r in checked if not r["ok"])}


def result_stem(name: str, tag: str) -> str:
    return f"{name}-{tag}" if tag else name


def earlier_files(out_dir: Path, name: str, tag: str = "") -> list[Path]:
    """What an earlier run of benchmark ``name`` left in ``out_dir`` that this
    run replaces: without a tag every file of the benchmark (its result, its
    tagged configurations, their figures); with one, only that tag's."""
    stem = result_stem(name, tag)
    prefixes = (f"{stem}.", f"{stem}_") if tag else (f"{name}.", f"{name}_", f"{name}-")
    return sorted(p for p in Path(out_dir).glob(f"{name}*") if p.is_file() and p.name.startswith(prefixes))


def write_result(result: dict, out_dir: Path, tag: str = "") -> tuple[Path, Path]:
    """Write ``<name>[-tag].json`` and ``.md`` into ``out_dir`` (created),
    after removing what they replace (:func:`earlier_files`). The JSON is
    written to a temporary name first and then renamed."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in earlier_files(out_dir, result["benchmark"], tag):
        old.unlink()
    stem = result_stem(result["benchmark"], tag)
    result["summary"] = summary_counts(result["rows"])
    json_path, md_path = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    tmp = json_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(jsonable(result), indent=1, allow_nan=False) + "\n")
    tmp.replace(json_path)
    md_path.write_text(render_markdown(result))
    return json_path, md_path


def print_result(name: str, out_dir: Path, tag: str = "") -> None:
    """Print the Markdown summary a run wrote, on rank 0 only (every rank runs the benchmark)."""
    md = Path(out_dir) / f"{result_stem(name, tag)}.md"
    if os.environ.get("RANK", "0") == "0" and md.is_file():
        print(md.read_text(), flush=True)


def load_result(path: Path) -> dict:
    data = json.loads(Path(path).read_text())
    if data.get("schema") != SCHEMA:
        raise ValueError(f"{path} is not a benchmark result (schema {data.get('schema')!r}, expected {SCHEMA!r})")
    return data


def render_markdown(result: dict) -> str:
    """The summary: environment, the comparison table (ratio drop-in/stock,
    target, met), every missed target with its numbers, extra tables,
    skipped configurations and errors."""
    env, rows = result["env"], result["rows"]
    gpus = ", ".join(sorted(set(env.get("gpus") or []))) or "no GPU"
    lines = [f"# {result['benchmark']}", "",
             f"`{result['command']}`", "",
             f"{len(env.get('gpus') or [])}x {gpus}; torch {env.get('torch')}; TE {env.get('te') or 'not installed'}; "
             f"commit {str(env.get('commit'))[:12]}{' (dirty)' if env.get('dirty') else ''}; "
             f"{result['created_utc']}; wall {fmt(result.get('wall_s'))} s", ""]
    if rows:
        counts = summary_counts(rows)
        lines += [f"Targets met: {counts['met']} of {counts['targets']}.", "", *rows_table(rows), ""]
        missed = [r for r in rows if r["ok"] is False]
        if missed:
            lines += ["## Missed targets", "", *[f"- {explain_miss(r)}" for r in missed], ""]
    if result.get("text"):  # a benchmark's own plain-text summary, shown as it wrote it
        lines += ["```", result["text"].rstrip(), "```", ""]
    for table in result.get("tables", []):
        lines += [f"## {table['title']}", "", *markdown_table(table["columns"], table["rows"]), ""]
        if table.get("note"):
            lines += [table["note"], ""]
    if result.get("skipped"):
        lines += ["## Skipped", "", *[f"- {s['what']}: {s['why']}" for s in result["skipped"]], ""]
    if result.get("errors"):
        lines += ["## Errors", ""]
        for err in result["errors"]:
            lines += [f"- {err['where']}:", "", "```", err["traceback"].rstrip()[-3000:], "```", ""]
    return "\n".join(lines).rstrip() + "\n"


def rows_table(rows: Sequence[dict]) -> list[str]:
    columns = ["case", "metric", "stock", "drop-in", "bf16", "ratio drop-in/stock", "target", "met", "spread / note"]
    body = []
    for r in rows:
        metric = f"{r['metric']} ({r['unit']})" if r["unit"] else r["metric"]
        met = {True: "yes", False: "**NO**", None: "-"}[r["ok"]]
        ratio = fmt_ratio(r["ratio"])
        extra = "; ".join(t for t in (r["spread"], r["note"]) if t)
        body.append([r["case"], metric, fmt(r["stock"]), fmt(r["dropin"]), fmt(r["bf16"]), ratio,
                     r["target"] or "-", met, extra or ""])
    return markdown_table(columns, body)


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    def cell(v: Any) -> str:
        return fmt(v).replace("|", "\\|").replace("\n", " ")

    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns),
            *["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]]


# -- progress --------------------------------------------------------------------
class Progress:
    """One line per configuration, flushed, with the elapsed time and an
    ETA from the weights of the configurations done so far. ``over_budget``
    says when ``budget_s`` has passed; ``agree`` lets several ranks decide
    together (any rank over budget stops them all)."""

    def __init__(self, total_weight: float, *, enabled: bool = True, budget_s: float | None = None,
                 stream: TextIO | None = None, agree: Callable[[bool], bool] | None = None) -> None:
        self.total = max(float(total_weight), 1e-9)
        self.enabled, self.budget_s = enabled, budget_s
        self.stream = stream if stream is not None else sys.stdout
        self.agree = agree or (lambda flag: flag)
        self.start_time = time.perf_counter()
        self.done_weight, self.count = 0.0, 0
        self._current: tuple[str, float, float] | None = None

    def elapsed(self) -> float:
        return time.perf_counter() - self.start_time

    def eta(self) -> float | None:
        if self.done_weight <= 0:
            return None
        return self.elapsed() / self.done_weight * max(self.total - self.done_weight, 0.0)

    def start(self, label: str, weight: float = 1.0) -> None:
        self._current = (label, weight, time.perf_counter())
        self.say(f"[{self.count + 1}] {label} ...")

    def done(self, note: str = "") -> None:
        if self._current is None:
            return
        label, weight, t0 = self._current
        self._current = None
        self.done_weight += weight
        self.count += 1
        pct = 100.0 * min(self.done_weight / self.total, 1.0)
        eta = self.eta()
        self.say(f"[{self.count}] {label}: {time.perf_counter() - t0:.1f} s{' ' + note if note else ''} | "
                 f"{pct:.0f}% | elapsed {_clock(self.elapsed())} | ETA {_clock(eta) if eta is not None else '?'}")

    def over_budget(self) -> bool:
        over = self.budget_s is not None and self.elapsed() > self.budget_s
        return bool(self.agree(over))

    def say(self, message: str) -> None:
        if self.enabled:
            print(message, file=self.stream, flush=True)


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}"
