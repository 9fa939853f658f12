"""What the tests and the benchmarks share: the GPU model they both build,
the torchrun worker skeleton, TE's recipes by name, the environment a
result records, and the reading of the attribution report. One copy keeps a
GPU test and a benchmark measuring the same thing.

| module | holds |
|---|---|
| ``model`` | the FSDP2 stack of ``te.TransformerLayer`` (stock or drop-in), its optimizer, seeded data, memory marks, the quantization counter |
| ``experts`` | the MoE expert stack of ``te.GroupedLinear`` (stock or drop-in, either parameter layout, FSDP2 or unsharded) and its reference of per-expert ``te.Linear`` modules |
| ``moe_mlp`` | the MoE MLP of issue 38: GroupedLinear -> GELU -> GroupedLinear + residual per layer, tokens routed unevenly (one expert empty), bf16 or quantized parameters, stock or drop-in, under FSDP2 |
| ``recipes`` | TE's recipe objects by name and TE's own support check |
| ``gather`` | the quantized FSDP2 all-gather (D13) set up on a model, pinned on at any world size, and the bytes FSDP2's all-gathers hand a rank |
| ``dist`` | the NCCL process group of a torchrun rank, ``guard`` and the GPU workers' skeleton ``run_worker`` |
| ``record`` | what a result records about where it ran (commit, TE, torch, GPUs) and its JSON values |
| ``attribution`` | how far the attribution report's bytes and allocated memory disagree |
| ``freshness`` | two blocks of each module kind with quantized parameters (any sharding), the stale-free reference, and the training loop the freshness test and ``benchmarks.fp8_params`` share |

``tests`` and ``benchmarks`` import this package; it imports neither. It is
not installed by pip (``pyproject.toml`` ships ``workspace_manager`` and
``te_integration`` only): it is imported from the repository root, which
``python3 -m pytest`` and ``python3 -m benchmarks.<name>`` put on
``sys.path``, and which the torchrun workers of ``tests/gpu`` put there
themselves. TE, CUDA and ``torch.distributed`` are imported inside the
functions that use them, so importing any module here needs torch at most.
"""
