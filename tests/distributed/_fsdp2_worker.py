"""FSDP2 sharding detection, for real: run under
``torchrun --nproc_per_node=2 tests/distributed/_fsdp2_worker.py RESULT.json``.

Each case builds a small model on CPU, applies ``fully_shard`` over a gloo
device mesh in one layout, and checks ``detect_fsdp2_sharding`` on its
leaves in three phases: before any forward, inside the first forward (a
forward pre-hook, where a binding asks), and after two forward+backward
steps. Every leaf is asked with ``root=None`` and with ``root=model``. Rank 0
writes every rank's answers to RESULT.json; the exit status is 1 on any
mismatch on any rank.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.distributed._ranks import report, run  # noqa: E402
from workspace_manager._context import Sharding  # noqa: E402
from workspace_manager._fsdp2 import detect_fsdp2_sharding  # noqa: E402

R, K, N = Sharding.FSDP2_RESHARD, Sharding.FSDP2_KEEP, Sharding.NONE
DIM = 8


def lin() -> nn.Linear:
    return nn.Linear(DIM, DIM)


class WithWeight(nn.Module):
    """A parent holding a parameter of its own, so a composable API applied
    to it has something to manage."""

    def __init__(self, *children: nn.Module) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(DIM))
        self.body = nn.Sequential(*children)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x * self.scale)


# Each builder gets the mesh and returns (model, {leaf name: expected}).
Case = Callable[[object], tuple[nn.Module, dict[str, Sharding]]]


def per_layer_and_root(mesh):
    m = nn.Sequential(lin(), nn.ReLU(), lin(), nn.Sequential(lin(), nn.GELU()))
    for layer in (m[0], m[2], m[3]):
        fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)  # the root holds no parameter of its own
    # 1: ReLU has no weight and its closest FSDP2 module (the root) shards
    # none either. 3.1: GELU takes the block's (non-root, default) reshard.
    return m, {"0": R, "1": N, "2": R, "3.0": R, "3.1": R}


def root_only_default(mesh):
    m = nn.Sequential(lin(), nn.ReLU(), lin())
    fully_shard(m, mesh=mesh)  # default: FSDP2 keeps the root's weights
    return m, {"0": K, "1": K, "2": K}


def root_only_explicit_reshard(mesh):
    m = nn.Sequential(lin(), nn.ReLU(), lin())
    fully_shard(m, mesh=mesh, reshard_after_forward=True)
    return m, {"0": R, "1": R, "2": R}


def mixed_keep_and_reshard(mesh):
    m = WithWeight(lin(), lin(), lin(), lin())
    fully_shard(m.body[0], mesh=mesh, reshard_after_forward=False)
    fully_shard(m.body[1], mesh=mesh, reshard_after_forward=True)
    fully_shard(m.body[2], mesh=mesh)  # default, not the root
    # body[3] is left to the root, whose parameters FSDP2 keeps by default
    fully_shard(m, mesh=mesh)
    return m, {"body.0": K, "body.1": R, "body.2": R, "body.3": K, "": K}


def int_reshard(mesh):
    # On a 2-rank mesh an int must be 1 (== False) or 2 (== True); a
    # smaller-mesh HSDP reshard needs >= 4 ranks.
    m = nn.Sequential(lin(), lin(), lin())
    fully_shard(m[0], mesh=mesh, reshard_after_forward=2)
    fully_shard(m[1], mesh=mesh, reshard_after_forward=1)
    fully_shard(m, mesh=mesh)
    return m, {"0": R, "1": K, "2": K}


def set_after_shard(mesh):
    m = nn.Sequential(lin(), lin())
    fully_shard(m[0], mesh=mesh)
    fully_shard(m, mesh=mesh)
    m[0].set_reshard_after_forward(False)  # FSDPModule API, changed later
    return m, {"0": K, "1": K}


def grouped_modules(mesh):
    m = nn.Sequential(lin(), lin(), lin())
    fully_shard([m[0], m[1]], mesh=mesh, reshard_after_forward=False)
    fully_shard(m, mesh=mesh, reshard_after_forward=True)
    return m, {"0": K, "1": K, "2": R}


def ignored_params(mesh):
    m = nn.Sequential(lin(), lin())
    fully_shard(m, mesh=mesh, reshard_after_forward=True, ignored_params=set(m[1].parameters()))
    return m, {"0": R, "1": N}


def never_sharded(mesh):
    # Other FSDP2 models exist in this process; a plain one stays NONE.
    m = nn.Sequential(lin(), nn.ReLU(), lin())
    return m, {"0": N, "1": N, "2": N}


def replicate_parent(mesh):
    from torch.distributed._composable import replicate

    m = WithWeight(lin(), lin(), lin())
    fully_shard(m.body[0], mesh=mesh, reshard_after_forward=True)
    fully_shard(m.body[1], mesh=mesh)  # no FSDP2 ancestor: becomes its own root
    replicate(m)  # DDP-based; manages m.scale and body.2
    return m, {"body.0": R, "body.1": K, "body.2": N, "": N}


def replicate_fsdp_parent(mesh):
    from torch.distributed._composable.replicate_with_fsdp import replicate

    m = WithWeight(lin(), lin())
    fully_shard(m.body[0], mesh=mesh, reshard_after_forward=True)
    replicate(m, mesh=mesh)  # its state subclasses FSDPState, shards nothing
    return m, {"body.0": R, "body.1": N, "": N}


CASES: dict[str, Case] = {
    f.__name__: f
    for f in (
        per_layer_and_root,
        root_only_default,
        root_only_explicit_reshard,
        mixed_keep_and_reshard,
        int_reshard,
        set_after_shard,
        grouped_modules,
        ignored_params,
        never_sharded,
        replicate_parent,
        replicate_fsdp_parent,
    )
}
OPTIONAL = {"replicate_parent", "replicate_fsdp_parent"}


def detect(model: nn.Module, name: str) -> str:
    leaf = model.get_submodule(name)
    free, rooted = detect_fsdp2_sharding(leaf), detect_fsdp2_sharding(leaf, root=model)
    return free.value if free is rooted else f"root=None:{free.value}/root=model:{rooted.value}"


def placement(model: nn.Module, name: str, want: Sharding) -> str:
    """Proof that the layout really shards: a leaf expected under FSDP2 has
    its own parameters as DTensors sharded over the mesh; any other has none
    sharded (replicate's DTensors are Replicate)."""
    from torch.distributed.tensor import DTensor, Shard

    params = list(model.get_submodule(name).parameters(recurse=False))
    sharded = [isinstance(p, DTensor) and any(isinstance(pl, Shard) for pl in p.placements) for p in params]
    if not params:
        return want.value  # nothing to place; the detection rows cover it
    if all(sharded) if want.is_fsdp2 else not any(sharded):
        return want.value
    return f"params sharded: {sharded}"


def run_case(name: str, mesh) -> dict:
    torch.manual_seed(0)
    model, expected = CASES[name](mesh)
    got = {
        "placement": {n: placement(model, n, want) for n, want in expected.items()},
        "before": {n: detect(model, n) for n in expected},
        "in_forward": {},
    }

    def record(leaf_name):
        def hook(_module, _args):
            got["in_forward"].setdefault(leaf_name, detect(model, leaf_name))

        return hook

    handles = [model.get_submodule(n).register_forward_pre_hook(record(n)) for n in expected]
    for step in range(2):
        x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(step + dist.get_rank()))
        model(x).sum().backward()
        for h in handles if step == 0 else ():
            h.remove()
    got["after_step"] = {n: detect(model, n) for n in expected}
    return {"expected": {n: s.value for n, s in expected.items()}, "got": got}


