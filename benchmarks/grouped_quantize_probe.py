"""Probe (issue 38): quantizing a GroupedLinear's expert weights in few launches.

    python3 benchmarks/grouped_quantize_probe.py --out probe.json [--experts 32] [--rows 1536] [--cols 2048]

One GPU, TE 2.20 and torch on the path; no FSDP, no project code. For each
sm_90 recipe (DelayedScaling, Float8CurrentScaling, Float8BlockScaling) and
``--experts`` separate bf16 weights of ``--rows x --cols`` (separate tensors,
as FSDP2 gathers them: one buffer per parameter), each candidate way of
quantizing all experts is compared, bit for bit, with TE's per-expert
``quantizer.quantize(w)`` (what ``_GroupedLinear.forward`` does through
``quantize_weight``): rowwise data, columnwise (transpose) data and scale_inv,
and for delayed scaling the amax the casts leave in the amax history. Three
usages: ``rowwise`` (the forward of a plan that saves no workspace),
``both`` (stock's cached workspace) and ``columnwise`` (backward's rebuild;
per-tensor FP8 on Hopper builds both and drops the rowwise data, as the
drop-in's ``quantize_with_usage`` does). Each candidate is timed (host time of
the call and CUDA-event time, medians) and its kernels counted with
torch.profiler. Two call scenarios per recipe add up one GroupedLinear
call's weight quantizations: the drop-in today (forward rowwise, backward
rebuild per expert) against the proposed grouped forward and backward (the
backward reusing forward's per-tensor scales where the recipe has them).

Every candidate runs under try/except: a failure is printed and recorded,
and the run goes on. The table goes to stdout; everything to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
import traceback

MODES = {"rowwise": (True, False), "both": (True, True), "columnwise": (False, True)}
RECIPES = ("delayed", "current", "block")
#: Runtime calls that launch work on the GPU (torch.profiler CPU-side names).
LAUNCH_NAMES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx",
                "cudaLaunchCooperativeKernel", "cudaMemsetAsync", "cudaMemcpyAsync", "cudaGraphLaunch")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Issue 38 probe: grouped quantization of GroupedLinear expert weights against TE's "
                    "per-expert quantize, bit for bit, with times and kernel counts (one GPU).")
    parser.add_argument("--out", default=None, help="write the JSON report here")
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--rows", type=int, default=1536, help="out_features of one expert")
    parser.add_argument("--cols", type=int, default=2048, help="in_features of one expert")
    parser.add_argument("--recipes", default=",".join(RECIPES), help="comma list of " + ", ".join(RECIPES))
    parser.add_argument("--modes", default=",".join(MODES), help="comma list of " + ", ".join(MODES))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--no-edge-experts", action="store_true",
                        help="leave out the edge experts (one all zero, one with a tiny amax whose scale overflows)")
    parser.add_argument("--no-profile", action="store_true", help="skip the kernel counts")
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # CPU tests of the probe itself
    parser.add_argument("--budget-s", type=float, default=70.0,
                        help="after this many seconds, skip profiling and timing (checks still run)")
    return parser.parse_args(argv)


# -- output fields -------------------------------------------------------------------------------

_FIELDS = (("_data", "data"), ("_transpose", "transpose"), ("_scale_inv", "scale_inv"),
           ("_rowwise_data", "rowwise_data"), ("_columnwise_data", "columnwise_data"),
           ("_rowwise_scale_inv", "rowwise_scale_inv"), ("_columnwise_scale_inv", "columnwise_scale_inv"))


def fields(out) -> dict:
    """The tensors of one quantized weight, by name (absent or invalid ones left out)."""
    found = {}
    for attr, name in _FIELDS:
        value = getattr(out, attr, None)
        if value is None:
            continue
        if name == "transpose" and getattr(out, "_transpose_invalid", False):
            continue
        found[name] = value
    return found


def _bits(tensor):
    import torch

    t = tensor.detach().contiguous()
    if t.dtype.is_floating_point or t.dtype in (torch.int32, torch.int64):
        t = t.view(torch.uint8) if t.dim() > 0 else t.reshape(1).view(torch.uint8)
    return t


def compare(reference: list, candidate: list) -> dict:
    """Per field, the experts whose bits differ (shape, presence and bytes)."""
    import torch

    report = {"experts": len(reference), "fields": {}, "exact": True}
    if len(candidate) != len(reference):
        report.update(exact=False, error=f"{len(candidate)} outputs for {len(reference)} experts")
        return report
    names = sorted({n for r in reference for n in r})
    for name in names:
        bad = []
        for i, (ref, got) in enumerate(zip(reference, candidate)):
            a, b = ref.get(name), got.get(name)
            if a is None:
                continue
            if b is None:
                bad.append((i, "missing"))
            elif tuple(a.shape) != tuple(b.shape):
                bad.append((i, f"shape {tuple(b.shape)} != {tuple(a.shape)}"))
            elif not torch.equal(_bits(a), _bits(b)):
                bad.append((i, "bytes"))
        extra = [i for i, (ref, got) in enumerate(zip(reference, candidate)) if name not in ref and name in got]
        report["fields"][name] = {"mismatched": [i for i, _ in bad], "why": sorted({w for _, w in bad}),
                                  "extra_in_candidate": extra}
        if bad:
            report["exact"] = False
    return report


def snapshot(outs: list) -> list:
    return [{name: t.clone() for name, t in fields(out).items()} for out in outs]


# -- the recipes' quantizers ---------------------------------------------------------------------

class Env:
    """TE's modules, looked up once."""

    def __init__(self, device: str = "cuda"):
        import torch
        import transformer_engine.pytorch as te  # noqa: F401  (initialises the extension)
        import transformer_engine_torch as tex
        from transformer_engine.common import recipe as te_recipe
        from transformer_engine.pytorch.tensor.float8_tensor import Float8CurrentScalingQuantizer, Float8Quantizer
        from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer

        self.torch, self.te, self.tex, self.recipe = torch, te, tex, te_recipe
        self.Float8Quantizer = Float8Quantizer
        self.Float8CurrentScalingQuantizer = Float8CurrentScalingQuantizer
        self.Float8BlockQuantizer = Float8BlockQuantizer
        self.device = torch.device(device)
        self.e4m3 = tex.DType.kFloat8E4M3
        self.noop = torch.zeros(1, dtype=torch.int32, device=self.device)
        try:
            from transformer_engine.pytorch.quantization import RecipeState
        except ImportError:
            RecipeState = None
        self.RecipeState = RecipeState


