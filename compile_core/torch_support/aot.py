"""Probes of saving and loading compiled code on this torch: ``aot_compile`` (and the knobs it
needs), the ``load_compiled_function`` round trip the saved regions rely on, and the portable
cache artifacts; ``aot_capture`` applies the knobs around an ``aot_compile()`` call. Each probe
runs once per process, on first use, traceless (``probing``).
"""
from __future__ import annotations

import contextlib
import functools
import io

import torch

from . import probe_memo
from .probing import _fresh, _probe, _sin2


@functools.lru_cache(maxsize=None)
def aot_compile_knobs() -> dict | None:
    """The ``torch._dynamo.config`` knobs ``torch.compile(...).aot_compile()`` needs here
    (``{}``: none; torch 2.9 wants ``enable_aot_compile``), None when it does not work."""
    import torch._dynamo.config as dynamo_config
    have = dynamo_config.get_config_copy()
    for knobs in ({}, {"enable_aot_compile": True}):
        if set(knobs) - set(have):
            continue
        if _probe(lambda: _aot_roundtrip(knobs, load=False)):
            return knobs
    return None


@probe_memo.remembered
def load_compiled_function() -> bool:
    """A function from ``aot_compile`` serializes and ``torch.compiler.load_compiled_function``
    loads it back into a working function."""
    knobs = aot_compile_knobs()
    return knobs is not None and _probe(lambda: _aot_roundtrip(knobs, load=True))


def _aot_roundtrip(knobs: dict, load: bool) -> bool:
    """Trace with ``aot_compile`` (and, with ``load``, save and load back in the pack's format,
    ``saved_region.save``). torch 2.9 refuses the ``eager`` backend's output as not a
    ``SerializableCallable``: that means aot_compile traced (inductor's output is serializable),
    but no cheap round trip proves loading there."""
    import torch._dynamo.config as dynamo_config
    x = torch.randn(3)
    try:
        with dynamo_config.patch(knobs):
            fn = torch.compile(_fresh(_sin2), fullgraph=True, backend="eager").aot_compile(((x,), {}))
    except RuntimeError as exc:
        if "SerializableCallable" in str(exc) and not load:
            return True
        raise
    if load:
        data = type(fn).serialize(fn).serialized_data
        fn = torch.compiler.load_compiled_function(io.BytesIO(data))
    return torch.equal(fn(x), _sin2(x))


@contextlib.contextmanager
def aot_capture():
    """Around an ``aot_compile()`` call: the knobs this torch needs for it (none on 2.10+)."""
    import torch._dynamo.config as dynamo_config
    with dynamo_config.patch(aot_compile_knobs() or {}):
        yield


@probe_memo.remembered
def cache_artifacts() -> bool:
    """``torch.compiler.save_cache_artifacts`` / ``load_cache_artifacts`` run."""
    def run():
        saved = torch.compiler.save_cache_artifacts()
        return saved is None or (isinstance(saved, tuple) and len(saved) == 2)
    return _probe(run) and hasattr(torch.compiler, "load_cache_artifacts")


def unsaved_guard_kinds() -> tuple[str, ...]:
    """The guard kinds torch cannot save (torch's own list); empty on a torch without the list
    (2.8: no ``UNSUPPORTED_SERIALIZATION_GUARD_TYPES``, and no saved regions there either)."""
    from torch._dynamo.guards import CheckFunctionManager
    return tuple(sorted(getattr(CheckFunctionManager, "UNSUPPORTED_SERIALIZATION_GUARD_TYPES", ())))
