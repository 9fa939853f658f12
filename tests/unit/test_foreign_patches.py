"""Another library's patch of a name the seams replace in TE's modules is
detected at install, whichever came first, and never overwritten: install
raises ForeignPatchError and changes nothing. CPU, with a stand-in for TE."""

from __future__ import annotations

import functools
import sys
import types

import pytest
from _binding_standin import load_binding
from _fake_te_grouped import compat_entries as grouped_compat_entries

_PT = "transformer_engine.pytorch.module"


def _te_function(module: str, name: str):
    def fn(**kwargs):
        return None, None

    fn.__module__, fn.__qualname__, fn.__name__ = module, name, name
    return fn


def _te_class(module: str, name: str) -> type:
    methods = {m: staticmethod(lambda ctx, *a: None) for m in ("forward", "backward", "_forward")}
    return type(name, (), {"__module__": module, "__qualname__": name, **methods})


class _StandInTE:
    """TE's three module files and base.py, holding TE's own definitions."""

    def __init__(self) -> None:
        self.base = types.ModuleType(f"{_PT}.base")
        self.base.quantize_weight = _te_function(self.base.__name__, "quantize_weight")
        self.linear, self.lnl, self.lnmlp = (types.ModuleType(f"{_PT}.{n}")
                                             for n in ("linear", "layernorm_linear", "layernorm_mlp"))
        for module, fn in ((self.linear, "_Linear"), (self.lnl, "_LayerNormLinear"), (self.lnmlp, "_LayerNormMLP")):
            module.quantize_weight = self.base.quantize_weight
            setattr(module, fn, _te_class(module.__name__, fn))

    def compat(self) -> dict:
        mod = type("_TEModule", (), {})
        return {
            "base_module": self.base, "linear_module": self.linear, "lnl_module": self.lnl,
            "lnmlp_module": self.lnmlp, "quantize_weight": self.base.quantize_weight,
            "LinearFunction": self.linear._Linear, "LNLFunction": self.lnl._LayerNormLinear,
            "LNMLPFunction": self.lnmlp._LayerNormMLP, "TELinear": mod, "TELayerNormLinear": mod,
            "TELayerNormMLP": mod, "QuantizedTensorStorage": type("_Storage", (), {}),
            "LNL_ARGS": {}, "LNMLP_ARGS": {}, "mha_module": types.ModuleType("te.mha"),
            "transformer_module": types.ModuleType("te.transformer"),
            **grouped_compat_entries(quantize_weight=self.base.quantize_weight),
        }

    def holders(self) -> dict:
        return {f"{m.__name__}.{n}": getattr(m, n) for m in (self.linear, self.lnl, self.lnmlp)
                for n in ("quantize_weight", "_Linear", "_LayerNormLinear", "_LayerNormMLP") if hasattr(m, n)}


#: (module attribute of _StandInTE, seamed name) for every seamed name.
SEAMED = [("linear", "quantize_weight"), ("lnl", "quantize_weight"), ("lnmlp", "quantize_weight"),
          ("linear", "_Linear"), ("lnl", "_LayerNormLinear"), ("lnmlp", "_LayerNormMLP")]


def _foreign_for(te: _StandInTE, where: str, name: str):
    """What another library would put there: a wrapper or a subclass, defined in its own module."""
    original = getattr(getattr(te, where), name)
    if name == "quantize_weight":
        def patched(**kwargs):
            return original(**kwargs)

        patched.__module__, patched.__qualname__ = "otherlib.patches", name
        return patched
    return type(name, (original,), {"__module__": "otherlib.patches"})


def _load(monkeypatch, te: _StandInTE):
    return load_binding(monkeypatch, te.compat(), "runtime._step_hook", "runtime._attribution", "runtime._state",
                        "runtime._foreign_patches", "runtime._call", "runtime._quantize", "runtime._install", "kinds")


def _seam_function(binding, name: str) -> type:
    """The installed Function seam that replaces TE's ``name``."""
    kind = {"_Linear": "linear", "_LayerNormLinear": "layernorm_linear", "_LayerNormMLP": "layernorm_mlp"}[name]
    return binding["runtime._install"].seam_function_of(sys.modules[f"te_integration.kinds.{kind}"].ADAPTER)


def test_install_puts_every_seam_in_place_once(monkeypatch):
    te = _StandInTE()
    binding = _load(monkeypatch, te)
    seams = binding["runtime._install"]
    monkeypatch.setattr(seams, "INSTALLED", False)
    seams.install()
    ours = {"quantize_weight": binding["runtime._quantize"].managed_quantize_weight,
            **{n: _seam_function(binding, n) for n in ("_Linear", "_LayerNormLinear", "_LayerNormMLP")}}
    assert te.holders() == {
        f"{getattr(te, w).__name__}.{n}": ours[n] for w, n in SEAMED}
    seams.install()  # a second call changes nothing and does not raise
    assert all(getattr(getattr(te, w), n) is ours[n] for w, n in SEAMED)