class Setup:
    """One recipe's weights and quantizers (the module's per-expert quantizers)."""

    def __init__(self, env: Env, recipe: str, weights: list):
        self.env, self.recipe, self.weights = env, recipe, weights
        torch, n = env.torch, len(weights)
        self.amax_history = None
        self.delayed_scale = None
        if recipe == "delayed":
            rec = env.recipe.DelayedScaling()
            if env.RecipeState is not None:
                state = env.RecipeState.create(rec, mode="forward", num_quantizers=n)
                self.quantizers = state.make_quantizers()
                self.amax_history, self.delayed_scale = state.amax_history, state.scale
            else:
                self.amax_history = torch.zeros(rec.amax_history_len, n, dtype=torch.float32, device=env.device)
                self.delayed_scale = torch.ones(n, dtype=torch.float32, device=env.device)
                self.quantizers = [env.Float8Quantizer(self.delayed_scale[i], self.amax_history[0][i].reshape((1,)),
                                                       env.e4m3) for i in range(n)]
            # A scale as a step of delayed scaling leaves it: 448 / (amax * margin), per expert.
            amax = torch.stack([w.abs().amax().float() for w in weights]).clamp_min(1e-12)
            self.delayed_scale.copy_(448.0 / (amax * 1.25))
            self.describe = "Float8Quantizer (RecipeState(DelayedScaling()).make_quantizers(), scale 448/(1.25 amax))"
        elif recipe == "current":
            rec = env.recipe.Float8CurrentScaling()
            q = rec.fp8_quant_fwd_weight
            self.quantizers = [env.Float8CurrentScalingQuantizer(env.e4m3, env.device,
                                                                 force_pow_2_scales=q.power_2_scale,
                                                                 amax_epsilon=q.amax_epsilon) for _ in range(n)]
            self.describe = f"Float8CurrentScalingQuantizer(power_2={q.power_2_scale}, eps={q.amax_epsilon})"
        elif recipe == "block":
            rec = env.recipe.Float8BlockScaling()
            q = rec.fp8_quant_fwd_weight
            self.quantizers = [env.Float8BlockQuantizer(env.e4m3, rowwise=True, columnwise=True,
                                                        amax_epsilon=q.amax_epsilon,
                                                        force_pow_2_scales=q.power_2_scale,
                                                        block_scaling_dim=rec.w_block_scaling_dim) for _ in range(n)]
            self.describe = (f"Float8BlockQuantizer(dim={rec.w_block_scaling_dim}, power_2={q.power_2_scale}, "
                             f"eps={q.amax_epsilon})")
        else:
            raise ValueError(recipe)
        for quantizer in self.quantizers:
            quantizer.internal = True  # GroupedLinear's weight quantizers (bf16 parameters)

    def reset_amax(self) -> None:
        if self.amax_history is not None:
            self.amax_history[0].zero_()

    def amax_fields(self) -> dict:
        return {} if self.amax_history is None else {"amax_history[0]": self.amax_history[0].clone()}

    def set_usage(self, rowwise: bool, columnwise: bool, quantizers=None) -> None:
        for quantizer in quantizers or self.quantizers:
            quantizer.set_usage(rowwise=rowwise, columnwise=columnwise)


