"""Conformance: do the real tensors of one managed call match its plans?

Around one module call (forward, backward, optimizer step) a
:class:`CallRecorder` watches the quantized weight operands and compares
what it saw with ``last_plans(module)``: the plans after forward (the call,
or a recompute region's first pass) and after backward (a recompute pass,
if one ran). It imports neither TE nor the binding: the caller hands it the
module files whose ``general_gemm`` it wraps (TE's, or the CPU stand-in's),
the quantized storage base class, and a function giving the plans.

What each check reads, and why it is sound:

* **The GEMMs.** ``general_gemm`` is replaced, for the call only, in the
  globals of the module files (TE's ``module/linear.py``,
  ``layernorm_linear.py``, ``layernorm_mlp.py``), where TE's code looks it
  up. TE puts the weight first in its fprop GEMM (``general_gemm(weightmat,
  input)``, default layout) and in its dgrad GEMM (``general_gemm(weight,
  grad_output, layout="NN", grad=True)``); wgrad is ``layout="NT"``. A
  GEMM's weight key is found from the operand's logical shape (the caller
  gives each weight's shape; tests keep the shapes distinct from each
  other and from the activations). An fprop GEMM during forward is the
  call's operand; one during backward is a recompute pass's. During
  backward ``quantize_weight`` is wrapped too: TE calls it only from
  forward code, so in backward only from a recompute pass, and
  LayerNormMLP's own recompute builds FC2's workspace without an fprop GEMM.
* **Usages** are read from the storage at GEMM time: ``get_usages()``
  (Float8, block and MX storages all have it).
* **Memory, not objects.** Every component tensor of an operand
  (``_data``/``_transpose``/``_scale_inv`` of per-tensor FP8;
  ``_rowwise_data``/``_rowwise_scale_inv``/``_columnwise_data``/
  ``_columnwise_scale_inv`` of block and MX formats) is tracked by a weak
  reference to its ``untyped_storage()``. PyTorch keeps one Python object
  per storage while the memory lives, also when only an alias (``detach()``)
  or an autograd saved tensor holds it, and a weak reference to it dies
  exactly when the memory is freed. So "alive" means "the memory is still
  held by someone", and "same" (``is`` on two live storages) means "the same
  memory". TE's saving splits a storage into its tensors
  (``prepare_for_saving``) and a non-reentrant ``te.checkpoint`` hands back
  detached aliases; storages see through both. Per-tensor FP8's
  ``_scale_inv`` serves both directions (and may be shared with the
  quantizer), so it is not counted as either usage. ``gc.collect()`` runs
  before every liveness reading, so that no unreachable cycle keeps memory
  that nothing uses.
* **The recorder holds nothing strongly** (weak references, ints, enums);
  it reads the module's cache dict and the parameter at fixed points.
* **Dequantized dgrad.** With ``backward_override="dequantized"`` dgrad
  reads a plain tensor made by ``dequantize()``. The recorder wraps
  ``dequantize`` on every quantized storage class for the call and maps the
  result's storage back to the quantized operand it came from.

What is expected, per weight (``P`` is the plan governing the pass):

* fprop operand: a fresh workspace has exactly ``P.forward_usage``; one
  read from the cache has at least it; a quantized parameter is the
  parameter itself, with rowwise data.
* cache: an action that writes leaves the operand in the module's cache;
  ``BYPASS`` and ``READ_ONLY`` leave the entry as it was.
* held from forward to backward: a cache entry keeps what it has; a fresh
  saved workspace keeps exactly the usages backward reads from it
  (``backward_usage``, rowwise instead of columnwise when columnwise is
  derived in backward); anything else is freed. A first recompute pass
  holds nothing but cache entries.
* dgrad: ``SAVED_WORKSPACE`` reads the memory of the operand forward (or
  the recompute pass) built; ``SAVED_PARAMETER`` the parameter's;
  ``REQUANTIZE`` fresh memory with exactly ``backward_usage`` (D9);
  ``HIGH_PRECISION`` a plain tensor (the bf16 weight's memory, or the
  parameter dequantized); no dgrad GEMM when the source is ``NONE``.
* after backward: a fresh workspace is freed; a quantized parameter lost its
  columnwise data if ``Release.DERIVED_COLUMNWISE``. After the optimizer
  step: the cache entry is gone if ``Release.CACHED_WORKSPACE`` (and its
  memory freed), still there otherwise; an unsharded quantized parameter
  has exactly ``parameter_keeps``.
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from workspace_manager import (
    BackwardSource,
    CacheAction,
    ColumnwiseSource,
    RecomputePass,
    Release,
    Sharding,
    Usage,
)

__all__ = ["CallRecorder", "Operand", "usages_of", "parts_of"]

_ROW, _COL, _SHARED = Usage.ROWWISE, Usage.COLUMNWISE, Usage.NONE
#: Component attributes of TE 2.20's storages, with the usage each serves.
_PARTS = (("_data", _ROW), ("_transpose", _COL), ("_scale_inv", _SHARED), ("_rowwise_data", _ROW),
          ("_rowwise_scale_inv", _ROW), ("_columnwise_data", _COL), ("_columnwise_scale_inv", _COL))


def parts_of(obj: Any) -> list[tuple[Usage, Any]]:
    """(usage, untyped storage) of each present component tensor of a
    quantized storage; an invalid FP8 transpose is not data."""
    found = []
    for name, usage in _PARTS:
        tensor = getattr(obj, name, None)
        if tensor is None or (name == "_transpose" and getattr(obj, "_transpose_invalid", False)):
            continue
        if tensor.numel() == 0:  # TE's clear() leaves empty tensors behind
            continue
        found.append((usage, tensor.untyped_storage()))
    return found


def usages_of(obj: Any) -> Usage:
    """The usages a quantized storage holds now."""
    try:
        got = obj.get_usages()
    except (AttributeError, NotImplementedError):
        got = {"rowwise": any(u is _ROW for u, _ in parts_of(obj)),
               "columnwise": any(u is _COL for u, _ in parts_of(obj))}
    return (_ROW if got.get("rowwise") else Usage.NONE) | (_COL if got.get("columnwise") else Usage.NONE)


def _is_parameter(obj: Any, parameter: Any, storage_base: type) -> bool:
    """``obj`` is the quantized parameter, or an alias of it that reads the
    parameter's own memory: a non-reentrant checkpoint hands backward the
    ``detach()``ed tensors its recompute saved, new objects over the same
    component tensors. (Storage objects are compared by identity: PyTorch
    keeps one Python object per storage.)"""
    if obj is parameter:
        return True
    if parameter is None or not isinstance(parameter, storage_base):
        return False
    # Data only: a shared per-tensor scale alone does not make the parameter's data.
    theirs = [storage for usage, storage in parts_of(parameter) if usage is not _SHARED]
    return any(any(mine is storage for storage in theirs) for usage, mine in parts_of(obj) if usage is not _SHARED)


@dataclass
class Operand:
    """One weight operand of a GEMM, held weakly."""

    quantized: bool
    usages: Usage
    #: (usage, weak reference to the untyped storage) per component.
    parts: list = field(default_factory=list)
    #: The operand was the module's parameter object itself.
    is_parameter: bool = False
    #: For a dequantized plain tensor: the quantized operand it came from.
    dequantized_from: Operand | None = None
    #: For a plain tensor: weak reference to its storage.
    plain_storage: Any = None
    #: Weak reference to the object itself (TE saves and restores the same
    #: storage object, so identity tells a cache entry from a fresh workspace).
    ref: Any = None
    #: The operand was the module's cache entry when the GEMM read it.
    from_cache: bool = False

    @classmethod
    def of(cls, obj: Any, storage_base: type, parameter: Any, cache_entry: Any = None) -> Operand:
        if isinstance(obj, storage_base):
            parts = [(u, weakref.ref(s)) for u, s in parts_of(obj)]
            return cls(True, usages_of(obj), parts, _is_parameter(obj, parameter, storage_base), ref=weakref.ref(obj),
                       from_cache=cache_entry is not None and obj is cache_entry)
        return cls(False, Usage.NONE, [], obj is parameter, plain_storage=weakref.ref(obj.untyped_storage()))

    def is_object(self, obj: Any) -> bool:
        """Whether ``obj`` is this operand's object (both alive: identity is sound)."""
        return obj is not None and self.ref is not None and self.ref() is obj

    def alive(self) -> Usage:
        """Usages whose memory is still held by anyone (call gc first)."""
        held = Usage.NONE
        for usage, ref in self.parts:
            if ref() is not None:
                held |= usage
        return held

    def storages(self, usage: Usage = Usage.BOTH) -> list:
        return [s for u, ref in self.parts if u in usage and u is not Usage.NONE and (s := ref()) is not None]

    def shares_memory_with(self, other: Operand | None, usage: Usage = Usage.BOTH) -> bool:
        if other is None:
            return False
        mine = self.storages(usage)
        theirs = other.storages()
        return bool(mine) and any(a is b for a in mine for b in theirs)