def check(case: str, result: dict) -> list[dict]:
    rows = []
    for leaf, want in result["expected"].items():
        for phase, answers in result["got"].items():
            have = answers.get(leaf, "<not called in forward>")
            rows.append(
                {"case": case, "leaf": leaf or "<root>", "phase": phase, "expected": want, "got": have, "passed": have == want}
            )
    return rows


def outside_root_rows(mesh) -> list[dict]:
    """A root that does not contain the module is a user error, reported as
    soon as the walk needs it (a module without weights of its own)."""
    from workspace_manager._errors import InvalidContextError

    model, other = nn.Sequential(lin(), nn.ReLU()), nn.Sequential(lin())
    fully_shard(model, mesh=mesh)
    try:
        detect_fsdp2_sharding(model[1], root=other)
        got = "no error"
    except InvalidContextError as exc:
        got = "InvalidContextError" if "is not inside root" in str(exc) else f"message: {exc}"
    return [{"case": "outside_root", "leaf": "1", "phase": "before", "expected": "InvalidContextError",
             "got": got, "passed": got == "InvalidContextError"}]


def _last_layer_row(mesh) -> dict:
    """One layer switched on its own (the last layer kept gathered after
    forward), after a step: its probe follows, its neighbour's does not."""
    from workspace_manager.extending import probe_fsdp2_sharding

    model = nn.Sequential(lin(), lin())
    for layer in model:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh)
    first, last = probe_fsdp2_sharding(model[0]), probe_fsdp2_sharding(model[1])
    model(torch.randn(4, DIM)).sum().backward()
    model[1].set_reshard_after_forward(False)
    got = (first.read().value, last.read().value)
    return {"case": "toggle", "leaf": "0 and 1", "phase": "set_reshard_after_forward(False) on the last layer only",
            "expected": f"{R.value}, {K.value}", "got": ", ".join(got), "passed": got == (R.value, K.value)}