def drop_to(outs: list, rowwise: bool, columnwise: bool) -> list:
    """Keep only the usages named (as the drop-in's rebuild does for per-tensor FP8)."""
    for out in outs:
        usages = out.get_usages() if hasattr(out, "get_usages") else {"rowwise": True, "columnwise": True}
        if (usages.get("rowwise") and not rowwise) or (usages.get("columnwise") and not columnwise):
            out.update_usage(rowwise_usage=rowwise, columnwise_usage=columnwise)
    return outs


# -- candidates ----------------------------------------------------------------------------------

def per_expert(setup: Setup, rowwise: bool, columnwise: bool, quantizers=None) -> list:
    """TE's per-expert call (the reference); a format that cannot build the
    narrow usage (per-tensor FP8: columnwise alone) builds both and drops."""
    quantizers = quantizers or setup.quantizers
    outs = []
    for w, q in zip(setup.weights, quantizers):
        q.set_usage(rowwise=rowwise, columnwise=columnwise)
        try:
            outs.append(q.quantize(w))
        except (NotImplementedError, RuntimeError):
            if rowwise:  # only the narrow columnwise request may fall back
                raise
            q.set_usage(rowwise=True, columnwise=True)
            outs.append(drop_to([q.quantize(w)], rowwise, columnwise)[0])
    return outs


def multi_tensor_quantize(setup: Setup, rowwise: bool, columnwise: bool, both_then_drop: bool = False,
                          quantizers=None) -> list:
    """``tex.multi_tensor_quantize(weights, quantizers)``: one C++ call; one
    fused ``nvte_multi_cast_transpose`` launch (<= 64 tensors) where every
    quantizer is a ``Float8Quantizer`` and both usages are built, else one
    quantize per tensor inside C++."""
    tex = setup.env.tex
    quantizers = quantizers or setup.quantizers
    # Per-tensor FP8 on Hopper cannot build columnwise data alone (TE raises
    # NotImplementedError, or the fused kernel needs both): build both, drop.
    build_both = both_then_drop or (not rowwise and setup.recipe != "block")
    for q in quantizers:
        q.set_usage(rowwise=True if build_both else rowwise, columnwise=True if build_both else columnwise)
    try:
        outs = tex.multi_tensor_quantize(list(setup.weights), list(quantizers))
    except NotImplementedError:
        for q in quantizers:
            q.set_usage(rowwise=True, columnwise=True)
        outs = tex.multi_tensor_quantize(list(setup.weights), list(quantizers))
    return drop_to(list(outs), rowwise, columnwise)


