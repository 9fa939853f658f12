"""What ``tests.te_suite`` runs: TE's test files with their ``-k``
selections (the tables :data:`FULL`, :data:`QUICK`, :data:`GROUPED` and
:data:`OPS`), how each is launched, and the choice ``--quick``, ``--grouped``, ``--ops``, ``--files``
and ``-k`` make among them. Pure: nothing here runs a test."""

from __future__ import annotations

import argparse
import enum
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Entry", "FULL", "GROUPED", "Launcher", "OPS", "QUICK", "entries_for"]


class Launcher(enum.Enum):
    PYTEST = "pytest"
    TORCHRUN = "torchrun"  # one pytest per rank: the FSDP2 suite


@dataclass(frozen=True)
class Entry:
    """A test file or folder of TE's suite (relative to ``--tests-dir``) and its ``-k`` selection."""

    path: str
    select: str = ""
    launcher: Launcher = Launcher.PYTEST
    #: te.ops's BasicLinear and GroupedLinear are swapped too (``tests.te_suite.ops_swap``).
    ops: bool = False


_LARGE = "(linear or mlp) and not grouped"
_FSDP2 = "fsdp2/run_fsdp2_mem_leak.py"

#: The default run: large files cut to the dense swapped modules, as TE's
#: own results for this comparison were taken; the rest whole (their
#: GroupedLinear cases included); GroupedLinear's own file whole.
FULL: tuple[Entry, ...] = (
    Entry("test_sanity.py", _LARGE),
    Entry("test_grouped_linear.py"),
    Entry("test_numerics.py", f"{_LARGE} and not delay_wgrad"),
    Entry("test_cuda_graphs.py"),
    Entry("test_deferred_init.py"),
    Entry("test_backward_override.py"),
    Entry("test_torch_compile.py"),
    Entry("test_distributed_weight.py"),
    Entry("test_custom_recipe.py"),
    Entry("test_hybrid_quantization.py"),
    Entry("layernorm_mlp"),
    Entry(_FSDP2, launcher=Launcher.TORCHRUN),
)

#: ``--quick``: about 570 tests (counted from the files' parametrizations
#: for an sm_90 GPU; many skip there), with the LayerNormMLP recompute and
#: weight-caching cases; the small files first, test_numerics last.
QUICK: tuple[Entry, ...] = (
    Entry("test_deferred_init.py"),  # 17
    Entry("layernorm_mlp"),  # 16
    Entry("test_backward_override.py", "not grouped and (save_original_input or recipe_matches or memory_peak)"),  # 42
    Entry("test_cuda_graphs.py", "fp8_weight_caching and not grouped"),  # 324
    Entry(_FSDP2, launcher=Launcher.TORCHRUN),  # 30
    Entry("test_numerics.py", "(linear or mlp_accuracy_checkpoint) and not grouped and not delay_wgrad"),  # 138
)

#: ``--grouped``: the GroupedLinear tests (stock TE 2.20.2 on one H200: test_grouped_linear.py
#: 1064 passed and 507 skipped; test_sanity.py -k grouped 975 passed), then the grouped cases
#: of the files the default run has whole.
GROUPED: tuple[Entry, ...] = (
    Entry("test_grouped_linear.py"),
    Entry("test_sanity.py", "grouped"),
    Entry("test_backward_override.py", "grouped"),
    Entry("test_cuda_graphs.py", "grouped"),
)


#: ``--ops``: TE's fusible-ops files with te.ops's BasicLinear and GroupedLinear swapped
#: too; test_fusible_ops.py cut to the linear ops, as TE's own results for them were taken.
OPS: tuple[Entry, ...] = (
    Entry("test_fusible_ops.py", "basic_linear or test_linear or grouped_linear", ops=True),
    Entry("test_grouped_mlp.py", ops=True),
)


def entries_for(args: argparse.Namespace) -> tuple[Entry, ...]:
    table = (OPS if getattr(args, "ops", False) else QUICK if args.quick else GROUPED if args.grouped
             else FULL)
    if args.files:
        known = {e.path: e for e in (*OPS, *FULL, *table)}  # the chosen table's selection wins
        picked = [known.get(path.rstrip("/")) or Entry(path.rstrip("/"), launcher=_launcher_for(path))
                  for path in args.files]
    else:
        picked = list(table)
    if args.select is not None:
        picked = [Entry(e.path, args.select, e.launcher, e.ops) for e in picked]
    return tuple(picked)


def _launcher_for(path: str) -> Launcher:
    return Launcher.TORCHRUN if Path(path).parts[:1] == ("fsdp2",) else Launcher.PYTEST
