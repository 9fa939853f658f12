"""The quantized FSDP2 all-gather (workspace_manager._shard_gather) on CPU:
real gloo runs at world sizes 1, 2 and 4 (_gather_worker.py says what each
row checks), and a checkpoint they write loaded by a Python that cannot
import this project."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from _torchrun import report_of

#: A process that cannot import the project loads the DCP checkpoint of the
#: wrapped model into plain tensors and compares them with the whole
#: weights the worker saved with torch.save (also read back weights-only).
_LOAD_WITHOUT_PACKAGE = r"""
import sys
for name in ("workspace_manager", "te_integration", "tests", "testbed"):
    sys.modules[name] = None  # any import of them now fails
import torch
import torch.distributed.checkpoint as dcp
out = sys.argv[1]
fulls = torch.load(out + "/full_weights.pt", weights_only=True)
state = {name: torch.empty_like(t) for name, t in fulls.items()}
dcp.load(state, checkpoint_id=out + "/ckpt")
bad = [n for n, t in fulls.items() if type(state[n]) is not torch.Tensor or not torch.equal(state[n], t)]
assert fulls and not bad, bad
print("loaded", len(fulls), "weights")
"""


@pytest.mark.distributed
@pytest.mark.parametrize("world", [1, 2, 4])
def test_quantized_gather_under_torchrun(tmp_path: Path, world: int) -> None:
    report = report_of("_gather_worker.py", tmp_path / "rows.json", nproc=world, timeout_s=420)
    tail = report["output"]
    rows = [(part["rank"], row) for part in report["ranks"] for row in part["rows"]]
    assert report["world_size"] == world and len(report["ranks"]) == world
    # Every rank checked every case: 14 parity configurations (2 wrapped after
    # fully_shard, 1 stepped below the dispatcher), 3 byte checks, refusals,
    # refresh, version, no_step_hook, dcp and freed.
    cases = {row["case"] for _, row in rows}
    assert len(cases) >= 20 and sum("wrap=after" in c for c in cases) >= 2, sorted(cases)
    assert any("/extension/" in c for c in cases) and "freed" in cases, sorted(cases)
    failed = [f"rank {rank} {row['case']}: {row['check']}: expected {row['expected']}, got {row['got']}"
              for rank, row in rows if not row["passed"]]
    assert not failed, "\n".join(failed[:20]) + f"\n({len(failed)} failed rows)\n{tail}"
    assert report["returncode"] == 0, f"torchrun exited {report['returncode']}; output:\n{tail}"
    loaded = subprocess.run([sys.executable, "-c", _LOAD_WITHOUT_PACKAGE, str(tmp_path)],
                            capture_output=True, text=True, timeout=120)
    assert loaded.returncode == 0, loaded.stderr[-4000:]
    assert loaded.stdout.strip() == "loaded 3 weights"
