"""Weight fetches behind one custom op, so a LoRA's strength is data, not a guard.

In low-VRAM (partial) loading ComfyUI applies a LoRA at every forward, from Python objects
that hold the weight's key and the strength as a float; ComfyUI-GGUF keeps them on the
quantized tensor. Dynamo traced into them and guarded on those values: one graph per block
and per strength. Here the fetch is a call of the custom op ``tcs::weight_fetch`` on a
``WeightRef``, an opaque *reference* object (torch's ``register_opaque_type``): dynamo lifts
it as a graph input and guards on its type only, so one graph serves every block and every
strength. The op runs ``ref.fetch(x)`` (ComfyUI's own code) eagerly; while tracing, its fake
implementation returns ``ref.fake(x)`` (empty tensors of the right shape, dtype and device).

The op and the opaque type are registered once per process, on first use (``register``).
``opaque_weight_fetch`` probes that they work on this torch; on torch without
opaque objects nothing here is used and a strength change recompiles, as before.
"""
from __future__ import annotations

import functools
import sys
from typing import Callable

import torch

from . import probe_memo
from .probing import _Counter, _fresh, _probe

try:  # torch 2.14+ (opaque objects' base, renamed)
    from torch._custom_class_base import CustomClassBase as _Base
except ImportError:
    try:  # torch 2.13; on older torch the class is plain and never given to an op
        from torch._opaque_base import OpaqueBase as _Base
    except ImportError:
        _Base = object

NAMESPACE, NAME = "tcs", "weight_fetch"


class WeightRef(_Base):
    """What one fetch needs: ``fetch(x)`` gives the weight tensor(s) (a list) for the call whose
    input is ``x``, eagerly; ``fake(x)`` gives tensors like them (used while tracing only).
    ``label`` names the weight in messages. Outputs must be new tensors (never ``x``, never a
    parameter: inductor may reuse an op output's memory): ``fetch`` clones what it cannot
    guarantee."""

    def __init__(self, fetch: Callable[[torch.Tensor], list], fake: Callable[[torch.Tensor], list],
                 label: str = ""):
        self.fetch, self.fake, self.label = fetch, fake, label

    def __reduce__(self):
        """Inductor's cache key pickles the graph's inputs: there a ref stands for "a weight
        fetch" (the graph is the same whichever it is). A ref restored from a pickle has no
        fetch and says so if it is ever called, so it can never give a stale weight."""
        return _restored, ()


def _restored() -> WeightRef:
    def gone(x):
        raise RuntimeError("a pickled tcs::weight_fetch reference was called: the weight it "
                           "stood for is not in this object")
    return WeightRef(gone, gone, "restored")


# torch names an opaque type after its class's module, and its caches pickle the class by that
# name; ComfyUI imports a custom node pack under its folder's path (``/…/custom_nodes/…``),
# which a schema cannot hold. ``register`` makes this alias importable.
ALIAS = "torch_compile_speed_weight_fetch"
WeightRef.__module__ = _restored.__module__ = ALIAS


@functools.lru_cache(maxsize=None)
def register() -> bool:
    """Register ``WeightRef`` as an opaque reference type and ``tcs::weight_fetch`` (once per
    process). False where this torch cannot (no opaque objects, or the op name is taken)."""
    if _Base is object:
        return False
    try:
        sys.modules.setdefault(ALIAS, sys.modules[__name__])
        from torch._library import opaque_object
        new_api = getattr(opaque_object, "register_custom_class", None)  # torch 2.14's name
        if new_api is not None:
            new_api(WeightRef, typ="symbolic")
        else:
            opaque_object.register_opaque_type(WeightRef, typ="reference")
        op = torch.library.custom_op(f"{NAMESPACE}::{NAME}", _fetch_impl, mutates_args=())
        op.register_fake(_fetch_fake)
    except Exception:  # noqa: BLE001 - any failure: the feature is off (the probe says so)
        return False
    return True


def _fetch_impl(ref: WeightRef, x: torch.Tensor) -> list[torch.Tensor]:
    return [t.clone() if _shares_memory(t, x) else t for t in ref.fetch(x)]


def _fetch_fake(ref, x):
    # while tracing, ``ref`` is torch's FakeScriptObject around the real (reference) object
    return getattr(ref, "real_obj", ref).fake(x)


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def fetch(ref: WeightRef, x: torch.Tensor) -> list[torch.Tensor]:
    """The fetched weight tensor(s) for the call whose input is ``x``, through the op (traced as
    one node; dynamo does not look inside ``ref``). Call only after ``register()`` is True."""
    return getattr(torch.ops, NAMESPACE).weight_fetch(ref, x)


def available() -> bool:
    """The op works here: registered, and it compiles to one graph across refs (the probe)."""
    return opaque_weight_fetch()


class _Holder:  # the probe's stand-in for a layer's weight function (a ref in an attribute)
    def __init__(self, ref):
        self.ref = ref


def _fetch_twice(fetch, holder, x):
    return fetch(holder.ref, x)[0] * 2


@probe_memo.remembered
def opaque_weight_fetch() -> bool:
    """This module's op on an opaque reference object: one graph serves two different objects
    (their state is not guarded), and each call gets its own object's value."""
    def run():
        if not register():
            return False
        c, x = _Counter(), torch.randn(3)
        compiled = torch.compile(_fresh(_fetch_twice), backend=c, fullgraph=True)
        for scale in (2.0, -3.0):
            ref = WeightRef(lambda t, s=scale: [t * s], lambda t: [torch.empty_like(t)])
            if not torch.allclose(compiled(fetch, _Holder(ref), x), x * scale * 2):
                return False
        return c.graphs == 1
    return _probe(run)
