"""The code the GPU benchmarks and the GPU test workers share, on CPU.

``testbed/model.py`` builds the model both measure and
``testbed/dist.py`` holds the worker skeleton; the torchrun workers of
``tests/gpu`` import them. Here, without CUDA or TE: the sharding step keeps
the parameter attributes ``fully_shard`` drops (gloo, world size 1), the
skeleton records failures and writes the report on rank 0 only, and every
worker imports on CPU and goes through the skeleton.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from testbed import dist as _dist  # noqa: E402
from testbed.model import shard  # noqa: E402

GPU_TESTS = ROOT / "tests" / "gpu"
WORKERS = sorted(p for p in GPU_TESTS.glob("_*.py") if "def main" in p.read_text())


class Seeded(torch.nn.Linear):
    """A layer whose ``reset_parameters`` records the first number it draws."""

    drawn: list[float] = []

    def reset_parameters(self) -> None:
        super().reset_parameters()
        type(self).drawn.append(float(torch.rand(1)))


def _tagged_stack() -> torch.nn.Sequential:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    for i, p in enumerate(model.parameters()):
        p.partition_dim = i  # as TE's set_tensor_model_parallel_attributes does
    return model


# -- the model builder's sharding step ------------------------------------------------------
def test_fully_shard_alone_drops_parameter_attributes_and_shard_keeps_them(gloo):
    from torch.distributed.fsdp import fully_shard

    bare = _tagged_stack()
    for child in bare.children():
        fully_shard(child)
    fully_shard(bare)
    assert not any(hasattr(p, "partition_dim") for p in bare.parameters()), "the premise of shard()'s fix"

    model = _tagged_stack()
    shard(model, reshard_after_forward=True)
    params = list(model.parameters())
    assert all(type(p).__name__ == "DTensor" for p in params)
    assert [p.partition_dim for p in params] == list(range(len(params)))
    assert model(torch.randn(2, 4)).shape == (2, 4)


def _seeded_draws(materialize: bool, seed_before: int = 123) -> list[float]:
    """What ``reset_parameters`` drew inside ``shard`` (construction's own draws left out)."""
    model = torch.nn.Sequential(Seeded(4, 4), Seeded(4, 4))
    Seeded.drawn = []
    torch.manual_seed(seed_before)
    shard(model, reshard_after_forward=False, materialize=materialize)
    return list(Seeded.drawn)


def test_shard_materializes_from_seed_zero_only_when_asked(gloo):
    assert _seeded_draws(materialize=False) == [], "no reset without materialize"
    first = _seeded_draws(materialize=True)
    assert len(first) == 2, "one reset per layer"
    # shard() seeds itself: the generator's state before it does not matter.
    assert _seeded_draws(materialize=True, seed_before=7) == first


# -- the worker skeleton -------------------------------------------------------------------
class FakeDist:
    """Stands in for ``_dist.Dist`` (NCCL): rank given, closing recorded."""

    instances: list[FakeDist] = []

    def __init__(self, timeout_s=300.0, *, main: bool = True) -> None:
        self.timeout_s, self.is_main, self.closed = timeout_s, main, False
        FakeDist.instances.append(self)

    def close(self) -> None:
        self.closed = True


def test_guard_records_a_failure_and_goes_on():
    report = {"errors": []}
    assert _dist.guard(report, "fine", lambda: None) is True
    assert _dist.guard(report, "broken", lambda: 1 / 0) is False
    assert [e["where"] for e in report["errors"]] == ["broken"]
    assert "ZeroDivisionError" in report["errors"][0]["traceback"]


def test_guard_lets_other_base_exceptions_through_unless_named():
    class Stop(BaseException):  # as DCP's CheckpointException
        pass

    def stop():
        raise Stop

    report = {"errors": []}
    with pytest.raises(Stop):
        _dist.guard(report, "dcp", stop)
    assert _dist.guard(report, "dcp", stop, catch=(Exception, Stop)) is False
    assert [e["where"] for e in report["errors"]] == ["dcp"]


@pytest.mark.parametrize("fails", [False, True])
def test_run_worker_writes_the_report_on_rank_zero(monkeypatch, tmp_path, fails):
    FakeDist.instances = []
    monkeypatch.setattr(_dist, "Dist", FakeDist)

    def body(report):
        report["runs"].append("first")
        if fails:
            raise RuntimeError("escaped the cases")

    out = tmp_path / "report.json"
    rc = _dist.run_worker(out, body, runs=[])
    written = json.loads(out.read_text())
    assert written["runs"] == ["first"]
    assert [e["where"] for e in written["errors"]] == (["worker"] if fails else [])
    assert rc == (1 if fails else 0)
    (dist,) = FakeDist.instances
    assert dist.closed and dist.timeout_s is None  # torch's own NCCL timeout, as the workers had


def test_run_worker_writes_nothing_on_other_ranks(monkeypatch, tmp_path):
    monkeypatch.setattr(_dist, "Dist", lambda timeout_s: FakeDist(timeout_s, main=False))
    out = tmp_path / "report.json"
    assert _dist.run_worker(out, lambda report: None) == 0
    assert not out.exists()


# -- the tests/gpu workers ------------------------------------------------------------------
def test_there_are_workers_to_check():
    assert {p.name for p in WORKERS} >= {"_fsdp2_stack.py", "_custom_fsdp2.py", "_sharded_params.py",
                                         "_mode_switch.py"}


@pytest.mark.parametrize("worker", WORKERS, ids=lambda p: p.name)
def test_every_worker_goes_through_the_shared_skeleton(worker):
    tree = ast.parse(worker.read_text())
    called = {n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", None)
              for n in ast.walk(tree) if isinstance(n, ast.Call)}
    assert "run_worker" in called
    assert not called & {"init_process_group", "destroy_process_group", "barrier"}, "use testbed.dist.run_worker"


def test_every_worker_imports_on_cpu_without_te():
    code = ("import sys; sys.path.insert(0, sys.argv[1])\n"
            "import importlib\n"
            "for name in sys.argv[2:]:\n"
            "    importlib.import_module(name)\n"
            "assert 'transformer_engine' not in sys.modules\n")
    done = subprocess.run([sys.executable, "-c", code, str(GPU_TESTS), *(p.stem for p in WORKERS)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]


# -- pinning a policy on the stack's drop-ins ---------------------------------------------------
def test_pin_policy_pins_every_drop_in_and_refuses_a_model_without_one(monkeypatch):
    """``build_stack(policy=...)`` pins through ``pin_policy``: the GPU tests
    and benchmarks measure the options, off by default, that way."""
    from _fake_te import TELinear, load_full_binding

    from testbed.model import pin_policy
    from workspace_manager import named_policy

    ti = load_full_binding(monkeypatch)
    package = sys.modules["te_integration"]  # the stand-in package: give it the public names pin_policy uses
    for name in ("Linear", "LayerNormLinear", "LayerNormMLP"):
        monkeypatch.setattr(package, name, getattr(ti.kinds, name), raising=False)
    monkeypatch.setattr(package, "set_workspace_policy", ti.modules.set_workspace_policy, raising=False)
    model = torch.nn.Sequential(TELinear(8, 8, seed=1), torch.nn.ReLU(), TELinear(8, 8, seed=2))
    ti.modules.convert_model(model)
    option = named_policy("fsdp2_microbatch_cache")
    assert pin_policy(model, option) == 2
    assert [m.workspace_policy for m in model if isinstance(m, ti.kinds.Linear)] == [option, option]
    with pytest.raises(ValueError, match="holds no drop-in module"):
        pin_policy(torch.nn.Sequential(torch.nn.ReLU()), option)


def test_the_conformance_tests_stock_fails_warning_is_not_filtered_out():
    """Settings stock TE fails are reported as a warning. Round 6's
    UserWarning subclass was hidden by the module's own ``ignore::UserWarning``;
    round 7's Warning subclass was turned into a failure by the project's
    ``error`` filter. Here, under the GPU module's filters and ``error``, the
    report is recorded and raises nothing."""
    import builtins
    import re
    import warnings

    sys.path.insert(0, str(GPU_TESTS))
    try:
        from _conformance_run import StockTEFailsWarning, report_stock_failures
    finally:
        sys.path.remove(str(GPU_TESTS))
    ignored = re.findall(r'"ignore::(\w+)"', (GPU_TESTS / "test_conformance.py").read_text())
    assert ignored
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("error")
        for name in ignored:
            warnings.filterwarnings("ignore", category=getattr(builtins, name))
        report_stock_failures(["Float8CurrentScaling/Linear: stock TE itself raises IndexError"])
    assert [(w.category, str(w.message)) for w in seen] == [
        (StockTEFailsWarning, "setting not run, stock TE fails it: Float8CurrentScaling/Linear: stock TE itself "
                              "raises IndexError")]
