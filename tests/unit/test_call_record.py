"""A drop-in call's record (``te_integration.runtime._call.CallRecord``) answers every
field whichever path made it and whatever its kind: the hot path
(``_modules.prepare_forward``) fills the fields inline, the other paths
through ``new_record``, and a kind's own data lives in ``part``."""

from __future__ import annotations

import pytest
import torch
from _fake_te import TELinear, load_full_binding


@pytest.fixture
def ti(monkeypatch):
    return load_full_binding(monkeypatch)


def _unset(record) -> list[str]:
    unset = []
    for name in type(record).__slots__:
        try:
            getattr(record, name)
        except AttributeError:
            unset.append(name)
    return unset


def test_the_hot_path_sets_every_field_of_its_record(ti):
    managed = ti.modules.convert_model(TELinear(8, 8))
    managed(torch.randn(2, 8))  # the first call installs the seams
    managed.prepare_forward(torch.randn(2, 8))
    record = ti.call.ACTIVE.record
    try:
        assert record.module is managed and _unset(record) == []
        assert record.part is None and record.weights == () and not record.pushed_by_seam
    finally:
        managed.end_forward()
    assert ti.call.ACTIVE.record is None


def test_new_record_sets_every_field_and_a_part_answers_the_shared_seams_questions(ti):
    managed = ti.modules.convert_model(TELinear(8, 8))
    state = ti.state.state_of(managed)
    record = ti.call.new_record(managed, state, None, None, pushed_by_seam=True)
    assert _unset(record) == [] and record.pushed_by_seam and record.part is None
    part = ti.call.CallPart()
    assert part.experts is None and part.dropped is None  # what _quantize asks of any kind's part
    assert set(ti.call.CallRecord.__slots__) == {"module", "state", "kind", "sharding", "previous", "weights",
                                                 "pending", "rowwise_parts", "pushed_by_seam", "run", "part"}
