"""Reading the attribution runs of the FSDP2 GPU worker's report
(``tests/gpu/_fsdp2_stack.py``): each run recorded one step of a stock and a
drop-in stack with ``te_integration.record_workspaces``, a timeline of the
live workspace bytes and ``torch.cuda.memory_allocated`` at every
forward/backward boundary. The GPU test holds the two to agree and
``benchmarks.timeline`` tabulates how far they do."""

from __future__ import annotations

__all__ = ["disagreement"]


def disagreement(run: dict) -> int:
    """Largest |(stock - drop-in) allocated - (stock - drop-in) reported| over the boundaries, in bytes."""
    stock, managed = run["stock"], run["managed"]
    worst = 0
    for s, m in zip(stock["timeline"], managed["timeline"]):
        if s["allocated_bytes"] is None or m["allocated_bytes"] is None:
            continue
        d_alloc = (s["allocated_bytes"] - stock["baseline"]) - (m["allocated_bytes"] - managed["baseline"])
        worst = max(worst, abs(d_alloc - (s["total_bytes"] - m["total_bytes"])))
    return worst
