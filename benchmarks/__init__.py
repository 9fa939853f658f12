"""Benchmarks: memory and step time of the drop-in TE modules against stock TE.

Each benchmark is a module run with ``python -m`` (``torchrun
--nproc_per_node=2 -m benchmarks.<name>`` where FSDP2 is involved). Each one
writes a JSON result (configuration, environment, raw samples, summary) and a
Markdown summary table to ``benchmarks/results/`` (``--out``), and
``python -m benchmarks.plot`` turns results into PNG figures.

| module | runs on | measures |
|---|---|---|
| ``fsdp2_memory`` | 2 GPUs, FSDP2 | memory, step time: stock/drop-in/bf16, recipe x init; depth sweep |
| ``microbatch`` | 2 GPUs, FSDP2 | ``reshard_after_forward=False``, 4 and 8 microbatches, the microbatch cache option pinned: quantizations, time |
| ``recompute`` | 2 GPUs, FSDP2 | ``te.checkpoint`` around every layer: memory and step time |
| ``soak`` | 2 GPUs, FSDP2 | allocated memory after each of 200 steps: flat after warm-up |
| ``step_time`` | 2 GPUs, FSDP2 | paired step time: stock, drop-in and a second stock (the noise floor) take turns step by step; ``--policy`` pins an option on the drop-in |
| ``timeline`` | CPU, after a GPU run | live workspace bytes at every forward/backward boundary of one step, stock vs drop-in, from the FSDP2 worker's attribution report |
| ``call_overhead`` | 1 GPU | host time a drop-in adds per module call (forward + backward), paired with a stock control, ``GroupedLinear`` with 8 and 64 experts included (the added time must not grow with the experts); a profile of where it goes |
| ``saved_workspace`` | 1 GPU, no FSDP | memory held from forward to backward, peak and paired step time: stock, drop-in (D11), ``LeanWorkspacePolicy``, bf16; bit-exact check; what one layer keeps for backward, tensor by tensor |
| ``moe_memory`` | 1 or 2 GPUs, FSDP2 and unsharded | MoE expert stacks of ``te.GroupedLinear`` (8 and 64 experts): memory per block, held, peak, after backward and step, stock/drop-in/bf16 per recipe, 1 and 4 microbatches; unsharded with ``LeanWorkspacePolicy``; paired step time with a control |
| ``budget`` | 1 or 2 GPUs, FSDP2 | ``apply_workspace_budget`` at 0/25/50/100% of one FP8 copy of the weights vs stock: paired step time, step peak |
| ``ops_memory`` | 1 or 2 GPUs, FSDP2 | te.ops (issue 28): the ``te.ops.Linear`` stack and a ``te.ops.Sequential`` MLP, stock/drop-in/bf16 and the ``te.Linear`` stack: per-block forward rise, peak, losses, step time with a stock control |
| ``fp8_params`` | 1 GPU, no FSDP | TE's FP8-parameter flow (``quantized_model_init`` + FusedAdam): loss per step of stock, the stale-free reference, the drop-in and bf16; the drop-in equals the reference; paired step time with a control, the step task timed alone (D12) |
| ``moe_step`` | 1 or 2 GPUs, FSDP2 | issue 38: MoE expert MLP layers (GroupedLinear -> GELU -> GroupedLinear + residual, uneven routing) per sm_90 recipe, 1 and 4 microbatches, bf16 and quantized parameters: step time stock/drop-in/control in turn, a profiled step (CUDA kernels, launches, GPU busy, Python calls) and memory against bf16 |
| ``grouped_quantize_probe`` | 1 GPU, no FSDP, no project code | issue 38: ways to quantize a GroupedLinear's separate expert weights in few launches, per sm_90 recipe, against TE's per-expert quantize bit for bit; host/GPU time and kernel counts |
| ``policy_overhead`` | CPU | policy selection plus planning per call, in ns, against a no-op |
| ``run_all`` | 2 GPUs | all of the above in one command, within a time budget, then the plots |

The harness (``_harness``) needs neither CUDA nor TransformerEngine; the GPU
pieces (``_stack``, ``_runner``) import TE, CUDA and ``te_integration`` only
inside the functions that use them, so ``--help`` and the CPU tests
(``benchmarks/tests``) work without them. The model, the process group and
the recipes come from ``testbed``, which the GPU test workers of
``tests/gpu`` build from too; nothing imports this package, and it imports
nothing from ``tests``. TE's own tests on the drop-ins are run by a test
harness, ``python3 -m tests.te_suite``. See benchmarks/README.md.
"""
