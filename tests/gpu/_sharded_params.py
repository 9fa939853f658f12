"""Two-rank worker for sharded quantized parameters (what a shard keeps).

``torchrun --nproc_per_node=2 tests/gpu/_sharded_params.py OUT.json``: for
8 x TransformerLayer(2048, 8192, 16 heads) under quantized_model_init and
FSDP2 (201 M parameters per rank), each sm_90 recipe and both
reshard_after_forward settings, stock vs drop-in: losses over 10 steps,
allocated memory after the optimizer step (relative to before the build),
median step time, and a torch.distributed.checkpoint round trip (saved by
stock, loaded into the drop-in model, saved again, loaded into stock).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

# Deterministic attention backends: without this, TE may pick kernels whose
# backward accumulates in a nondeterministic order at this size, and two runs
# of the same stock model already differ.
os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _fsdp2_stack import build  # noqa: E402  (first: it puts the repository root on sys.path)
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402

from testbed.dist import guard, run_worker  # noqa: E402
from testbed.model import allocated, optimizer_for, random_pair, rank, release_memory  # noqa: E402
from testbed.recipes import make_recipe  # noqa: E402

SIZE = (2048, 8192, 16, 8)
SEQ, BATCH, STEPS = 1024, 2, 10


def batch(step: int):
    return random_pair(7000 + step + 97 * rank(), (SEQ, BATCH, SIZE[0]))


def train(model, recipe, steps=STEPS):
    """``steps`` timed steps of one model: (losses, seconds per step)."""
    return lockstep({"model": model}, recipe, steps)["model"]


def shard_bytes(model) -> dict:
    """Bytes held by the local shards of quantized parameters, by field."""
    from transformer_engine.pytorch.quantized_tensor import QuantizedTensorStorage

    out: dict[str, int] = {}
    for p in model.parameters():
        local = getattr(p, "_local_tensor", None)
        if not isinstance(local, QuantizedTensorStorage):
            continue
        for name in ("_data", "_transpose", "_rowwise_data", "_columnwise_data"):
            t = getattr(local, name, None)
            if isinstance(t, torch.Tensor):
                out[name] = out.get(name, 0) + t.numel() * t.element_size()
    return {k: v / 2**20 for k, v in out.items()}


def run(name: str, reshard: bool) -> dict:
    """Memory: each model alone (relative to before its build). Losses and
    step time: stock, drop-in and a second stock model trained in lockstep,
    one step each in turn, so that clocks and load affect all alike; the
    second stock model is the run-to-run control."""
    recipe = make_recipe(name)
    result = {"recipe": name, "reshard_after_forward": reshard}
    for label, managed in (("stock", False), ("managed", True)):
        baseline = allocated()
        model = build(managed, recipe, True, reshard_after_forward=reshard, size=SIZE)
        train(model, recipe, steps=3)
        result[label] = {"after_step_mib": (allocated() - baseline) / 2**20, "shard_mib": shard_bytes(model)}
        del model
        release_memory()
    models = {k: build(m, recipe, True, reshard_after_forward=reshard, size=SIZE)
              for k, m in (("stock", False), ("managed", True), ("stock_again", False))}
    trace = lockstep(models, recipe)
    for label, (losses, times) in trace.items():
        entry = result.setdefault(label, {})
        q1, med, q3 = statistics.quantiles(times[3:], n=4)
        entry.update(losses=losses, step_s=times, median_step_s=med, iqr_step_s=q3 - q1)
    del models
    release_memory()
    return result


def lockstep(models: dict, recipe, steps: int = 2 * STEPS) -> dict:
    import transformer_engine.pytorch as te

    opts = {k: optimizer_for(m) for k, m in models.items()}
    trace = {k: ([], []) for k in models}
    for step in range(steps):
        x, target = batch(step)
        for label, model in models.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            with te.autocast(enabled=True, recipe=recipe):
                loss = F.mse_loss(model(x), target)
            loss.backward()
            opts[label].step()
            opts[label].zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            trace[label][1].append(time.perf_counter() - start)
            trace[label][0].append(loss.item())
    return trace


def outputs(model, recipe):
    import transformer_engine.pytorch as te

    x, _ = batch(999)
    with torch.no_grad(), te.autocast(enabled=True, recipe=recipe):
        return model(x).float()


def loaded(managed: bool, recipe, checkpoint_id: str):
    """A new model (drop-in or stock) with the checkpoint at ``checkpoint_id`` loaded into it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    model = build(managed, recipe, True, size=SIZE)
    # A model that has run no FP8 step has an empty extra_state (TE's recipe
    # state), which DCP refuses to load a non-empty one into: run one step first.
    train(model, recipe, steps=1)
    state = get_model_state_dict(model)
    dcp.load(state, checkpoint_id=checkpoint_id)
    set_model_state_dict(model, state)
    return model


def dcp_round_trip(name: str) -> dict:
    """Stock saves, the drop-in model loads; the drop-in saves, stock loads.
    For DelayedScaling, first stock into stock (the control: TE's pickled
    extra_state can change size between models, which DCP refuses)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    recipe = make_recipe(name)
    stock = build(False, recipe, True, size=SIZE)
    train(stock, recipe, steps=2)
    folder = tempfile.mkdtemp(prefix="dcp_") if dist.get_rank() == 0 else None
    holder = [folder]
    dist.broadcast_object_list(holder, src=0)
    folder = holder[0]
    dcp.save(get_model_state_dict(stock), checkpoint_id=f"{folder}/stock")
    control = None
    if name == "DelayedScaling":
        other = build(False, recipe, True, size=SIZE)
        train(other, recipe, steps=1)
        try:
            state = get_model_state_dict(other)
            dcp.load(state, checkpoint_id=f"{folder}/stock")
            set_model_state_dict(other, state)  # as loaded() does for the drop-in below
            control = "stock into stock loads"
        except (Exception, CheckpointException) as err:  # the control's outcome is data
            control = f"stock into stock fails too: {str(err).splitlines()[-1][:300]}"
        del other
        if control != "stock into stock loads":
            return {"recipe": name, "te_limitation": control}
    managed = loaded(True, recipe, f"{folder}/stock")
    same_in = torch.equal(outputs(stock, recipe), outputs(managed, recipe))
    dcp.save(get_model_state_dict(managed), checkpoint_id=f"{folder}/managed")
    fresh = loaded(False, recipe, f"{folder}/managed")
    same_back = torch.equal(outputs(stock, recipe), outputs(fresh, recipe))
    shards = shard_bytes(managed)
    del stock, managed, fresh
    release_memory()
    return {"recipe": name, "stock_to_managed_identical": same_in, "managed_to_stock_identical": same_back,
            "managed_shard_mib_after_load": shards, "control": control}


def run_cases(report: dict) -> None:
    for name in ("DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling"):
        for reshard in (True, False):
            guard(report, f"{name} reshard={reshard}", lambda: report["runs"].append(run(name, reshard)))
        # DCP's CheckpointException is a BaseException, not an Exception.
        if not guard(report, f"dcp {name}", lambda: report["dcp"].append(dcp_round_trip(name)),
                     catch=(Exception, CheckpointException)):
            report["dcp"].append({"recipe": name, "failed": report["errors"][-1]["traceback"][-600:]})


def main() -> int:
    return run_worker(sys.argv[1], run_cases, runs=[], dcp=[])


if __name__ == "__main__":
    sys.exit(main())