@dataclass
class Dgrad:
    """What one dgrad GEMM read for a weight, judged at GEMM time."""

    operand: Operand
    #: The quantized storage dgrad read (itself, or what a plain operand was
    #: dequantized from); None for a plain tensor from elsewhere.
    read: Operand | None
    #: ``read`` shares memory with the operand forward (or the recompute pass) built.
    reads_built: bool
    #: ``read`` is the module's parameter object.
    reads_parameter: bool
    #: A plain operand is the (high-precision) parameter's own memory.
    reads_weight_memory: bool


@dataclass
class WeightRecord:
    """What the recorder saw for one weight key."""

    key: str
    shape: tuple
    forward: Operand | None = None
    recompute: Operand | None = None
    dgrads: list = field(default_factory=list)
    #: Weak reference to the module's cache entry before the call.
    cache_before: Any = None
    #: Read when forward returned: is there an entry, is it the one from
    #: before the call, is it forward's operand.
    cache: dict = field(default_factory=dict)
    held_after_forward: Usage | None = None
    alive_after_backward: dict = field(default_factory=dict)
    #: Per operand ("forward", "recompute"): it was a cache entry of this call.
    cache_entries: dict = field(default_factory=dict)
    #: Read after the step: the entry is there; its memory and the memory
    #: of the workspaces this call filled, still held.
    entry_after_step: bool | None = None
    alive_after_step: Usage | None = None
    param_after_backward: Usage | None = None
    param_after_step: Usage | None = None