def cat_split_quantize(setup: Setup, rowwise: bool, columnwise: bool) -> list:
    """``torch.cat`` then ``tex.split_quantize`` (bulk allocation for block
    scaling, the fused cast-transpose for delayed scaling with both usages)."""
    tex, torch = setup.env.tex, setup.env.torch
    build_both = not rowwise or setup.recipe == "delayed"
    setup.set_usage(True if build_both else rowwise, True if build_both else columnwise)
    stacked = torch.cat(setup.weights, dim=0)
    outs = tex.split_quantize(stacked, [w.shape[0] for w in setup.weights], list(setup.quantizers))
    return drop_to(list(outs), rowwise, columnwise)


def cat_group_quantize(setup: Setup, rowwise: bool, columnwise: bool) -> list:
    """``torch.cat`` then ``tex.group_quantize`` (one grouped kernel; current
    scaling adds a grouped amax and a grouped scale kernel), split into
    per-expert views."""
    tex, torch = setup.env.tex, setup.env.torch
    q = setup.quantizers[0]
    stacked = torch.cat(setup.weights, dim=0)
    q.set_usage(rowwise=rowwise, columnwise=columnwise)
    try:
        grouped = tex.group_quantize(stacked, q, len(setup.weights), None)
    except (NotImplementedError, RuntimeError):
        if rowwise:
            raise
        q.set_usage(rowwise=True, columnwise=True)
        grouped = tex.group_quantize(stacked, q, len(setup.weights), None)
    outs = getattr(grouped, "quantized_tensors", None) or grouped.split_into_quantized_tensors()
    return drop_to(list(outs), rowwise, columnwise)


def binding_quantize_experts(setup: Setup, rowwise: bool, columnwise: bool) -> list:
    """The binding's grouped quantization of a call's experts."""
    from te_integration.runtime._expert_quantize import quantize_experts

    outs = quantize_experts(setup.quantizers, list(setup.weights), rowwise, columnwise)
    if outs is None:
        raise RuntimeError("quantize_experts declined these experts (it quantizes them one by one then)")
    return outs


