"""PNG figures from benchmark results (matplotlib, Agg backend).

    python -m benchmarks.plot RESULT.json [RESULT.json ...] [--out DIR]

For each result ``<stem>.json`` it writes into ``--out`` (default: the
result's own directory):

- ``<stem>_<series>.png``: the line plots (memory against depth, loss per step);
- ``<stem>_step_times.png``: step-time samples per case and variant (box plots);
- ``<stem>_<bars>.png``: bar charts (quantizations per step, ns per call);
  error bars are ``errors[group]``: one list (symmetric) or ``[below, above]``.

A run draws its line plots and bar charts itself, beside its result
(``_runner.save``). Without matplotlib nothing is drawn; this command says
so and exits 0.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from . import _harness as h

MISSING = ("matplotlib is not installed: no figures written. Install it with "
           "`python3 -m pip install matplotlib` (or the project's `.[bench]` extra).")


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_").lower() or "x"


def _pyplot():
    """matplotlib.pyplot on the Agg backend, or None if matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def series_figures(plt, result: dict, stem: str, out: Path) -> list[Path]:
    """One line plot per series; a series with ``mark_x`` (the end of
    warm-up) gets a second panel with only the points after it."""
    paths = []
    for series in result.get("series", []):
        mark = series.get("mark_x")
        fig, axes = plt.subplots(1, 2 if mark is not None else 1, figsize=(13 if mark is not None else 8, 4.5),
                                 squeeze=False)
        _lines(axes[0][0], series, None)
        if mark is not None:
            axes[0][0].axvline(mark, color="black", linestyle=":", linewidth=1, label="end of warm-up")
            _lines(axes[0][1], series, mark)
            axes[0][1].set_title("after warm-up", fontsize=10)
        axes[0][0].set_title(series.get("title", series["id"]), fontsize=10)
        axes[0][0].legend(fontsize=7)
        paths.append(_save(plt, fig, out / f"{stem}_{slug(series['id'])}.png"))
    return paths


def _lines(ax, series: dict, after: float | None) -> None:
    for line in series["lines"]:
        points = [(x, y) for x, y in zip(line["x"], line["y"]) if after is None or x > after]
        if not points:
            continue
        xs, ys = zip(*points)
        ax.plot(xs, ys, marker="o" if len(xs) <= 32 else None, markersize=3, linewidth=1.2, label=line["label"])
    ax.set_xlabel(series.get("xlabel", ""))
    ax.set_ylabel(series.get("ylabel", ""))
    ax.grid(alpha=0.3)
    ax.ticklabel_format(axis="y", useOffset=False)


def timing_figure(plt, result: dict, stem: str, out: Path) -> list[Path]:
    entries = [t for t in result.get("timings", []) if t.get("samples_ms")]
    if not entries:
        return []
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.3 * len(entries)))
    _horizontal_boxplot(ax, [t["samples_ms"] for t in entries])
    ax.set_yticks(range(1, len(entries) + 1), [f"{t['case']} | {t['variant']}" for t in entries], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("step time (ms)")
    ax.set_title(f"{result['benchmark']}: step time after warm-up", fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    return [_save(plt, fig, out / f"{stem}_step_times.png")]


def _horizontal_boxplot(ax, data: list) -> None:
    """``orientation=`` since matplotlib 3.10 (``vert=`` is deprecated there), ``vert=`` before."""
    import matplotlib

    if tuple(matplotlib.__version_info__[:2]) >= (3, 10):
        ax.boxplot(data, orientation="horizontal", widths=0.6)
    else:
        ax.boxplot(data, vert=False, widths=0.6)


def bar_figures(plt, result: dict, stem: str, out: Path) -> list[Path]:
    paths = []
    for bars in result.get("bars", []):
        labels, groups = bars["labels"], bars["groups"]
        errors = bars.get("errors", {})
        fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(labels) * max(len(groups), 1)), 4.8))
        width = 0.8 / max(len(groups), 1)
        for i, (name, values) in enumerate(groups.items()):
            xs = [j + (i - (len(groups) - 1) / 2) * width for j in range(len(labels))]
            ax.bar(xs, values, width, yerr=errors.get(name), label=name, capsize=2)
        ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=7)
        ax.set_ylabel(bars.get("ylabel", ""))
        ax.set_title(bars.get("title", bars["id"]), fontsize=10)
        ax.legend(fontsize=7)
        paths.append(_save(plt, fig, out / f"{stem}_{slug(bars['id'])}.png"))
    return paths


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def figures(result: dict, stem: str, out: Path) -> list[Path]:
    """The figures a result has, drawn as a run writes it: its series and
    bar charts (none without matplotlib)."""
    plt = _pyplot()
    if plt is None:
        return []
    return [*series_figures(plt, result, stem, out), *bar_figures(plt, result, stem, out)]


def plot_result(path: Path, out: Path | None = None, plt=None) -> list[Path]:
    """Every figure of one result file, the step-time box plots too; the paths written."""
    plt = plt or _pyplot()
    if plt is None:
        raise RuntimeError(MISSING)
    result = h.load_result(path)
    out = Path(out) if out is not None else Path(path).parent
    out.mkdir(parents=True, exist_ok=True)
    stem = Path(path).stem
    return [*series_figures(plt, result, stem, out), *timing_figure(plt, result, stem, out),
            *bar_figures(plt, result, stem, out)]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.plot", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", type=Path, help="result JSON files written by the benchmarks")
    p.add_argument("--out", type=Path, default=None, help="directory for the PNGs (default: beside each result)")
    args = p.parse_args(argv)
    missing = [str(r) for r in args.results if not r.is_file()]
    if missing:
        p.error(f"no such result file: {', '.join(missing)}")
    plt = _pyplot()
    if plt is None:
        print(MISSING, file=sys.stderr)
        return 0
    for path in args.results:
        try:
            written = plot_result(path, args.out, plt)
        except (ValueError, KeyError) as err:
            print(f"{path}: not a benchmark result this version can plot ({err})", file=sys.stderr)
            return 1
        print(f"{path}: {len(written)} figure(s)" + "".join(f"\n  {w}" for w in written), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