def toggle_rows(mesh) -> list[dict]:
    """A probe made once follows ``set_reshard_after_forward`` in both
    directions, before and after FSDP2's lazy init (a binding keeps one
    probe per module and reads it on every call)."""
    from workspace_manager.extending import probe_fsdp2_sharding

    model = nn.Sequential(lin(), lin())
    fully_shard(model[0], mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh)
    probe = probe_fsdp2_sharding(model[0])
    rows = []

    def row(phase: str, want: Sharding) -> None:
        got = probe.read().value
        rows.append({"case": "toggle", "leaf": "0", "phase": phase, "expected": want.value, "got": got,
                     "passed": got == want.value})

    row("before", R)
    model(torch.randn(4, DIM)).sum().backward()
    row("after_first_step", R)
    for toggle, want in ((False, K), (True, R), (False, K)):
        model.set_reshard_after_forward(toggle)  # recurses into model[0]'s state
        row(f"set_reshard_after_forward({toggle})", want)
        model(torch.randn(4, DIM)).sum().backward()
        row(f"trained after set({toggle})", want)
    stale = probe.stale()
    fully_shard(nn.Linear(DIM, DIM), mesh=mesh)  # a new FSDP2 state elsewhere
    rows.append({"case": "toggle", "leaf": "0", "phase": "stale", "expected": "False then True",
                 "got": f"{stale} then {probe.stale()}", "passed": (stale, probe.stale()) == (False, True)})
    return rows + [_last_layer_row(mesh)]  # after the stale check: it makes new FSDP2 states


class SharesChildWeight(nn.Module):
    """A wrapper registering its child's weight as its own, as te.ops's
    fused ``Linear`` does with its ``BasicLinear``'s."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = lin()
        self.weight = self.inner.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def gathered_rows(mesh) -> list[dict]:
    """``fsdp2_gathered_parameters`` lists an unsharded parameter under every
    module that registers it: the wrapper FSDP2 names as its owner and the
    child sharing it."""
    from workspace_manager.extending import fsdp2_gathered_parameters

    model = nn.Sequential(SharesChildWeight(), lin())
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    model(torch.randn(4, DIM)).sum().backward()
    entries = fsdp2_gathered_parameters(model)
    names = {id(m): n for n, m in model.named_modules()}
    got = sorted(f"{names[id(module)]}.{name}" for module, name, _ in entries if name == "weight")
    same = {id(t) for module, name, t in entries if name == "weight" and names[id(module)].startswith("0")}
    expected = ["0.inner.weight", "0.weight", "1.weight"]
    return [{"case": "gathered", "leaf": "0, 0.inner, 1", "phase": "after a step",
             "expected": f"{expected}, one tensor for 0 and 0.inner", "got": f"{got}, {len(same)} tensor(s)",
             "passed": got == expected and len(same) == 1}]


def main() -> int:
    out_path = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    rows, skipped = [], []
    for name in CASES:
        try:
            rows.extend(check(name, run_case(name, mesh)))
        except Exception as exc:  # noqa: BLE001 - reported, not swallowed
            if name in OPTIONAL:
                reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
                print(f"[rank {rank}] skipping {name}: {reason}", flush=True)
                skipped.append({"case": name, "reason": reason})
            else:
                traceback.print_exc()
                rows.append({"case": name, "leaf": "*", "phase": "setup", "expected": "no error",
                             "got": f"{type(exc).__name__}: {exc}", "passed": False})
    rows.extend(outside_root_rows(mesh))
    rows.extend(toggle_rows(mesh))
    rows.extend(gathered_rows(mesh))
    return report(Path(out_path), {"rank": rank, "rows": rows, "skipped": skipped})


if __name__ == "__main__":
    run(main)
