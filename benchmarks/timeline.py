"""Live workspace bytes through one training step, stock TE vs drop-in.

    python -m benchmarks.timeline REPORT.json [--out DIR]

``REPORT.json`` is the FSDP2 worker's report (``tests/gpu/_fsdp2_stack.py``,
written where ``TE_WM_FSDP2_REPORT`` points), whose ``attribution`` runs
recorded one step of each stack with ``te_integration.record_workspaces``.
For each run it writes ``timeline_<case>.png``: the live workspace bytes at
every forward and backward boundary, in total (stock and drop-in), and per
layer for each. ``timeline.md`` tabulates, per run: the largest live
workspace bytes during the step, what is alive after it by kind, the
leftovers, and the worst disagreement between the reported bytes and
``torch.cuda.memory_allocated`` (stock minus drop-in, per boundary).
Without matplotlib the table is still written.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from testbed.attribution import disagreement
from testbed.record import capture_env

from ._harness import RESULTS, command_line, earlier_files

MIB = 2**20


def case_name(run: dict) -> str:
    """``<recipe>_<init>_<n>mb``, and ``_<policy>`` for a run with a policy pinned on the drop-ins."""
    init = "qinit" if run["quantized_init"] else "bf16"
    name = f"{run['recipe']}_{init}_{run['microbatches']}mb"
    return f"{name}_{run['policy']}" if run.get("policy") else name


def layer_of(module: str) -> str:
    """The layer a TE module belongs to: the first component of its path
    that is a number (``"3.self_attention.proj"`` -> ``"3"``)."""
    for part in module.split("."):
        if part.isdigit():
            return part
    return module or "?"


def per_layer(point: dict) -> dict[str, int]:
    out: dict[str, int] = {}
    for module, nbytes in point["by_module"].items():
        key = layer_of(module)
        out[key] = out.get(key, 0) + nbytes
    return out


def summary_rows(report: dict) -> list[dict]:
    rows = []
    for run in report.get("attribution", []):
        row = {"case": case_name(run), "disagreement_kib": disagreement(run) / 1024}
        for label in ("stock", "managed"):
            side = run[label]
            row[f"{label}_peak_mib"] = max((p["total_bytes"] for p in side["timeline"]), default=0) / MIB
            row[f"{label}_after_step"] = {k: v / MIB for k, v in side["after_step"]["by_kind"].items()}
            row[f"{label}_leftovers"] = len(side["after_step"]["leftovers"])
        rows.append(row)
    return rows


def markdown(rows: list[dict], source: str, header: str = "") -> str:
    def kinds(d: dict) -> str:
        return ", ".join(f"{k} {v:.2f}" for k, v in sorted(d.items())) or "none"

    lines = [f"# Live workspace bytes through one step (from `{source}`)", "", *([header, ""] if header else []),
             "| case | peak live MiB (stock / drop-in) | alive after the step, MiB by kind: stock | drop-in "
             "| leftovers (drop-in) | worst disagreement with allocated, KiB |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['stock_peak_mib']:.2f} / {r['managed_peak_mib']:.2f} "
                     f"| {kinds(r['stock_after_step'])} | {kinds(r['managed_after_step'])} "
                     f"| {r['managed_leftovers']} | {r['disagreement_kib']:.1f} |")
    return "\n".join(lines) + "\n"


def plot_run(plt, run: dict, out: Path) -> Path:
    fig, axes = plt.subplots(3, 1, figsize=(12, 10), sharex=True)
    for label, color in (("stock", "#c62828"), ("managed", "#2e7d32")):
        points = run[label]["timeline"]
        axes[0].plot([p["total_bytes"] / MIB for p in points], color=color,
                     label="stock TE" if label == "stock" else "drop-in (policy)")
    axes[0].set_ylabel("live workspace MiB")
    axes[0].legend()
    for ax, label in ((axes[1], "stock"), (axes[2], "managed")):
        points = run[label]["timeline"]
        layers = sorted({k for p in points for k in per_layer(p)}, key=lambda k: (not k.isdigit(), int(k) if k.isdigit() else 0, k))
        stacks = [[per_layer(p).get(layer, 0) / MIB for p in points] for layer in layers]
        if stacks:
            ax.stackplot(range(len(points)), *stacks, labels=[f"layer {k}" for k in layers])
            ax.legend(loc="upper right", fontsize="small", ncol=4)
        else:
            ax.text(0.5, 0.5, "no workspace alive at any boundary", transform=ax.transAxes, ha="center")
        ax.set_ylabel(f"{'stock TE' if label == 'stock' else 'drop-in'}: MiB per layer")
        _shade_backward(ax, points)
    _shade_backward(axes[0], run["managed"]["timeline"])
    axes[2].set_xlabel("forward and backward boundaries of TE modules, in order (shaded: backward)")
    fig.suptitle(f"Live quantized weight bytes through one step: {case_name(run)}")
    path = out / f"timeline_{case_name(run)}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def backward_spans(points: list[dict]) -> list[tuple[int, int]]:
    """(first, last) index of each run of backward points: microbatches
    alternate forward and backward, so there is one run per microbatch."""
    spans: list[tuple[int, int]] = []
    for i, p in enumerate(points):
        if p["phase"] != "backward":
            continue
        if spans and spans[-1][1] == i - 1:
            spans[-1] = (spans[-1][0], i)
        else:
            spans.append((i, i))
    return spans


def _shade_backward(ax, points: list[dict]) -> None:
    for first, last in backward_spans(points):
        ax.axvspan(first, last, color="#e0e0e0", alpha=0.5, zorder=0)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.timeline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("report", type=Path, help="the FSDP2 worker's report JSON")
    p.add_argument("--out", type=Path, default=RESULTS / "timeline",
                   help="output folder (default: benchmarks/results/timeline/, the current result, which this replaces)")
    args = p.parse_args(argv)
    if not args.report.is_file():
        p.error(f"no such report file: {args.report}")
    report = json.loads(args.report.read_text())
    if not report.get("attribution"):
        p.error(f"{args.report} has no 'attribution' runs (written by tests/gpu/_fsdp2_stack.py)")
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    for old in earlier_files(out, "timeline"):
        old.unlink()
    env = capture_env()
    header = f"`{command_line('timeline', argv)}`; drawn at commit {str(env['commit'])[:12]}, torch {env['torch']}"
    (out / "timeline.md").write_text(markdown(summary_rows(report), args.report.name, header))
    from .plot import MISSING, _pyplot

    plt = _pyplot()
    if plt is None:
        print(MISSING, file=sys.stderr)
        return 0
    for run in report["attribution"]:
        print(f"wrote {plot_run(plt, run, out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
