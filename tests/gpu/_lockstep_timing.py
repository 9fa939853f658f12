"""Step time of the leak-test stack, stock vs drop-in, trained in lockstep.

``torchrun --nproc_per_node=2 tests/gpu/_lockstep_timing.py OUT.json``: for
each sm_90 recipe (bf16 params and quantized_model_init), three models are
built (stock, drop-in, stock again as the run-to-run control) and trained
one step each in turn for 30 steps, so that clocks and load affect all
three alike. Also times one managed and one stock ``Linear`` forward+backward
per iteration on each rank (200 interleaved iterations; rank 0's are kept)
to isolate per-call cost. Not yet run: the first attempt timed the modules
on rank 0 alone and hung in DelayedScaling's amax reduction.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from _fsdp2_stack import _recipe, build  # noqa: E402
from _sharded_params import lockstep  # noqa: E402

import _sharded_params  # noqa: E402


def stack_times(name: str, qinit: bool) -> dict:
    recipe = _recipe(name)
    models = {k: build(m, recipe, qinit) for k, m in (("stock", False), ("managed", True), ("stock_again", False))}
    trace = lockstep(models, recipe, steps=30)
    out = {"recipe": name, "quantized_init": qinit}
    for label, (losses, times) in trace.items():
        q1, med, q3 = statistics.quantiles([t * 1e3 for t in times[5:]], n=4)
        out[label] = {"median_ms": med, "iqr_ms": q3 - q1, "losses_equal_stock": losses == trace["stock"][0]}
    return out


def module_times(name: str) -> dict:
    import transformer_engine.pytorch as te

    import te_integration as ti

    recipe = _recipe(name)
    torch.manual_seed(0)
    mods = {"stock": te.Linear(256, 256, params_dtype=torch.bfloat16, device="cuda"),
            "managed": ti.Linear(256, 256, params_dtype=torch.bfloat16, device="cuda")}
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    samples = {k: [] for k in mods}
    for i in range(220):
        for label, m in mods.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with te.autocast(enabled=True, recipe=recipe):
                y = m(x)
            y.sum().backward()
            torch.cuda.synchronize()
            if i >= 20:
                samples[label].append((time.perf_counter() - t0) * 1e6)
    return {"recipe": name, **{k: statistics.median(v) for k, v in samples.items()}, "unit": "us per fwd+bwd",
            "profile_diff": profile_diff(mods, x, recipe)}


def _profile(module, x, recipe) -> dict:
    """cProfile of 50 forward+backward calls of ``module``: {function: (calls, tottime s)}."""
    import cProfile
    import pstats

    import transformer_engine.pytorch as te

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(50):
        with te.autocast(enabled=True, recipe=recipe):
            y = module(x)
        y.sum().backward()
    torch.cuda.synchronize()
    prof.disable()
    stats = pstats.Stats(prof).stats
    return {f"{f[0].split('/')[-1]}:{f[1]}({f[2]})": (v[1], v[2]) for f, v in stats.items()}


def profile_diff(mods: dict, x, recipe) -> list[dict]:
    """Functions whose own time differs most between the managed and the stock
    module, per call of the module (50 calls each, profiled one after the other)."""
    stock, managed = _profile(mods["stock"], x, recipe), _profile(mods["managed"], x, recipe)
    rows = []
    for name in stock.keys() | managed.keys():
        sc, st = stock.get(name, (0, 0.0))
        mc, mt = managed.get(name, (0, 0.0))
        rows.append({"function": name, "extra_calls_per_call": (mc - sc) / 50,
                     "extra_us_per_call": (mt - st) / 50 * 1e6})
    rows.sort(key=lambda r: -abs(r["extra_us_per_call"]))
    return rows[:40]


def stack_profile(name: str) -> dict:
    """cProfile of 10 training steps of each stack (both ranks run the same
    sequence, so collectives pair up). The leak-test model is launch-bound,
    so a step-time gap there is host time and shows up here."""
    import cProfile
    import io
    import pstats

    recipe = _recipe(name)
    models = {k: build(m, recipe, False) for k, m in (("stock", False), ("managed", True))}
    lockstep(models, recipe, steps=3)
    out = {"recipe": name}
    for label, model in models.items():
        prof = cProfile.Profile()
        prof.enable()
        lockstep({label: model}, recipe, steps=10)
        prof.disable()
        buf = io.StringIO()
        stats = pstats.Stats(prof, stream=buf)
        stats.sort_stats("tottime").print_stats(30)
        stats.sort_stats("cumulative").print_stats(40)
        out[label] = {"total_s": stats.total_tt, "calls": stats.total_calls, "text": buf.getvalue()[-14000:]}
    return out


def main() -> int:
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    # The leak-test model: the batches lockstep() draws follow these sizes.
    _sharded_params.SIZE = (256, 1024, 8, 8)
    _sharded_params.SEQ, _sharded_params.BATCH = 32, 2
    report = {"stack": [], "module": [], "stack_profile": []}
    for name in ("DelayedScaling", "Float8CurrentScaling"):
        prof = stack_profile(name)
        if dist.get_rank() == 0:
            report["stack_profile"].append(prof)
            with open(sys.argv[1], "w") as f:
                json.dump(report, f, indent=1)
    for name in ("DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling"):
        for qinit in (False, True):
            report["stack"].append(stack_times(name, qinit))
        # Every rank times its own modules: DelayedScaling reduces amax over
        # the default group at autocast exit, so one rank alone would hang.
        timing = module_times(name)
        if dist.get_rank() == 0:
            report["module"].append(timing)
            with open(sys.argv[1], "w") as f:
                json.dump(report, f, indent=1)
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(report, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
