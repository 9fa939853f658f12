"""TransformerEngine's own PyTorch tests, stock against the drop-ins: a test
harness, run from the repository root on a machine with CUDA and TE.

    python3 -m tests.te_suite --tests-dir DIR --out OUT [--quick | --grouped] [--files PATH ...] [-k EXPR]

| module | holds |
|---|---|
| ``harness`` | the command line, one pytest process per file and variant, timeouts, the outputs |
| ``selection`` | what runs: TE's test files and their ``-k`` selections (``FULL``, ``QUICK``, ``GROUPED``, ``OPS``) |
| ``plugin`` | the pytest plugin (``-p tests.te_suite.plugin``) that swaps the drop-ins in before collection and records it |
| ``report`` | per-test outcomes from JUnit XML, the stock/drop-in comparison and its summary |

``test_te_suite.py`` and ``test_te_suite_grouped.py`` cover all three on CPU over a small TE stand-in.
See README.md beside this file.
"""