@pytest.mark.parametrize("where, name", SEAMED, ids=[f"{w}.{n}" for w, n in SEAMED])
@pytest.mark.parametrize("order", ["before_import", "after_import", "over_installed_seam"])
def test_a_foreign_patch_is_refused_and_kept(monkeypatch, where, name, order):
    te = _StandInTE()
    module = getattr(te, where)
    if order == "before_import":
        setattr(module, name, _foreign_for(te, where, name))
    binding = _load(monkeypatch, te)
    seams = binding["runtime._install"]
    monkeypatch.setattr(seams, "INSTALLED", False)
    if order == "over_installed_seam":
        seams.install()
    if order != "before_import":
        setattr(module, name, _foreign_for(te, where, name))
    foreign, before = getattr(module, name), te.holders()
    with pytest.raises(binding["runtime._foreign_patches"].ForeignPatchError) as info:
        seams.install()
    message = str(info.value)
    assert f"{module.__name__}.{name} is otherlib.patches.{name}, neither TE's" in message
    assert "Nothing was changed" in message
    assert te.holders() == before  # nothing moved: the foreign patch is kept
    assert getattr(module, name) is foreign
    with pytest.raises(binding["runtime._foreign_patches"].ForeignPatchError):
        seams.install()  # and every later managed forward is refused too, not only the first


def test_a_wrapper_keeping_tes_name_is_still_foreign(monkeypatch):
    """``functools.wraps`` copies TE's module and qualname; ``__wrapped__`` gives it away."""
    te = _StandInTE()
    binding = _load(monkeypatch, te)
    seams = binding["runtime._install"]
    monkeypatch.setattr(seams, "INSTALLED", False)
    original = te.lnl.quantize_weight
    te.lnl.quantize_weight = functools.wraps(original)(lambda **kw: original(**kw))
    refused = binding["runtime._foreign_patches"].ForeignPatchError
    with pytest.raises(refused, match="layernorm_linear.quantize_weight is"):
        seams.install()


def test_a_class_patched_at_import_and_removed_later_is_still_refused(monkeypatch):
    """The seam subclasses what was there at import: a patch removed later
    still sits under it, so install refuses."""
    te = _StandInTE()
    original = te.linear._Linear
    te.linear._Linear = _foreign_for(te, "linear", "_Linear")
    binding = _load(monkeypatch, te)
    te.linear._Linear = original
    seams = binding["runtime._install"]
    monkeypatch.setattr(seams, "INSTALLED", False)
    with pytest.raises(binding["runtime._foreign_patches"].ForeignPatchError, match="when te_integration was imported"):
        seams.install()
    assert te.linear._Linear is original and te.lnl.quantize_weight is te.base.quantize_weight


def test_a_patch_over_installed_seams_is_refused_at_a_drop_ins_first_forward(monkeypatch):
    """Seams installed by one drop-in's call; then another library patches a
    seamed name. A drop-in whose state already exists (TE's constructor makes
    it, through ``reset_parameters``) still checks at its first forward."""
    import torch
    from _fake_te import TELinear, load_full_binding

    ti = load_full_binding(monkeypatch)
    ti.modules.convert_model(TELinear(8, 8, seed=1))(torch.randn(4, 8))  # installs the seams
    second = ti.modules.convert_model(TELinear(8, 8, seed=2))
    ti.modules.workspace_state(second)
    linear = ti.files["linear"]
    seam = linear.quantize_weight

    def patched(**kwargs):
        return seam(**kwargs)

    patched.__module__ = "otherlib.patches"
    monkeypatch.setattr(linear, "quantize_weight", patched)
    for _ in range(2):  # refused at every call until the patch goes
        with pytest.raises(RuntimeError, match="linear.quantize_weight is otherlib.patches") as info:
            second(torch.randn(4, 8))
        assert type(info.value).__name__ == "ForeignPatchError"
        assert linear.quantize_weight is patched and ti.call.ACTIVE.module() is None


# -- uninstall ---------------------------------------------------------------------
def _installed(monkeypatch):
    """A stand-in TE with the seams installed: (te, binding, its _install)."""
    te = _StandInTE()
    binding = _load(monkeypatch, te)
    monkeypatch.setattr(binding["runtime._install"], "INSTALLED", False)
    binding["runtime._install"].install()
    return te, binding, binding["runtime._install"]


def test_uninstall_puts_tes_definitions_back_and_a_later_install_the_seams(monkeypatch):
    te = _StandInTE()
    binding = _load(monkeypatch, te)
    seams = binding["runtime._install"]
    monkeypatch.setattr(seams, "INSTALLED", False)
    tes_own = te.holders()
    seams.uninstall()  # before any install: nothing to do
    assert te.holders() == tes_own
    seams.install()
    assert te.holders() != tes_own
    seams.uninstall()
    assert te.holders() == tes_own and seams.INSTALLED is False
    seams.install()
    assert _seam_function(binding, "_LayerNormMLP") is te.lnmlp._LayerNormMLP and seams.INSTALLED is True


@pytest.mark.parametrize("where, name", SEAMED, ids=[f"{w}.{n}" for w, n in SEAMED])
def test_uninstall_refuses_while_a_foreign_patch_holds_a_seamed_name(monkeypatch, where, name):
    te, binding, seams = _installed(monkeypatch)
    module = getattr(te, where)
    setattr(module, name, _foreign_for(te, where, name))
    before = te.holders()
    with pytest.raises(binding["runtime._foreign_patches"].ForeignPatchError,
                       match=r"cannot take its seams out.*Nothing was changed"):
        seams.uninstall()
    assert te.holders() == before and seams.INSTALLED is True


def test_uninstall_refuses_inside_a_drop_ins_forward(monkeypatch):
    te, binding, seams = _installed(monkeypatch)
    call = binding["runtime._call"]
    state = binding["runtime._state"].ModuleWorkspaceState(binding["runtime._state"].ModuleKind("linear"))
    record = call.new_record(object(), state, None, call.ACTIVE.record)
    call.ACTIVE.record = record
    try:
        with pytest.raises(RuntimeError, match="inside a drop-in's forward"):
            seams.uninstall()
    finally:
        call.ACTIVE.record = record.previous
    assert seams.INSTALLED is True
