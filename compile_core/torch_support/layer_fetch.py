"""A layer's weights fetched behind one custom op, keyed by a tensor, so a compiled block traces
a fetch that its host streams at run time (ComfyUI's dynamic VRAM) as one graph node.

Under dynamic VRAM every ComfyUI layer fetches its weight through comfy-aimdo at each call
(ctypes calls dynamo cannot trace: a graph break at every layer). Here the fetch is a call of the
custom op ``tcs::layer_fetch(key, x, weight_shape, bias_shape)``: ``key`` is a 0-d int64 CPU
tensor naming a fetch registered in this module (``LayerKey``), so dynamo lifts it as a graph
input and guards on its metadata only: one graph serves every block of a class. The op runs the
registered fetch eagerly (the host's own code) and returns new tensors; while tracing it returns
empty tensors of the given shapes in the input's dtype and device. A plain custom op on a
tensor: it works on every torch the pack supports (opaque objects are not needed).

A fetch must return the weight (and the bias where ``bias_shape`` is not empty) in the input's
dtype and on its device, as new tensors; a result of another shape or dtype raises (the region
then runs eagerly, never on a wrong weight).
"""
from __future__ import annotations

import functools
import itertools
import threading
import weakref
from typing import Callable

import torch

from .probing import _Counter, _fresh, _probe

NAMESPACE, NAME = "tcs", "layer_fetch"
_FETCHES: dict[int, Callable[[torch.Tensor], list]] = {}
_NEXT = itertools.count(1)
_LOCK = threading.Lock()


class LayerKey:
    """The key tensor of one registered fetch; the fetch is dropped when this object is."""

    def __init__(self, fetch: Callable[[torch.Tensor], list]):
        with _LOCK:
            n = next(_NEXT)
            _FETCHES[n] = fetch
        self.tensor = torch.tensor(n, dtype=torch.int64)
        weakref.finalize(self, _FETCHES.pop, n, None)


def _fetch_impl(key: torch.Tensor, x: torch.Tensor, weight_shape: list[int],
                bias_shape: list[int]) -> list[torch.Tensor]:
    fetch = _FETCHES.get(int(key))
    if fetch is None:
        raise RuntimeError("tcs::layer_fetch was called with a key whose layer is gone")
    out = list(fetch(x))
    shapes = [list(weight_shape)] + ([list(bias_shape)] if bias_shape else [])
    if len(out) != len(shapes) or any(list(t.shape) != s or t.dtype != x.dtype or t.device != x.device
                                      for t, s in zip(out, shapes)):
        raise RuntimeError(f"tcs::layer_fetch: the layer gave {[(tuple(t.shape), t.dtype) for t in out]}, "
                           f"traced for {shapes} in {x.dtype}")
    return out


def _fetch_fake(key, x, weight_shape, bias_shape):
    return [x.new_empty(tuple(weight_shape))] + ([x.new_empty(tuple(bias_shape))] if bias_shape else [])


@functools.lru_cache(maxsize=None)
def register() -> bool:
    """Register ``tcs::layer_fetch`` (once per process). False where the name is taken or this
    torch cannot."""
    try:
        op = torch.library.custom_op(f"{NAMESPACE}::{NAME}", _fetch_impl, mutates_args=())
        op.register_fake(_fetch_fake)
    except Exception:  # noqa: BLE001 - any failure: the feature is off (the probe says so)
        return False
    return True


def fetch(key: LayerKey, x: torch.Tensor, weight_shape: tuple, bias_shape: tuple = ()) -> list[torch.Tensor]:
    """The weight (and bias) for the call whose input is ``x``, through the op."""
    return getattr(torch.ops, NAMESPACE).layer_fetch(key.tensor, x, list(weight_shape), list(bias_shape))


class _Holder:  # the probe's stand-in for a layer (its key in an attribute)
    def __init__(self, key):
        self.key = key


def _scaled(holder, x):
    w = fetch(holder.key, x, (3,))[0]
    return x * w * 2


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """The op works here: one graph with no break serves two keys, and each call gets its own
    key's weight."""
    def run():
        if not register():
            return False
        c, x = _Counter(), torch.randn(3)
        compiled = torch.compile(_fresh(_scaled), backend=c, fullgraph=True)
        for scale in (2.0, -3.0):
            key = LayerKey(lambda t, s=scale: [torch.full_like(t, s)])
            if not torch.allclose(compiled(_Holder(key), x), x * scale * 2):
                return False
        return c.graphs == 1
    return _probe(run)
