"""A compiled block's ComfyUI layers under dynamic VRAM fetch their weights through
``tcs::layer_fetch`` (``compile_core.torch_support.layer_fetch``), so the block traces as one
graph while comfy-aimdo keeps managing its weights.

A dynamic-VRAM layer (one with comfy-aimdo's ``_v``) computes in ``forward_comfy_cast_weights``:
``CastBiasWeightContext`` fetches its weight and bias through ctypes calls dynamo cannot trace.
For the duration of a compiled run, a stand-in (``stand_in(layer)``) takes that method's place
on the layer (an instance attribute, swapped by ``weight_routing``): the weights come from the op, whose
eager fetch runs the layer's own ``CastBiasWeightContext`` (found in the globals of the layer's
method, so it is exactly what ComfyUI would run) and copies what it gives before the context
releases it; then the layer's computation (``F.linear``, ``_conv_forward``, the norms) runs on
them, as in ComfyUI's method. A LoRA, applied inside the fetch, is data: a new strength never
recompiles. Layer classes outside ``_COMPUTE`` (or a call with arguments the stand-in does not
know) run ComfyUI's method, traced as before.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from ..compile_core.plan import switches
from ..compile_core.torch_support import layer_fetch

FETCH_ENV = "TORCH_COMPILE_SPEED_DYNAMIC_VRAM_FETCH"


def enabled() -> bool:
    """The operator chose weights fetched in the graph under dynamic VRAM (``FETCH_ENV``, off by
    default) and this torch can: compiled clones stay dynamic and their layers are routed."""
    return switches.switch(FETCH_ENV, False) and layer_fetch.available()


def _linear(m, x, w, b, **kw):
    return F.linear(x, w, b)


def _conv(m, x, w, b, **kw):
    return m._conv_forward(x, w, b, **kw)


def _layer_norm(m, x, w, b, **kw):
    return F.layer_norm(x, m.normalized_shape, w, b, m.eps)


def _rms_norm(m, x, w, b, **kw):
    return F.rms_norm(x, m.normalized_shape, w, m.eps)


def _group_norm(m, x, w, b, **kw):
    return F.group_norm(x, m.num_groups, w, b, m.eps)


# ComfyUI's op class (comfy/ops.py) -> its forward_comfy_cast_weights' computation, and the
# keyword arguments it passes on
_COMPUTE = {"Linear": (_linear, ()), "Conv1d": (_conv, ("autopad",)), "Conv2d": (_conv, ("autopad",)),
            "Conv3d": (_conv, ("autopad",)), "LayerNorm": (_layer_norm, ()), "RMSNorm": (_rms_norm, ()),
            "GroupNorm": (_group_norm, ())}
_SHARED: "weakref.WeakKeyDictionary[torch.nn.Module, _Fetch]" = weakref.WeakKeyDictionary()


def _comfy_method(m):
    """``(computation, keywords, CastBiasWeightContext)`` when ``m``'s class computes with one of
    ComfyUI's own ``forward_comfy_cast_weights`` in ``_COMPUTE``, else None."""
    fn = getattr(type(m), "forward_comfy_cast_weights", None)
    parts = getattr(fn, "__qualname__", "").split(".")
    ctx = getattr(fn, "__globals__", {}).get("CastBiasWeightContext")
    if getattr(fn, "__module__", None) != "comfy.ops" or len(parts) < 2 or parts[-2] not in _COMPUTE or ctx is None:
        return None
    return (*_COMPUTE[parts[-2]], ctx)


def candidate(m) -> bool:
    """``m`` is a ComfyUI layer whose weighted computation the stand-in can take over."""
    return getattr(m, "weight", None) is not None and _comfy_method(m) is not None


def is_streamed(m) -> bool:
    """``m`` fetches its weights through comfy-aimdo now (dynamic VRAM gave it a vbar)."""
    return "_v" in m.__dict__


class _Fetch:
    """What a layer's stand-ins share, cached per layer (holds no strong reference to it): its
    registered fetch (``LayerKey``), weight and bias shapes, and computation."""

    def __init__(self, m, compute, keywords, ctx):
        live = weakref.ref(m)
        self.compute, self.keywords = compute, keywords
        self.weight_shape = tuple(m.weight.shape)
        self.bias_shape = tuple(m.bias.shape) if getattr(m, "bias", None) is not None else ()
        self.original = type(m).forward_comfy_cast_weights

        def fetch(x):
            with ctx(live(), x, offloadable=True) as (w, b):
                return [w.clone()] + ([b.clone()] if b is not None else [])
        self.key = layer_fetch.LayerKey(fetch)


class _FetchedForward:
    """Stands in for one layer's ``forward_comfy_cast_weights`` (called as ``(input, **kw)``)
    while the routing holds it. It refers to its layer strongly: torch cannot save the type
    guard of a weak reference, so a region traced through one would never be saved. The
    routing drops it when the run ends, so it keeps no model alive."""

    def __init__(self, m, shared: _Fetch):
        self.layer, self.shared = m, shared

    def __call__(self, input, *args, **kwargs):
        m, s = self.layer, self.shared
        if args or not isinstance(input, torch.Tensor) or any(k not in s.keywords for k in kwargs):
            return s.original(m, input, *args, **kwargs)
        w, *rest = layer_fetch.fetch(s.key, input, s.weight_shape, s.bias_shape)
        return s.compute(m, input, w, rest[0] if rest else None, **kwargs)


def stand_in(m) -> _FetchedForward:
    """A new stand-in for layer ``m`` (``candidate(m)`` must be true), on its cached fetch."""
    shared = _SHARED.get(m)
    if shared is None:
        shared = _SHARED[m] = _Fetch(m, *_comfy_method(m))
    return _FetchedForward(m, shared)
