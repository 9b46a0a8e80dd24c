"""The one place that knows what this torch can do: each feature is *tried*, not looked up.

A feature the pack uses is probed with a tiny compile (backend ``eager`` or a counting
backend: dynamo's tracing, guards and fake-tensor propagation, no code generation) on first
use, once per process, never at import of the pack. A name that exists is not proof: torch
2.8/2.9 have ``backed_size_oblivious`` but break WAN's size-1 broadcast under it, and 2.9 has
``aot_compile`` only behind ``torch._dynamo.config.enable_aot_compile``.

Probes leave no trace: they compile fresh code objects, and dynamo's counters and compilation
records are restored afterwards, so a probe that runs inside a measured model call is not
counted as the model's graphs. Supported: torch 2.8 to 2.15 (``MIN_VERSION``..``NEWEST_TESTED``).

The probes of compiling live here; those of saving and loading compiled code in ``aot``, the
weight-fetch op in ``weight_fetch``, and their shared helpers in
``probing``. ``features`` lists every probe's answer.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch

from . import aot, probe_memo, probing, weight_fetch
from .probing import _Counter, _fresh, _probe, _sin2

MIN_VERSION = (2, 8)
NEWEST_TESTED = (2, 15)


@functools.lru_cache(maxsize=None)
def unsupported() -> str:
    """'' when the pack compiles on this torch; else why not (the model then stays eager)."""
    if probing.version() < MIN_VERSION:
        return (f"torch {torch.__version__} is older than 2.8, the oldest torch this pack compiles "
                "with; the model stays eager (install torch 2.8 to 2.15 to compile)")
    if not compile_works():
        return (f"a tiny test compile failed on torch {torch.__version__}, so torch.compile does not "
                "work in this install; the model stays eager")
    return ""


# ------------------------------------------------------------------------------ the probes

@probe_memo.remembered
def compile_works() -> bool:
    """A tiny function compiles into one graph and gives eager's result."""
    def run():
        c = _Counter()
        x = torch.randn(3)
        return torch.equal(torch.compile(_fresh(_sin2), backend=c)(x), _sin2(x)) and c.graphs == 1
    return _probe(run)


def _limits_to_one(make: Callable[[_Counter], Callable]) -> bool:
    """``make(backend)`` compiles ``_sin2`` with a recompile limit of 1: a second size then
    runs eagerly (right result, no second graph)."""
    c = _Counter()
    compiled = make(c)
    outs = [compiled(torch.randn(n)) for n in (2, 3)]
    return all(o.shape == (n,) for o, n in zip(outs, (2, 3))) and c.graphs == 1


@probe_memo.remembered
def recompile_limit_kwarg() -> bool:
    """``torch.compile(recompile_limit=)`` is accepted and enforced."""
    return _probe(lambda: _limits_to_one(
        lambda c: torch.compile(_fresh(_sin2), backend=c, dynamic=False, recompile_limit=1)))


@functools.lru_cache(maxsize=None)
def recompile_limit_knob() -> str:
    """The ``torch._dynamo.config`` knob that limits recompiles per code object (renamed from
    ``cache_size_limit`` to ``recompile_limit``), '' when neither works."""
    import torch._dynamo.config as dynamo_config
    for name in ("recompile_limit", "cache_size_limit"):
        if name not in dynamo_config.get_config_copy():
            continue

        def run(name=name):
            with dynamo_config.patch({name: 1}):
                return _limits_to_one(lambda c: torch.compile(_fresh(_sin2), backend=c, dynamic=False))
        if _probe(run):
            return name
    return ""


@probe_memo.remembered
def isolate_recompiles() -> bool:
    """``torch.compile(isolate_recompiles=True)`` gives each compile its own cache and budget:
    two compiles of one function, each limited to one entry, both compile a graph."""
    import torch._dynamo.config as dynamo_config
    knob = recompile_limit_knob()

    def run():
        fn, x = _fresh(_sin2), torch.randn(3)
        a, b = _Counter(), _Counter()
        with dynamo_config.patch({knob: 1} if knob else {}):
            torch.compile(fn, backend=a, isolate_recompiles=True)(x)
            torch.compile(fn, backend=b, isolate_recompiles=True)(x)
        return a.graphs == 1 and b.graphs == 1
    return _probe(run)