class CallRecorder:
    """Records one managed call; see the module docstring.

    ``files``: module objects whose ``general_gemm`` to wrap; ``storage_base``:
    the quantized storage base class; ``plans``: ``() -> {key: (context,
    plan)}`` (``last_plans`` of the module); ``weights``: ``{key: logical
    shape}``; ``parameter``: ``key -> the parameter object now``;
    ``cache``: ``() -> the module's cache dict``; ``step_releases``: a set
    the recorders of one step's calls share, of the weight keys whose cache
    entry an earlier call's backward marked for release at the step (the
    binding drops an entry any call of the step marked)."""

    def __init__(self, *, files, storage_base: type, plans: Callable[[], dict], weights: dict[str, tuple],
                 parameter: Callable[[str], Any], cache: Callable[[], dict],
                 step_releases: set[str] | None = None) -> None:
        self.files, self.storage_base, self.plans = files, storage_base, plans
        self.parameter, self.cache = parameter, cache
        self.step_releases = step_releases if step_releases is not None else set()
        self.records = {key: WeightRecord(key, tuple(shape)) for key, shape in weights.items()}
        self.phase = "idle"
        self.plans_forward: dict = {}
        self.plans_backward: dict = {}
        self.stepped = False
        self._dequantized: list = []  # (weak ref to result storage, Operand of the source)

    # -- what the wrapped functions do ------------------------------------------
    def _key_of(self, obj: Any) -> str | None:
        try:
            shape = tuple(obj.shape)
        except (AttributeError, TypeError, RuntimeError):
            return None
        matches = [k for k, r in self.records.items() if r.shape == shape]
        return matches[0] if len(matches) == 1 else None

    def _on_gemm(self, args: tuple, kwargs: dict) -> None:
        layout = kwargs.get("layout", "TN")
        if not args or layout == "NT":
            return
        key = self._key_of(args[0])
        if key is None:
            return
        record, param = self.records[key], self.parameter(key)
        operand = Operand.of(args[0], self.storage_base, param, self.cache().get(key))
        if layout == "NN":
            record.dgrads.append(self._dgrad(record, operand, args[0], param))
        elif self.phase == "forward" and record.forward is None:
            record.forward = operand
        elif self.phase == "backward":
            record.recompute = operand

    def _dgrad(self, record: WeightRecord, operand: Operand, obj: Any, param: Any) -> Dgrad:
        """What dgrad reads, judged while its memory and forward's are alive."""
        read = operand if operand.quantized else self._source_of(obj)
        built = record.recompute if record.recompute is not None else record.forward
        same_memory = (not operand.quantized and isinstance(param, torch.Tensor)
                       and not isinstance(param, self.storage_base) and obj.untyped_storage() is param.untyped_storage())
        return Dgrad(
            operand=operand, read=read, reads_built=read is not None and read.shares_memory_with(built),
            reads_parameter=read is not None and read.is_parameter, reads_weight_memory=same_memory,
        )

    def _source_of(self, plain: Any) -> Operand | None:
        storage = plain.untyped_storage()
        for ref, source in reversed(self._dequantized):
            if ref() is storage:
                return source
        return None

    def _gemm_wrapper(self, original):
        def general_gemm(*args, **kwargs):
            self._on_gemm(args, kwargs)
            return original(*args, **kwargs)
        return general_gemm

    def _dequantize_wrapper(self, original):
        recorder = self

        def dequantize(this, *args, **kwargs):
            out = original(this, *args, **kwargs)
            key = recorder._key_of(this)
            if key is not None:
                # Alias-aware, as for GEMM operands: under a non-reentrant
                # checkpoint backward dequantizes a storage restored over the
                # parameter's own tensors, not the parameter object (round 5:
                # identity alone reported "not the parameter dequantized").
                source = Operand.of(this, recorder.storage_base, recorder.parameter(key))
                recorder._dequantized.append((weakref.ref(out.untyped_storage()), source))
            return out
        return dequantize

    def _quantize_wrapper(self, original):
        """In backward, TE calls ``quantize_weight`` only from a recompute
        pass. LayerNormMLP's own recompute skips the FC2 fprop GEMM (its
        output is not needed) but still builds FC2's workspace for dgrad:
        what the pass built is recorded here, since no GEMM shows it."""
        def quantize_weight(*args, **kwargs):
            out = original(*args, **kwargs)
            built = out[0] if isinstance(out, tuple) else out
            key = self._key_of(built)
            if key is not None and self.records[key].recompute is None:
                self.records[key].recompute = Operand.of(built, self.storage_base, self.parameter(key),
                                                         self.cache().get(key))
            return out
        return quantize_weight

    @contextlib.contextmanager
    def _patched(self):
        saved = []
        for file in self.files:
            original = file.general_gemm
            saved.append((file, "general_gemm", original, True))
            file.general_gemm = self._gemm_wrapper(original)
            if self.phase == "backward" and hasattr(file, "quantize_weight"):
                saved.append((file, "quantize_weight", file.quantize_weight, True))
                file.quantize_weight = self._quantize_wrapper(file.quantize_weight)
        for cls in _subclasses(self.storage_base):
            if "dequantize" in cls.__dict__:
                original = cls.__dict__["dequantize"]
                saved.append((cls, "dequantize", original, True))
                setattr(cls, "dequantize", self._dequantize_wrapper(original))
        try:
            yield
        finally:
            for owner, name, original, _ in reversed(saved):
                setattr(owner, name, original)

    # -- the three phases -----------------------------------------------------------
    @contextlib.contextmanager
    def forward(self):
        for key, record in self.records.items():
            entry = self.cache().get(key)
            record.cache_before = weakref.ref(entry) if entry is not None else None
        self.phase = "forward"
        with self._patched():
            yield
        self.phase = "idle"
        self.plans_forward = dict(self.plans())
        gc.collect()
        for key, record in self.records.items():
            entry = self.cache().get(key)
            before = _deref(record.cache_before)
            record.cache = {"present": entry is not None, "unchanged": entry is before and
                            (record.cache_before is None) == (entry is None),
                            "is_forward": record.forward is not None and record.forward.is_object(entry)}
            if record.forward is not None:
                record.held_after_forward = record.forward.alive()

    @contextlib.contextmanager
    def backward(self):
        self.phase = "backward"
        with self._patched():
            yield
        self.phase = "idle"
        self.plans_backward = dict(self.plans())
        self.step_releases.update(key for key, (_, plan) in self.plans_backward.items()
                                  if Release.CACHED_WORKSPACE in plan.release)
        gc.collect()
        for record in self.records.values():
            entry = self.cache().get(record.key)
            for name in ("forward", "recompute"):
                operand = getattr(record, name)
                if operand is not None:
                    record.alive_after_backward[name] = operand.alive()
                    record.cache_entries[name] = operand.is_object(entry) or (
                        name == "forward" and record.cache.get("is_forward", False))
            for i, dgrad in enumerate(record.dgrads):
                record.alive_after_backward[f"dgrad{i}"] = dgrad.operand.alive()
            record.param_after_backward = self._param_usages(record.key)

    @contextlib.contextmanager
    def step(self):
        yield
        self.stepped = True
        gc.collect()
        for key, record in self.records.items():
            entry = self.cache().get(key)
            record.entry_after_step = entry is not None
            record.alive_after_step = Usage.NONE
            for name in ("forward", "recompute"):
                operand = getattr(record, name)
                if operand is not None and record.cache_entries.get(name):
                    record.alive_after_step |= operand.alive()
            record.param_after_step = self._param_usages(key)

    def _param_usages(self, key: str) -> Usage | None:
        param = self.parameter(key)
        return usages_of(param) if isinstance(param, self.storage_base) else None

    # -- the verdict ------------------------------------------------------------------
    def mismatches(self) -> list[str]:
        """Every difference between what happened and the plans, in words."""
        problems = []
        for key, record in self.records.items():
            if key not in self.plans_forward:
                problems.append(f"{key}: no plan after forward (last_plans has {sorted(self.plans_forward)})")
                continue
            problems += [f"{key}: {p}" for p in _check_weight(self, record)]
        return problems


