"""The test tiers: ``unit`` (CPU), ``distributed`` (torchrun and gloo on
CPU), ``gpu`` (CUDA and TransformerEngine) and ``te_suite``, the harness that
runs TE's own tests on the drop-ins. A package, so that ``tests.te_suite``
is importable by that name (``python3 -m tests.te_suite``, and its pytest
plugin ``-p tests.te_suite.plugin``) ahead of any other ``tests``.
"""