class ScaledCast:
    """Per-tensor current scaling in few launches: the experts' amaxes (one
    ``torch._foreach_norm(ord=inf)``, or TE's ``compute_amax`` per expert),
    their scales and scale_invs in one ``multi_tensor_compute_scale_and_scale_inv``
    (TE's own formula, ``compute_scale_from_amax``), then the casts through
    ``Float8Quantizer``s holding those scales (no amax), in one
    ``tex.multi_tensor_quantize`` (one fused cast-transpose when both usages
    are built). The quantizers and the scale buffer are made once (a module
    would keep them); ``keep`` holds the last amaxes for the backward reuse."""

    def __init__(self, setup: Setup):
        env, torch, n = setup.env, setup.env.torch, len(setup.weights)
        self.setup, self.env = setup, env
        ref = setup.quantizers[0]
        self.pow2, self.eps = bool(ref.force_pow_2_scales), float(ref.amax_epsilon)
        self.max_fp8 = 448.0 if int(ref.dtype) == int(env.e4m3) else 57344.0
        self.scale = torch.ones(n, dtype=torch.float32, device=env.device)
        self.scale_views = [self.scale[i:i + 1] for i in range(n)]
        self.scratch_inv = torch.ones(n, dtype=torch.float32, device=env.device)
        self.inv_views = [self.scratch_inv[i:i + 1] for i in range(n)]
        self.amax_buf = torch.zeros(n, dtype=torch.float32, device=env.device)
        self.amax_views = [self.amax_buf[i:i + 1] for i in range(n)]
        no_amax = torch.Tensor()
        self.casts = [env.Float8Quantizer(scale=view, amax=no_amax, fp8_dtype=ref.dtype) for view in self.scale_views]
        for q in self.casts:
            q.internal = True
        self.kept = None

    def amax_foreach(self):
        torch, weights = self.env.torch, self.setup.weights
        try:
            norms = torch._foreach_norm(weights, ord=math.inf, dtype=torch.float32)
        except (TypeError, RuntimeError):
            norms = [n.float() for n in torch._foreach_norm(weights, ord=math.inf)]
        return [n.reshape(1) for n in norms]

    def amax_te(self):
        for w, view in zip(self.setup.weights, self.amax_views):
            self.env.tex.compute_amax(w, view)
        return self.amax_views

    def scales(self, amaxes) -> None:
        self.env.tex.multi_tensor_compute_scale_and_scale_inv(
            2048 * 32, self.env.noop, [list(amaxes), self.scale_views, self.inv_views],
            self.max_fp8, self.pow2, self.eps)

    def cast(self, rowwise: bool, columnwise: bool, both_then_drop: bool) -> list:
        outs = multi_tensor_quantize(self.setup, rowwise, columnwise, both_then_drop, quantizers=self.casts)
        for out, q in zip(outs, self.setup.quantizers):  # as a fresh quantize would leave it
            if hasattr(out, "_quantizer"):
                out._quantizer = q
        return outs

    def forward(self, rowwise: bool, columnwise: bool, *, both_then_drop: bool = False, te_amax: bool = False):
        amaxes = self.amax_te() if te_amax else self.amax_foreach()
        self.scales(amaxes)
        self.kept = amaxes
        return self.cast(rowwise, columnwise, both_then_drop)

    def reuse(self, rowwise: bool, columnwise: bool, *, recompute_scales: bool = True) -> list:
        """Backward: the same gathered weights, forward's amaxes (or scales) kept."""
        if recompute_scales:
            self.scales(self.kept)
        return self.cast(rowwise, columnwise, both_then_drop=False)


def candidates(setup: Setup, rowwise: bool, columnwise: bool) -> list:
    """(name, what it stands for, callable) for one recipe and usage."""
    recipe = setup.recipe
    out = [
        ("per_expert", "TE's per-expert quantize (reference; the drop-in today)",
         lambda: per_expert(setup, rowwise, columnwise)),
        ("multi_tensor_quantize", "tex.multi_tensor_quantize(weights, quantizers)",
         lambda: multi_tensor_quantize(setup, rowwise, columnwise)),
    ]
    if rowwise and not columnwise:
        out.append(("multi_tensor_quantize_both_drop", "tex.multi_tensor_quantize building both, transposes dropped",
                    lambda: multi_tensor_quantize(setup, rowwise, columnwise, both_then_drop=True)))
    out.append(("cat_split_quantize", "torch.cat + tex.split_quantize", lambda: cat_split_quantize(setup, rowwise,
                                                                                                   columnwise)))
    if recipe in ("current", "block"):
        out.append(("cat_group_quantize", "torch.cat + tex.group_quantize + per-expert views",
                    lambda: cat_group_quantize(setup, rowwise, columnwise)))
    out.append(("binding_quantize_experts", "te_integration's quantize_experts (what the drop-in runs)",
                lambda: binding_quantize_experts(setup, rowwise, columnwise)))
    if recipe == "current":
        sc = ScaledCast(setup)
        out += [
            ("foreach_amax_scaled_cast", "foreach_norm(inf) amax + multi-tensor scale + multi_tensor_quantize "
             "with Float8Quantizer(scale)", lambda: sc.forward(rowwise, columnwise)),
            ("te_amax_scaled_cast", "TE compute_amax per expert + multi-tensor scale + multi_tensor_quantize",
             lambda: sc.forward(rowwise, columnwise, te_amax=True)),
        ]
        if rowwise and not columnwise:
            out.append(("foreach_amax_scaled_cast_both_drop", "as foreach_amax_scaled_cast, building both, "
                        "transposes dropped", lambda: sc.forward(rowwise, columnwise, both_then_drop=True)))

        def _prime_then(fn):
            def run():
                if sc.kept is None:
                    sc.forward(True, False)  # forward's amaxes (untimed where primed in setup)
                return fn()
            return run

        out += [
            ("reuse_amax_scaled_cast", "backward: forward's amaxes kept, scales again (1 launch) + "
             "multi_tensor_quantize", _prime_then(lambda: sc.reuse(rowwise, columnwise))),
            ("reuse_scale_cast", "backward: forward's scales kept, multi_tensor_quantize only",
             _prime_then(lambda: sc.reuse(rowwise, columnwise, recompute_scales=False))),
        ]
    return out


