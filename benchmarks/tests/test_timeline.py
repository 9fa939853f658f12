"""benchmarks.timeline on a synthetic attribution report (no GPU, no TE)."""

from __future__ import annotations

import json

import pytest

from benchmarks import timeline as tl

KIB = 1024


def _point(label, phase, by_module, allocated):
    return {"label": label, "phase": phase, "module": "", "by_module": by_module,
            "total_bytes": sum(by_module.values()), "allocated_bytes": allocated}


def _side(baseline, points, after_kinds, leftovers=()):
    return {"baseline": baseline, "timeline": points,
            "after_step": {"by_kind": after_kinds, "leftovers": list(leftovers), "total_bytes": 0},
            "after_step_table": ""}


def _run(extra_alloc=0):
    # Stock keeps a 3 MiB columnwise copy on layer 0's shard; the drop-in does not.
    stock = _side(1000, [
        _point("forward start", "forward", {"0.mlp": 3 * 2**20}, 1000 + 10 * 2**20),
        _point("backward end", "backward", {"0.mlp": 3 * 2**20, "1.mlp": 0}, 1000 + 12 * 2**20),
    ], {"columnwise on a quantized parameter": 3 * 2**20})
    managed = _side(2000, [
        _point("forward start", "forward", {}, 2000 + 7 * 2**20),
        _point("backward end", "backward", {}, 2000 + 9 * 2**20 + extra_alloc),
    ], {})
    return {"recipe": "Float8CurrentScaling", "quantized_init": True, "microbatches": 1,
            "stock": stock, "managed": managed}


def test_disagreement_is_zero_when_the_report_explains_the_difference():
    assert tl.disagreement(_run()) == 0


def test_disagreement_shows_bytes_the_report_misses():
    assert tl.disagreement(_run(extra_alloc=100 * KIB)) == 100 * KIB


def test_layers_are_read_from_module_paths():
    assert tl.layer_of("3.self_attention.layernorm_qkv") == "3"
    assert tl.layer_of("layers.12.layernorm_mlp") == "12"
    assert tl.layer_of("proj") == "proj"
    assert tl.per_layer(_point("x", "forward", {"0.a": 1, "0.b": 2, "1.a": 4}, None)) == {"0": 3, "1": 4}


def test_summary_and_markdown(tmp_path):
    report = {"attribution": [_run()]}
    (row,) = tl.summary_rows(report)
    assert row["case"] == "Float8CurrentScaling_qinit_1mb"
    assert row["stock_peak_mib"] == 3 and row["managed_peak_mib"] == 0
    assert row["managed_leftovers"] == 0 and row["disagreement_kib"] == 0
    text = tl.markdown([row], "r.json")
    assert "| Float8CurrentScaling_qinit_1mb | 3.00 / 0.00 | columnwise on a quantized parameter 3.00 | none | 0 | 0.0 |" in text
    path = tmp_path / "r.json"
    path.write_text(json.dumps(report))
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "timeline_old_case.png").write_text("an earlier run's figure")
    assert tl.main([str(path), "--out", str(tmp_path / "o")]) == 0
    written = (tmp_path / "o" / "timeline.md").read_text().splitlines()
    assert written[2].startswith(f"`python3 -m benchmarks.timeline {path} --out") and "commit" in written[2]
    assert written[:2] + written[4:] == text.splitlines()
    assert not (tmp_path / "o" / "timeline_old_case.png").exists()  # the new result replaces the old


def test_main_refuses_a_report_without_attribution(tmp_path, capsys):
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"configs": []}))
    with pytest.raises(SystemExit) as info:
        tl.main([str(path)])
    assert info.value.code == 2 and "no 'attribution' runs" in capsys.readouterr().err


def test_png_when_matplotlib_is_installed(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed here (it is not a CI dependency)")
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"attribution": [_run()]}))
    assert tl.main([str(path), "--out", str(tmp_path)]) == 0
    png = tmp_path / "timeline_Float8CurrentScaling_qinit_1mb.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_backward_spans_follow_microbatches():
    phases = ["forward", "forward", "backward", "backward", "forward", "backward", "step"]
    points = [_point(str(i), ph, {}, None) for i, ph in enumerate(phases)]
    assert tl.backward_spans(points) == [(2, 3), (5, 5)]


def test_a_run_with_a_policy_pinned_is_named_apart():
    """The FSDP2 worker records the microbatch cache option as a run of its
    own beside the defaults' run of the same recipe and microbatches."""
    default = {**_run(), "microbatches": 4}
    option = {**default, "policy": "fsdp2_microbatch_cache"}
    assert tl.case_name(default) == "Float8CurrentScaling_qinit_4mb"
    assert tl.case_name(option) == "Float8CurrentScaling_qinit_4mb_fsdp2_microbatch_cache"
    assert tl.case_name({**default, "policy": None}) == tl.case_name(default)
