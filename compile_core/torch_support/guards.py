"""Whether a graph dynamo already compiled takes a call, told without running it: dynamo's own
guards are checked against the call's arguments (``cached_graph_accepts``), and ``guard_check``
probes that this answers like dynamo does on this torch.
"""
from __future__ import annotations

import functools
import inspect
from typing import Callable

import torch
from torch import nn

from . import probe_memo
from .probing import _Counter, _probe


class _Probed(torch.nn.Module):  # the guard-check probe's region
    def forward(self, x, scale=2.0):
        return x.sin() * scale


@probe_memo.remembered
def guard_check() -> bool:
    """``cached_graph_accepts`` answers like dynamo: True for a call a graph of that compiled
    function takes (also a second module of the same class), False for a new size or dtype,
    and for a size only another compiled function's (dynamic) graph takes."""
    def run():
        m, other, x = _Probed(), _Probed(), torch.randn(2, 3)
        torch.compile(nn.Module._call_impl, backend=_Counter(), dynamic=True)(m, torch.randn(5, 3))
        c = torch.compile(nn.Module._call_impl, backend=_Counter(), dynamic=False)
        c(m, x)
        return (cached_graph_accepts(c, m, (x,), {}) is True
                and cached_graph_accepts(c, other, (torch.randn(2, 3),), {"scale": 2.0}) is True
                and cached_graph_accepts(c, m, (torch.randn(4, 3),), {}) is False
                and cached_graph_accepts(c, m, (x.double(),), {}) is False)
    return _probe(run)


def cached_graph_accepts(compiled: Callable, module: nn.Module, args: tuple, kwargs: dict) -> bool | None:
    """Whether a graph that ``compiled`` (a ``torch.compile`` of ``nn.Module._call_impl``)
    compiled for ``type(module).forward`` takes this call without a compile, or None when that
    cannot be told (no graph on that code yet, a forward that is not a plain function,
    arguments that do not bind). Dynamo keeps one list of graphs per code object for every
    compiled function; an entry is used only by functions whose backend equals the one that
    made it (``torch.compile`` twice with the same settings share their graphs)."""
    fn = type(module).forward
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
    backend = _backend_of(compiled)
    entries = [e for e in _debug_get_cache_entry_list(code)
               if backend is None or getattr(e, "backend", backend) == backend]  # as dynamo matches
    if not entries:
        return None
    try:
        bound = _signature(fn).bind(module, *args, **kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    frame_locals = dict(bound.arguments)
    return any(e.guard_manager.check(frame_locals) for e in entries)


@functools.lru_cache(maxsize=64)
def _backend_of(compiled: Callable) -> object:
    """The backend object dynamo stores in the cache entries ``compiled`` makes (None when
    this torch does not say)."""
    try:
        from torch._dynamo.eval_frame import innermost_backend
        callback = inspect.getclosurevars(compiled).nonlocals.get("callback")
        return innermost_backend(callback) if callback is not None else None
    except Exception:  # noqa: BLE001 - unknown: entries are not told apart
        return None


@functools.lru_cache(maxsize=256)
def _signature(fn) -> inspect.Signature:
    return inspect.signature(fn)