def scenarios(setup: Setup) -> list:
    """One GroupedLinear call's weight quantizations, forward and backward."""
    recipe = setup.recipe

    def dropin_today():
        fwd = per_expert(setup, True, False)
        del fwd
        return per_expert(setup, False, True)

    def stock_cached_first_microbatch():
        return per_expert(setup, True, True)

    out = [("call_dropin_today", "forward rowwise per expert + backward columnwise per expert", dropin_today),
           ("call_stock_first_microbatch", "stock's cached quantization (both usages per expert; once per step "
            "with caching)", stock_cached_first_microbatch)]
    if recipe == "delayed":
        def grouped():
            fwd = multi_tensor_quantize(setup, True, False, both_then_drop=True)
            del fwd
            return multi_tensor_quantize(setup, False, True)
        out.append(("call_proposed", "forward multi_tensor_quantize (both, drop transposes) + backward "
                    "multi_tensor_quantize (both, drop rowwise)", grouped))
    elif recipe == "current":
        sc = ScaledCast(setup)

        def grouped():
            fwd = sc.forward(True, False, both_then_drop=True)
            del fwd
            return sc.reuse(False, True)
        out.append(("call_proposed", "forward foreach amax + scales + fused cast (drop transposes); backward "
                    "scales from kept amaxes + fused cast (drop rowwise)", grouped))

        def grouped_rowwise():
            fwd = sc.forward(True, False)
            del fwd
            return sc.reuse(False, True)
        out.append(("call_proposed_rowwise_fwd", "as call_proposed, forward casting rowwise only (one cast per "
                    "expert in C++, no transient transposes)", grouped_rowwise))
    elif recipe == "block":
        def grouped():
            fwd = cat_group_quantize(setup, True, False)
            del fwd
            return cat_group_quantize(setup, False, True)
        out.append(("call_proposed", "forward and backward torch.cat + tex.group_quantize", grouped))

        def mtq():
            fwd = multi_tensor_quantize(setup, True, False)
            del fwd
            return multi_tensor_quantize(setup, False, True)
        out.append(("call_proposed_mtq", "forward and backward tex.multi_tensor_quantize (one C++ call, a "
                    "kernel per expert)", mtq))
    return out


# -- measuring -----------------------------------------------------------------------------------

def count_kernels(env: Env, fn) -> dict:
    from torch.profiler import ProfilerActivity, profile

    torch = env.torch
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    device_events, launches, names = 0, 0, {}
    for event in prof.events():
        kind = str(getattr(event, "device_type", "")).upper()
        if kind.endswith("CUDA"):
            device_events += 1
            short = event.name if len(event.name) < 70 else event.name[:67] + "..."
            names[short] = names.get(short, 0) + 1
        elif event.name in LAUNCH_NAMES:
            launches += 1
    top = sorted(names.items(), key=lambda kv: -kv[1])[:8]
    return {"gpu_activities": device_events, "launch_calls": launches, "top_kernels": top}


