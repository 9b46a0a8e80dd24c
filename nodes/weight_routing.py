"""During a compiled run, ComfyUI's patched weight fetches go through ``compile_core.torch_support.weight_fetch``.

Two places keep a LoRA where dynamo would trace it and guard on its strength (a float) and
key (a string), one graph per block and per strength:

- low-VRAM partial loading: a layer's ``weight_function`` / ``bias_function`` lists hold
  ``comfy.model_patcher.LowVramPatch`` objects, applied by ``comfy.ops.cast_bias_weight``;
- ComfyUI-GGUF: the quantized weight's ``patches``, applied by the layer's ``cast_bias_weight``.

And under dynamic VRAM every layer's fetch is a graph break; those layers' computations go
through ``tcs::layer_fetch`` (``dynamic_fetch``), their LoRA with them.

``routed(model, plan)`` replaces, for the duration of one compiled run, each such LowVramPatch
in the compiled regions by a ``_PatchCall`` (the patch applied inside the op, on a copy of the
cast weight) and each patched GGUF layer's ``cast_bias_weight`` by a ``_GGUFCast`` (dequantize
and patch inside the op), then puts every attribute back. Only instance attributes of the
layers are swapped, and only while the run lasts; the stand-ins call the live patch objects,
so a new strength is read at every call and never cached. Layers without a LoRA, and weight
functions other than LowVramPatch, are left as they are (traced as before). Used by
``comfy_model`` only.

A background compile (``compile_core.run.background``) holds the routing on its worker thread
while the sampling thread enters and leaves it at every model call: each swapped attribute is
counted by holder (``_HELD``) and put back when the last holder leaves, and only if it still
holds the stand-in (ComfyUI may have set new patches meanwhile).
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Iterator

import torch

from ..compile_core.report import log
from ..compile_core.torch_support import layer_fetch, weight_fetch
from . import dynamic_fetch

_FUNCS = ("weight_function", "bias_function")
_GGUF_LAYERS = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d,
                torch.nn.LayerNorm, torch.nn.GroupNorm)  # call ``self.cast_bias_weight(input)``


class _PatchCall:
    """Stands in for one LowVramPatch: ``weight -> tcs::weight_fetch(ref, weight)``."""

    def __init__(self, ref: weight_fetch.WeightRef):
        self.ref = ref

    def __call__(self, weight):
        return weight_fetch.fetch(self.ref, weight)[0]


class _GGUFCast:
    """Stands in for a patched GGUF layer's ``cast_bias_weight`` (called as ``(input)``)."""

    def __init__(self, ref: weight_fetch.WeightRef, has_bias: bool, original):
        self.ref, self.has_bias, self.original = ref, has_bias, original

    def __call__(self, input=None, dtype=None, device=None, bias_dtype=None):
        if not isinstance(input, torch.Tensor) or dtype is not None or device is not None \
                or bias_dtype is not None:
            return self.original(input, dtype, device, bias_dtype)
        out = weight_fetch.fetch(self.ref, input)
        return out[0], (out[1] if self.has_bias else None)


# Cached between calls; values never hold their key strongly (a WeakKeyDictionary would keep it)
_PATCH_CALLS: "weakref.WeakKeyDictionary[object, _PatchCall]" = weakref.WeakKeyDictionary()
_GGUF_REFS: "weakref.WeakKeyDictionary[torch.nn.Module, weight_fetch.WeightRef]" = weakref.WeakKeyDictionary()
# per model, then per plan (two Apply nodes on one model alternate without walking it again)
_LAYERS: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


def _patch_call(patch) -> _PatchCall:
    """The cached stand-in for ``patch``: it calls the live patch, so a changed strength is used."""
    call = _PATCH_CALLS.get(patch)
    if call is None:
        live = weakref.ref(patch)
        ref = weight_fetch.WeightRef(lambda w: [live()(w.clone())], lambda w: [torch.empty_like(w)],
                                     str(getattr(patch, "key", "")))
        call = _PATCH_CALLS[patch] = _PatchCall(ref)
    return call