def _subclasses(base: type) -> list[type]:
    seen, todo = [], [base]
    while todo:
        cls = todo.pop()
        if cls not in seen:
            seen.append(cls)
            todo.extend(cls.__subclasses__())
    return seen


def _deref(ref):
    return ref() if ref is not None else None


def _check_weight(rec: CallRecorder, r: WeightRecord) -> list[str]:
    ctx_f, plan_f = rec.plans_forward[r.key]
    ctx_b, plan_b = rec.plans_backward.get(r.key, (ctx_f, plan_f))
    recomputed = r.recompute is not None
    if not recomputed:
        ctx_b, plan_b = ctx_f, plan_f
    out = _check_forward(r, ctx_f, plan_f, r.forward, "forward")
    out += _check_cache(r, plan_f)
    out += _check_held(r, ctx_f, plan_f)
    if recomputed:
        out += _check_forward(r, ctx_b, plan_b, r.recompute, "recompute pass")
    if rec.phase == "idle" and rec.plans_backward:
        out += _check_dgrad(r, ctx_b, plan_b)
        out += _check_after_backward(r, ctx_b, plan_b)
    if rec.stepped:
        out += _check_after_step(r, ctx_b, plan_b, r.key in rec.step_releases)
    return out


def _check_forward(r: WeightRecord, ctx, plan, operand: Operand | None, where: str) -> list[str]:
    if operand is None:
        return [f"{where}: no fprop GEMM read this weight (plan {plan.summary()})"]
    if ctx.is_quantized_param:
        if not operand.is_parameter:
            return [f"{where}: the fprop operand is not the quantized parameter itself"]
        return [] if Usage.ROWWISE in operand.usages else [f"{where}: the quantized parameter has no rowwise data"]
    if not operand.quantized:
        return [f"{where}: the fprop operand is not quantized (plan {plan.summary()})"]
    want = plan.forward_usage
    if operand.from_cache:
        if plan.cache is CacheAction.BYPASS:
            return [f"{where}: cache=bypass but the fprop operand is the module's cache entry"]
        if want not in operand.usages:
            return [f"{where}: the cache entry read has {operand.usages.label}, plan forward_usage={want.label}"]
        return []
    if operand.usages != want:
        return [f"{where}: fresh fprop operand has {operand.usages.label}, plan forward_usage={want.label} "
                f"(cache={plan.cache.value})"]
    return []