def time_it(env: Env, fn, warmup: int, iters: int) -> dict:
    torch = env.torch
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    host, gpu = [], []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        end.record()
        torch.cuda.synchronize()
        host.append((t1 - t0) * 1e3)
        gpu.append(start.elapsed_time(end))
    return {"host_ms": statistics.median(host), "gpu_ms": statistics.median(gpu), "host_ms_all": host,
            "gpu_ms_all": gpu}


def make_weights(env: Env, args) -> list:
    torch = env.torch
    gen = torch.Generator(device=env.device).manual_seed(args.seed)
    weights = []
    for i in range(args.experts):
        w = torch.randn(args.rows, args.cols, device=env.device, dtype=torch.float32, generator=gen)
        weights.append((w * (0.02 * (1.0 + 3.0 * i / max(1, args.experts)))).to(torch.bfloat16).contiguous())
    if not args.no_edge_experts and args.experts >= 4:
        weights[-1].zero_()  # amax 0: scale 1
        weights[-2].mul_(1e-36)  # a tiny amax: 448/amax overflows fp32, scale = FLT_MAX
        weights[-3][0, 0] = 1e4  # one outlier
    return weights


def run_one(env, setup, recipe, mode, name, what, fn, reference, ref_amax, args, t_start, rows_out):
    torch = env.torch
    row = {"recipe": recipe, "mode": mode, "method": name, "what": what}
    try:
        setup.reset_amax()
        outs = fn()
        torch.cuda.synchronize()
        got = snapshot(outs)
        del outs
        if reference is not None:
            report = compare(reference, got)
            if ref_amax:
                amax_now = setup.amax_fields()
                for key, value in ref_amax.items():
                    same = torch.equal(_bits(value), _bits(amax_now[key]))
                    report["fields"][key] = {"mismatched": [] if same else ["amax"], "why": [] if same else ["bytes"],
                                             "extra_in_candidate": []}
                    report["exact"] = report["exact"] and same
            row["check"] = report
            row["exact"] = report["exact"]
        del got
        over = time.perf_counter() - t_start > args.budget_s
        if not over:
            row.update(time_it(env, fn, args.warmup, args.iters))
            if not args.no_profile:
                row.update(count_kernels(env, fn))
        else:
            row["skipped"] = "over --budget-s: timing and profiling skipped"
    except Exception as exc:  # noqa: BLE001  (one failure must not end the run)
        row["error"] = f"{type(exc).__name__}: {exc}"
        row["traceback"] = traceback.format_exc(limit=6)
        print(f"  [{recipe}/{mode}/{name}] FAILED: {row['error']}", flush=True)
    rows_out.append(row)
    torch.cuda.synchronize()
    return row