@probe_memo.remembered
def guard_filter_fn() -> bool:
    """``options={"guard_filter_fn": f}``: torch calls ``f`` with the guards it builds."""
    def run():
        seen = []

        def keep_all(entries):
            seen.append(len(entries))
            return [True] * len(entries)
        x = torch.randn(3)
        out = torch.compile(_fresh(_sin2), backend="eager", options={"guard_filter_fn": keep_all})(x)
        return torch.equal(out, _sin2(x)) and bool(seen)
    return _probe(run)


# ----------------------------------------------------------------- shape policy: fx knobs

def _repeat_e(e, x):  # ComfyUI's WAN ``repeat_e`` (comfy/ldm/wan/model.py)
    repeats = 1
    if e.size(1) > 1:
        repeats = x.size(1) // e.size(1)
    if repeats == 1:
        return e
    if repeats * e.size(1) == x.size(1):
        return torch.repeat_interleave(e, repeats, dim=1)
    return torch.repeat_interleave(e, repeats + 1, dim=1)[:, :x.size(1)]


def _wan_modulation(x, e, modulation):
    """A WanAttentionBlock's modulation: ``e`` is (batch, 1, 6, dim), its dim 1 of size 1."""
    e = (modulation.unsqueeze(0) + e).unbind(2)
    return torch.addcmul(_repeat_e(e[0], x), x, 1 + _repeat_e(e[1], x))


@probe_memo.remembered
def backed_size_oblivious_safe() -> bool:
    """Under ``backed_size_oblivious`` (and no duck sizing), WAN's modulation with its size-1
    marked dim compiles once and serves a second token count with eager's result. torch 2.8
    and 2.9 fail it ("Attempting to broadcast a dimension of length s..")."""
    import torch.fx.experimental._config as fx_config
    if "backed_size_oblivious" not in fx_config.get_config_copy():
        return False

    def run():
        c = _Counter()
        compiled = torch.compile(_fresh(_wan_modulation), backend=c)
        mod = torch.randn(1, 6, 8)
        with fx_config.patch(use_duck_shape=False, backed_size_oblivious=True):
            for tokens in (4, 6):
                x, e = torch.randn(1, tokens, 8), torch.randn(1, 1, 6, 8)
                for t, dims in ((x, (0, 1)), (e, (0, 1))):
                    for d in dims:
                        torch._dynamo.maybe_mark_dynamic(t, d)
                if not torch.allclose(compiled(x, e, mod), _wan_modulation(x, e, mod)):
                    return False
        return c.graphs == 1
    return _probe(run)


def auto_fx_knobs() -> dict[str, object]:
    """The fx knobs of shape policy ``auto`` on this torch: no duck sizing, and
    ``backed_size_oblivious`` (a batch of 1 at the first call does not pin the batch) where
    it is safe. Without it a batch of 1 is specialised: the first batch of 2 recompiles once
    (dynamo's automatic dynamic then keeps the batch symbolic)."""
    import torch.fx.experimental._config as fx_config
    have = fx_config.get_config_copy()
    knobs: dict[str, object] = {"use_duck_shape": False} if "use_duck_shape" in have else {}
    if backed_size_oblivious_safe():
        knobs["backed_size_oblivious"] = True
    return knobs


def maybe_mark_dynamic(t: torch.Tensor, dim: int) -> None:
    """Dynamo's hint that ``t``'s size ``dim`` varies (``torch._dynamo.maybe_mark_dynamic``)."""
    torch._dynamo.maybe_mark_dynamic(t, dim)


# ------------------------------------------------------------------------------ summary

FEATURES: dict[str, Callable[[], object]] = {
    "compile": compile_works,
    "isolate_recompiles": isolate_recompiles,
    "recompile_limit_kwarg": recompile_limit_kwarg,
    "recompile_limit_knob": recompile_limit_knob,
    "guard_filter_fn": guard_filter_fn,
    "aot_compile": lambda: aot.aot_compile_knobs() is not None,
    "aot_compile_needs_enable_aot_compile": lambda: bool(aot.aot_compile_knobs()),
    "load_compiled_function": aot.load_compiled_function,
    "backed_size_oblivious_safe": backed_size_oblivious_safe,
    "cache_artifacts": aot.cache_artifacts,
    "opaque_weight_fetch": weight_fetch.opaque_weight_fetch,
}


def features() -> dict[str, object]:
    """Every probe's answer (runs the probes not run yet)."""
    return {name: probe() for name, probe in FEATURES.items()}