def _check_cache(r: WeightRecord, plan) -> list[str]:
    seen = r.cache
    if plan.cache.writes:
        if not seen["present"]:
            return [f"cache={plan.cache.value} but the module's cache has no entry after forward"]
        if not seen["is_forward"]:
            return [f"cache={plan.cache.value} but the cache entry is not the workspace forward read"]
        return []
    if not seen["unchanged"]:
        return [f"cache={plan.cache.value} must not write, but the entry changed during forward"]
    return []


def expected_held(ctx, plan, cached: bool, usages: Usage) -> Usage:
    """Usages of forward's operand that must still be held when backward starts."""
    if cached:
        return usages
    if ctx.recompute is RecomputePass.FIRST or not ctx.grad_enabled:
        return Usage.NONE
    if plan.backward_source is not BackwardSource.SAVED_WORKSPACE:
        return Usage.NONE
    held = plan.backward_usage & Usage.ROWWISE
    if plan.columnwise_source is ColumnwiseSource.FORWARD:
        held |= Usage.COLUMNWISE
    elif plan.columnwise_source is ColumnwiseSource.DERIVED:
        held |= Usage.ROWWISE
    return held


def _check_held(r: WeightRecord, ctx, plan) -> list[str]:
    if r.forward is None or not r.forward.quantized or ctx.is_quantized_param:
        return []
    cached = r.cache["is_forward"]
    want = expected_held(ctx, plan, cached, r.forward.usages)
    got = r.held_after_forward
    if got != want:
        return [f"held from forward to backward: {got.label}, expected {want.label} "
                f"(plan {plan.summary()}; {'a cache entry' if cached else 'not cached'})"]
    return []