def fmt(row) -> str:
    exact = row.get("exact")
    exact_s = "-" if exact is None else ("yes" if exact else "NO")
    if "error" in row:
        return f"{row['recipe']:8} {row['mode']:10} {row['method']:36} ERROR {row['error'][:80]}"
    bad = ""
    if exact is False:
        bad = " " + ";".join(f"{k}:{v['mismatched'][:6]}{v['why']}" for k, v in row["check"]["fields"].items()
                             if v["mismatched"])
    host, gpu = row.get("host_ms"), row.get("gpu_ms")
    kern, launch = row.get("gpu_activities"), row.get("launch_calls")
    num = (f"{host:9.3f} {gpu:9.3f}" if host is not None else f"{'-':>9} {'-':>9}")
    num += f" {kern if kern is not None else '-':>7} {launch if launch is not None else '-':>7}"
    return f"{row['recipe']:8} {row['mode']:10} {row['method']:36} {exact_s:5} {num}{bad}"


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    report = {"probe": "grouped_quantize_probe", "config": vars(args), "results": [], "errors": []}
    try:
        env = Env(args.device)
    except Exception as exc:  # noqa: BLE001
        print(f"cannot import torch/TransformerEngine or find a GPU: {exc}", file=sys.stderr)
        report["errors"].append(f"setup: {type(exc).__name__}: {exc}")
        _write(args.out, report)
        return 2
    torch = env.torch
    report["env"] = {"python": platform.python_version(), "torch": torch.__version__,
                     "te": getattr(__import__("transformer_engine"), "__version__", "?"),
                     "gpu": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
                     "cuda": torch.version.cuda}
    print(f"env: {report['env']}")
    print(f"experts {args.experts} x ({args.rows}, {args.cols}) bf16, warmup {args.warmup}, iters {args.iters}")
    weights = make_weights(env, args)
    recipes = [r for r in args.recipes.split(",") if r]
    modes = [m for m in args.modes.split(",") if m]
    header = (f"{'recipe':8} {'mode':10} {'method':36} {'exact':5} {'host_ms':>9} {'gpu_ms':>9} {'kernels':>7} "
              f"{'launch':>7}")
    print(header)
    print("-" * len(header))
    for recipe in recipes:
        try:
            setup = Setup(env, recipe, weights)
        except Exception as exc:  # noqa: BLE001
            report["errors"].append(f"{recipe}: setup: {type(exc).__name__}: {exc}")
            print(f"{recipe}: setup FAILED: {exc}", flush=True)
            continue
        report.setdefault("quantizers", {})[recipe] = setup.describe
        for mode in modes:
            rowwise, columnwise = MODES[mode]
            try:
                setup.reset_amax()
                reference = snapshot(per_expert(setup, rowwise, columnwise))
                torch.cuda.synchronize()
                ref_amax = setup.amax_fields()
            except Exception as exc:  # noqa: BLE001
                report["errors"].append(f"{recipe}/{mode}: reference: {type(exc).__name__}: {exc}")
                print(f"{recipe}/{mode}: reference FAILED: {exc}", flush=True)
                continue
            for name, what, fn in candidates(setup, rowwise, columnwise):
                row = run_one(env, setup, recipe, mode, name, what, fn, reference, ref_amax, args, t_start,
                              report["results"])
                print(fmt(row), flush=True)
            del reference
        # One call's forward + backward quantizations; checked against the drop-in's backward output.
        try:
            setup.reset_amax()
            dropin_bwd = snapshot(per_expert(setup, False, True))
            ref_amax = setup.amax_fields()
        except Exception as exc:  # noqa: BLE001
            dropin_bwd, ref_amax = None, None
            report["errors"].append(f"{recipe}/call: reference: {exc}")
        for name, what, fn in scenarios(setup):
            def whole(fn=fn):
                setup.reset_amax()
                return fn()
            row = run_one(env, setup, recipe, "call", name, what, whole, dropin_bwd, ref_amax, args, t_start,
                          report["results"])
            print(fmt(row), flush=True)
        del setup
        torch.cuda.empty_cache()
    report["elapsed_s"] = time.perf_counter() - t_start
    print(f"elapsed {report['elapsed_s']:.1f} s")
    _summary(report)
    _write(args.out, report)
    return 0


def _summary(report) -> None:
    """Per recipe and mode, the fastest exact method by host time."""
    best = {}
    for row in report["results"]:
        if row.get("exact") and row.get("host_ms") is not None:
            key = (row["recipe"], row["mode"])
            if key not in best or row["host_ms"] < best[key]["host_ms"]:
                best[key] = row
    lines = []
    for (recipe, mode), row in sorted(best.items()):
        lines.append(f"{recipe}/{mode}: {row['method']} host {row['host_ms']:.3f} ms, gpu {row['gpu_ms']:.3f} ms, "
                     f"kernels {row.get('gpu_activities', '-')}")
    report["best_exact_by_host_time"] = lines
    print("best exact method by host time:")
    for line in lines:
        print("  " + line)


def _write(path, report) -> None:
    if not path:
        return
    with open(path, "w") as handle:
        json.dump(report, handle, indent=1, default=str)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