def _gguf_ref(layer) -> weight_fetch.WeightRef:
    ref = _GGUF_REFS.get(layer)
    if ref is None:
        live = weakref.ref(layer)

        def fetch(x):
            m = live()
            out = [t for t in type(m).cast_bias_weight(m, x) if t is not None]
            params = [p for p in (m.weight, m.bias) if p is not None]
            return [t.clone() if any(_same_memory(t, p) for p in params) else t for t in out]

        def fake(x):
            m = live()
            return [x.new_empty(tuple(p.shape), dtype=x.dtype) for p in (m.weight, m.bias) if p is not None]
        ref = _GGUF_REFS[layer] = weight_fetch.WeightRef(fetch, fake, type(layer).__name__)
    return ref


def _same_memory(a, b) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _is_gguf(m) -> bool:
    return callable(getattr(type(m), "get_weight", None)) and hasattr(m, "is_ggml_quantized")


def _layers(model, plan) -> tuple[tuple, tuple, tuple]:
    """(core layers, GGUF layers, dynamic-VRAM candidates) in ``plan``'s regions of ``model`` that may carry a patched
    fetch, as weak references. Cached per model and plan (found again when one is gone): a
    region module replaced later is not routed, which costs recompiles, never correctness."""
    per_plan = _LAYERS.get(model)
    if per_plan is None:
        per_plan = _LAYERS[model] = {}
    got = per_plan.get(id(plan))
    if got is None or got[0] is not plan:
        core, gguf, streamed = [], [], []
        for region in plan.modules(model):
            for m in region.modules():
                if _is_gguf(m):
                    if isinstance(m, _GGUF_LAYERS):
                        gguf.append(weakref.ref(m))
                elif hasattr(m, "weight_function"):
                    core.append(weakref.ref(m))
                    if dynamic_fetch.candidate(m):
                        streamed.append(weakref.ref(m))
        if len(per_plan) >= 4:  # plans of Apply nodes gone since
            per_plan.clear()
        got = per_plan[id(plan)] = (plan, tuple(core), tuple(gguf), tuple(streamed))
    return got[1:]


def _swaps(model, plan) -> list[tuple[torch.nn.Module, str, object]]:
    """(layer, instance attribute, replacement) for every patched fetch in ``plan``'s regions.
    Runs on every model call: the common case (nothing patched) is two dict lookups per layer."""
    try:
        return _patched(*_layers(model, plan))
    except _Gone:  # a layer was dropped since the regions were walked: walk them again
        _LAYERS.pop(model, None)
        return _patched(*_layers(model, plan))


class _Gone(Exception):
    pass


def _patched(core: tuple, gguf: tuple, streamed: tuple) -> list[tuple[torch.nn.Module, str, object]]:
    out = _streamed(streamed) if dynamic_fetch.enabled() else []
    fetched = {id(m) for m, _, _ in out}  # (their LoRA is applied inside the fetch)
    for ref in core:
        m = ref()
        if m is None:
            raise _Gone
        d = m.__dict__
        if id(m) not in fetched and (d.get("weight_function") or d.get("bias_function")):
            for name in _FUNCS:
                funcs = d.get(name)
                if (id(m), name) in _HELD:  # routed by another holder: join it
                    out.append((m, name, None))
                elif funcs and all(_routable(f) for f in funcs):
                    out.append((m, name, [_patch_call(f) for f in funcs]))
    for ref in gguf:
        m = ref()
        if m is None:
            raise _Gone
        params = m.__dict__["_parameters"]
        if (id(m), "cast_bias_weight") in _HELD:
            out.append((m, "cast_bias_weight", None))
        elif any(getattr(params.get(n), "patches", None) for n in ("weight", "bias")):
            out.append((m, "cast_bias_weight",
                        _GGUFCast(_gguf_ref(m), m.bias is not None, m.cast_bias_weight)))
    return out