def _check_dgrad(r: WeightRecord, ctx, plan) -> list[str]:
    source = plan.backward_source
    if source is BackwardSource.NONE or not ctx.needs_dgrad:
        return [f"backward_source={source.value} but dgrad read this weight"] if r.dgrads else []
    if not r.dgrads:
        return [f"backward_source={source.value} but no dgrad GEMM read this weight"]
    dgrad: Dgrad = r.dgrads[-1]
    if source is BackwardSource.HIGH_PRECISION:
        return _check_high_precision(ctx, dgrad)
    read = dgrad.read
    if read is None:
        return [f"backward_source={source.value} but dgrad read a plain tensor not dequantized from a workspace"]
    out = []
    if plan.backward_usage not in read.usages:
        out.append(f"dgrad operand has {read.usages.label}, plan backward_usage={plan.backward_usage.label}")
    if source is BackwardSource.SAVED_WORKSPACE and not dgrad.reads_built:
        out.append("backward_source=saved_workspace but dgrad read memory forward did not build")
    if source is BackwardSource.SAVED_PARAMETER and not dgrad.reads_parameter:
        out.append("backward_source=saved_parameter but dgrad did not read the parameter")
    if source is BackwardSource.REQUANTIZE:
        if dgrad.reads_built or dgrad.reads_parameter:
            out.append("backward_source=requantize but dgrad read forward's workspace")
        elif read.usages != plan.backward_usage:
            out.append(f"backward_source=requantize: the rebuilt operand has {read.usages.label}, plan "
                       f"backward_usage={plan.backward_usage.label} (D9)")
    return out


