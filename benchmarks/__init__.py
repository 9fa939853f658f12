"""Benchmarks: memory and step time of the drop-in TE modules against stock TE.

Each benchmark is a module run with ``python -m benchmarks.<name>``
(``torchrun --nproc_per_node=N -m benchmarks.<name>`` where FSDP2 is
involved) and writes its one current result, JSON, Markdown and figures, to
``benchmarks/results/<name>/``, replacing the one there. The harness
(``_harness``, ``_runner``) needs neither CUDA nor TransformerEngine; the GPU
pieces import TE, CUDA and ``te_integration`` inside the functions that use
them, so ``--help``, ``--dry-run`` and the CPU tests (``benchmarks/tests``)
work without them. The models come from ``testbed``, which the GPU tests
build from too. The benchmarks use the packages' public names only; nothing
imports this package. See benchmarks/README.md.
"""