def _streamed(streamed: tuple) -> list[tuple[torch.nn.Module, str, object]]:
    """The dynamic-VRAM layers' stand-ins (``dynamic_fetch``), for layers streamed now."""
    out = []
    for ref in streamed:
        m = ref()
        if m is None:
            raise _Gone
        if (id(m), _FORWARD) in _HELD:
            out.append((m, _FORWARD, None))
        elif dynamic_fetch.is_streamed(m):
            out.append((m, _FORWARD, dynamic_fetch.stand_in(m)))
    return out


_FORWARD = "forward_comfy_cast_weights"


def _routable(f) -> bool:
    """A LowVramPatch that keeps the weight's dtype (0.3.75's fp8 convert/set functions do not)."""
    return (getattr(f, "is_lowvram_patch", False) or type(f).__name__ == "LowVramPatch") \
        and getattr(f, "convert_func", None) is None and getattr(f, "set_func", None) is None


@contextlib.contextmanager
def routed(model, plan) -> Iterator[bool]:
    """Inside the block, patched weight fetches in the regions of ``model`` that ``plan``
    (``compile_core.plan.regions.RegionPlan``) compiles go through the op. Yields whether any did.
    Where this torch cannot (no opaque objects), nothing changes and one line says why a LoRA
    strength change recompiles here. Dynamic-VRAM layers go through ``tcs::layer_fetch``
    (``dynamic_fetch``)."""
    weight_fetch.register()  # (once) before a saved region that calls the ops is loaded
    layer_fetch.register()
    try:
        swaps = _swaps(model, plan)
    except Exception as exc:  # noqa: BLE001 - an optimisation: the run goes on as before
        log.warn_once("weight-routing", "LoRA weights are traced as before (a strength change "
                      "recompiles): %s: %s", type(exc).__name__, exc)
        swaps = []
    if any(s[1] != _FORWARD for s in swaps) and not weight_fetch.available():
        log.info_once("lora-recompiles", "torch %s cannot pass an opaque object to a custom op "
                      "(torch._library.opaque_object), so a LoRA's strength stays a traced constant "
                      "under partial loading and GGUF: each new strength recompiles (output stays "
                      "correct)", torch.__version__)
        swaps = [s for s in swaps if s[1] == _FORWARD]  # (dynamic_fetch checked its own op)
    held = _hold(swaps)
    try:
        yield bool(swaps)
    finally:
        _release(held)


_MISSING = object()
_LOCK = threading.Lock()
# (id(layer), attribute) -> [holders, layer, attribute, value before, stand-in]
_HELD: dict[tuple[int, str], list] = {}


def _hold(swaps: list[tuple[torch.nn.Module, str, object]]) -> list[tuple[int, str]]:
    """Put each stand-in in place, or count one more holder where it already is."""
    keys = []
    with _LOCK:
        for m, name, new in swaps:
            key = (id(m), name)
            held = _HELD.get(key)
            if held is not None:
                held[0] += 1
            elif new is not None:  # (None: joined a holder that has left since)
                _HELD[key] = [1, m, name, m.__dict__.get(name, _MISSING), new]
                m.__dict__[name] = new
            else:
                continue
            keys.append(key)
    return keys


def _release(keys: list[tuple[int, str]]) -> None:
    """One holder fewer; the last one puts the value before back, if the stand-in is still there."""
    with _LOCK:
        for key in keys:
            held = _HELD[key]
            held[0] -= 1
            if held[0]:
                continue
            del _HELD[key]
            _, m, name, prev, new = held
            if m.__dict__.get(name) is not new:
                continue  # replaced since (new patches): theirs stays
            if prev is _MISSING:
                m.__dict__.pop(name, None)
            else:
                m.__dict__[name] = prev