def _check_high_precision(ctx, dgrad: Dgrad) -> list[str]:
    if dgrad.operand.quantized:
        return ["backward_source=high_precision but dgrad read a quantized operand"]
    if ctx.is_quantized_param:
        return [] if dgrad.reads_parameter else [
            "backward_source=high_precision but dgrad's operand is not the parameter dequantized"]
    return [] if dgrad.reads_weight_memory else ["backward_source=high_precision but dgrad did not read the weight's memory"]


def _check_after_backward(r: WeightRecord, ctx, plan) -> list[str]:
    out = []
    for name, alive in r.alive_after_backward.items():
        operand = r.forward if name == "forward" else r.recompute if name == "recompute" else None
        if operand is None or ctx.is_quantized_param or alive is Usage.NONE:
            continue
        if r.cache_entries.get(name) or operand.from_cache:
            continue
        out.append(f"after backward the {name} operand's {alive.label} data is still held (not a cache entry)")
    for i, dgrad in enumerate(r.dgrads):
        alive = r.alive_after_backward.get(f"dgrad{i}", Usage.NONE)
        if plan.backward_source is BackwardSource.REQUANTIZE and dgrad.operand.quantized and alive is not Usage.NONE:
            out.append(f"after backward the rebuilt dgrad operand's {alive.label} data is still held")
    if ctx.is_quantized_param and r.param_after_backward is not None:
        if Release.DERIVED_COLUMNWISE in plan.release and Usage.COLUMNWISE in r.param_after_backward:
            out.append("release=derived_columnwise but the parameter keeps columnwise data after backward")
    return out


def _check_after_step(r: WeightRecord, ctx, plan, marked_in_step: bool = False) -> list[str]:
    """``marked_in_step``: a call of this step (this one or an earlier one)
    marked the weight's cache entry for release at the step."""
    out = []
    entry = r.entry_after_step
    if Release.CACHED_WORKSPACE in plan.release:
        if entry:
            out.append("release=cached_workspace but the cache entry is still there after the optimizer step")
        elif r.forward is not None and plan.cache.writes and r.alive_after_step is not Usage.NONE:
            out.append(f"release=cached_workspace but its {r.alive_after_step.label} memory is still held")
    elif marked_in_step:
        if entry:
            out.append("an earlier call of the step planned release=cached_workspace, but the cache entry is still "
                       "there after the optimizer step")
    elif plan.cache.writes and not entry:
        out.append(f"cache={plan.cache.value} without release=cached_workspace, but the entry is gone after the step")
    if ctx.is_quantized_param and ctx.sharding is Sharding.NONE and r.param_after_step is not None:
        if r.param_after_step != plan.parameter_keeps:
            out.append(f"after the step the parameter has {r.param_after_step.label}, plan parameter_keeps="
                       f"{plan.parameter_keeps.label}")
    return out
