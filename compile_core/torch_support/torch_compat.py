"""The one place that knows what this torch can do: each feature is *tried*, not looked up.

A feature the pack uses is probed with a tiny compile (backend ``eager`` or a counting
backend: dynamo's tracing, guards and fake-tensor propagation, no code generation) on first
use, once per process, never at import of the pack. A name that exists is not proof: torch
2.8/2.9 have ``backed_size_oblivious`` but break WAN's size-1 broadcast under it, and 2.9 has
``aot_compile`` only behind ``torch._dynamo.config.enable_aot_compile``.

Probes leave no trace: they compile fresh code objects, and dynamo's counters and compilation
records are restored afterwards, so a probe that runs inside a measured model call is not
counted as the model's graphs. Supported: torch 2.8 to 2.14 (``MIN_VERSION``..``NEWEST_TESTED``).
"""
from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import io
import logging
import os
import re
import sys
import threading
import types
import warnings
from typing import Callable, Iterator

import torch
from torch import nn

from . import compile_threads

MIN_VERSION = (2, 8)
NEWEST_TESTED = (2, 14)


def version() -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", torch.__version__)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


@functools.lru_cache(maxsize=None)
def unsupported() -> str:
    """'' when the pack compiles on this torch; else why not (the model then stays eager)."""
    if version() < MIN_VERSION:
        return (f"torch {torch.__version__} is older than 2.8, the oldest torch this pack compiles "
                "with; the model stays eager (install torch 2.8 to 2.14 to compile)")
    if not compile_works():
        return (f"a tiny test compile failed on torch {torch.__version__}, so torch.compile does not "
                "work in this install; the model stays eager")
    return ""


# ------------------------------------------------------------------------------ probe helpers

class _Counter:
    """A dynamo backend that counts the graphs it is given and runs them as plain FX code."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return gm.forward


def _fresh(fn: Callable) -> Callable:
    """``fn`` with a code object of its own: no cache entry, recompile count or size history
    of another compile applies to it, and its cache entries die with it."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__,
                              fn.__defaults__, fn.__closure__)


_CACHE_DIR_VARS = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
# where a failing probe logs (a fake-tensor error is logged at ERROR before it is raised)
_TORCH_LOGGERS = ("torch._dynamo", "torch._subclasses", "torch._inductor", "torch.fx",
                  "torch._functorch", "torch._guards")


@contextlib.contextmanager
def _traceless() -> Iterator[None]:
    """Quiet (a probe that hits a recompile limit on purpose warns) and uncounted: dynamo's
    counters and compilation records, and the cache-dir variables, are restored on exit.
    Holds dynamo's compile lock throughout (``convert_frame.compile_lock``, an RLock in torch
    2.8-2.14): the start-up warm-up probes on a thread of its own, and another thread's
    compile meanwhile (core's TorchCompileModel, say) would count into what is then restored,
    and lose its counts."""
    from torch._dynamo import convert_frame, utils as dutils
    with getattr(convert_frame, "compile_lock", None) or contextlib.nullcontext():
        saved_counters = copy.deepcopy(dutils.counters)
        metrics = getattr(dutils, "_compilation_metrics", None)
        saved_metrics = list(metrics) if metrics is not None else None
        env = {k: os.environ.get(k) for k in _CACHE_DIR_VARS}  # torch 2.9 sets them on first compile
        loggers = [logging.getLogger(n) for n in _TORCH_LOGGERS]
        levels = [lg.level for lg in loggers]
        for lg in loggers:
            lg.setLevel(logging.CRITICAL)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                yield
        finally:
            for lg, level in zip(loggers, levels):
                lg.setLevel(level)
            for k, v in env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            dutils.counters.clear()
            dutils.counters.update(saved_counters)
            if saved_metrics is not None:
                metrics.clear()
                metrics.extend(saved_metrics)


def _probe(fn: Callable[[], bool]) -> bool:
    """``fn()`` is True, run traceless; any exception means the feature does not work here."""
    try:
        with _traceless():
            return bool(fn())
    except Exception:  # noqa: BLE001 - a probe failing in any way is the answer
        return False


def _sin2(x):
    return x.sin() * 2


# ------------------------------------------------------------------------------ the probes

@functools.lru_cache(maxsize=None)
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


@functools.lru_cache(maxsize=None)
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


@functools.lru_cache(maxsize=None)
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


@functools.lru_cache(maxsize=None)
def mark_unbacked() -> bool:
    """``torch._dynamo.decorators.mark_unbacked``: one graph serves two sizes."""
    def run():
        from torch._dynamo.decorators import mark_unbacked as mark
        c = _Counter()
        compiled = torch.compile(_fresh(_sin2), backend=c)
        for n in (3, 5):
            x = torch.randn(n)
            mark(x, 0)
            if not torch.equal(compiled(x), _sin2(x)):
                return False
        return c.graphs == 1
    return _probe(run)


@functools.lru_cache(maxsize=None)
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


@functools.lru_cache(maxsize=None)
def load_compiled_function() -> bool:
    """A function from ``aot_compile`` serializes and ``torch.compiler.load_compiled_function``
    loads it back into a working function."""
    knobs = aot_compile_knobs()
    return knobs is not None and _probe(lambda: _aot_roundtrip(knobs, load=True))


def _aot_roundtrip(knobs: dict, load: bool) -> bool:
    """Trace with ``aot_compile`` (and, with ``load``, save and load back in the pack's format,
    ``precompiled.save``). torch 2.9 refuses the ``eager`` backend's output as not a
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


@functools.lru_cache(maxsize=None)
def nested_compile_region() -> bool:
    """``torch.compiler.nested_compile_region`` wraps a function that compiles and runs."""
    def run():
        region = torch.compiler.nested_compile_region(_fresh(_sin2))

        def outer(x):
            return region(x) + region(x)
        x = torch.randn(3)
        return torch.allclose(torch.compile(_fresh(outer), backend="eager", fullgraph=True)(x),
                              _sin2(x) * 2)
    return _probe(run)


@functools.lru_cache(maxsize=None)
def cache_artifacts() -> bool:
    """``torch.compiler.save_cache_artifacts`` / ``load_cache_artifacts`` run."""
    def run():
        saved = torch.compiler.save_cache_artifacts()
        return saved is None or (isinstance(saved, tuple) and len(saved) == 2)
    return _probe(run) and hasattr(torch.compiler, "load_cache_artifacts")


class _Holder:  # the probe's stand-in for a layer's weight function (a ref in an attribute)
    def __init__(self, ref):
        self.ref = ref


def _fetch_twice(fetch, holder, x):
    return fetch(holder.ref, x)[0] * 2


@functools.lru_cache(maxsize=None)
def opaque_weight_fetch() -> bool:
    """``compile_core.torch_support.weight_fetch``'s op on an opaque reference object: one graph serves two
    different objects (their state is not guarded), and each call gets its own object's value."""
    def run():
        from . import weight_fetch
        if not weight_fetch.register():
            return False
        c, x = _Counter(), torch.randn(3)
        compiled = torch.compile(_fresh(_fetch_twice), backend=c, fullgraph=True)
        for scale in (2.0, -3.0):
            ref = weight_fetch.WeightRef(lambda t, s=scale: [t * s], lambda t: [torch.empty_like(t)])
            if not torch.allclose(compiled(weight_fetch.fetch, _Holder(ref), x), x * scale * 2):
                return False
        return c.graphs == 1
    return _probe(run)


# ----------------------------------------------------------------- shape policy: fx knobs

class _Probed(torch.nn.Module):  # the guard-check probe's region
    def forward(self, x, scale=2.0):
        return x.sin() * scale


@functools.lru_cache(maxsize=None)
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


@functools.lru_cache(maxsize=None)
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


# ------------------------------------------------------------------------------ summary

FEATURES: dict[str, Callable[[], object]] = {
    "compile": compile_works,
    "isolate_recompiles": isolate_recompiles,
    "recompile_limit_kwarg": recompile_limit_kwarg,
    "recompile_limit_knob": recompile_limit_knob,
    "mark_unbacked": mark_unbacked,
    "guard_filter_fn": guard_filter_fn,
    "aot_compile": lambda: aot_compile_knobs() is not None,
    "aot_compile_needs_enable_aot_compile": lambda: bool(aot_compile_knobs()),
    "load_compiled_function": load_compiled_function,
    "backed_size_oblivious_safe": backed_size_oblivious_safe,
    "nested_compile_region": nested_compile_region,
    "cache_artifacts": cache_artifacts,
    "opaque_weight_fetch": opaque_weight_fetch,
    "guard_check": guard_check,
    "compiles_after_a_thread_ends": compile_threads.after_a_thread_ends,  # (a child process)
}


def answered(probe: Callable[[], object]) -> object | None:
    """A start-up probe's answer if it has run, else None (without running it: a probe holds
    dynamo's compile lock, which a compile on another thread may hold for minutes)."""
    return probe() if probe.cache_info().currsize else None


def features() -> dict[str, object]:
    """Every probe's answer (runs the probes not run yet)."""
    return {name: probe() for name, probe in FEATURES.items()}


_HEADER_ATTRS = ("_HEADER_DIR", "_HEADER_LOCK_DIR")


@contextlib.contextmanager
def precompiled_header_dir(path: str | None) -> Iterator[None]:
    """Inside the block, inductor builds its precompiled C++ headers under ``path``. torch puts
    them under TMPDIR (``codecache._HEADER_DIR``, fixed at import, outside
    ``TORCHINDUCTOR_CACHE_DIR``) and builds them before it looks for a cached kernel, so a new
    container rebuilt a 150 MB header (tens of seconds) on a full cache hit. Nothing changes
    where this torch keeps no such directory."""
    codecache = sys.modules.get("torch._inductor.codecache") if path else None
    if codecache is None and path:
        try:
            import torch._inductor.codecache as codecache
        except ImportError:
            codecache = None
    if codecache is None or not all(isinstance(getattr(codecache, n, None), str) for n in _HEADER_ATTRS):
        yield
        return
    saved = [getattr(codecache, n) for n in _HEADER_ATTRS]
    codecache._HEADER_DIR, codecache._HEADER_LOCK_DIR = path, os.path.join(path, "locks")
    try:
        yield
    finally:
        codecache._HEADER_DIR, codecache._HEADER_LOCK_DIR = saved


# Methods a compile calls many times a second in its Python phases (dynamo's bytecode steps,
# inductor's lowering and torch.fx's interpreting of each node): where a background compile
# may pause (``pause_points``). A point this torch lacks is skipped.
_PAUSE_POINTS = (("torch._dynamo.symbolic_convert", "InstructionTranslatorBase", "step"),
                 ("torch._inductor.graph", "GraphLowering", "run_node"),
                 ("torch.fx.interpreter", "Interpreter", "run_node"))


@contextlib.contextmanager
def pause_points(check: Callable[[], None]) -> Iterator[None]:
    """Inside the block, ``check()`` runs on the calling thread at the start of each method of
    ``_PAUSE_POINTS`` it calls (other threads' calls are not touched), so it may pause there.
    These points hold no lock but dynamo's compile lock. The methods are put back after."""
    import importlib
    owner, swapped = threading.get_ident(), []
    for module_name, class_name, method in _PAUSE_POINTS:
        cls = getattr(importlib.import_module(module_name), class_name, None)
        original = cls.__dict__.get(method) if cls is not None else None
        if callable(original):
            setattr(cls, method, _with_check(original, check, owner))
            swapped.append((cls, method, original))
    try:
        yield
    finally:
        for cls, method, original in swapped:
            setattr(cls, method, original)


def _with_check(original: Callable, check: Callable[[], None], owner: int) -> Callable:
    @functools.wraps(original)
    def method(*args, **kwargs):
        if threading.get_ident() == owner:
            check()
        return original(*args, **kwargs)
    return method


@contextlib.contextmanager
def loading_built_kernels() -> Iterator[None]:
    """Around loading compiled code whose C++ kernels are built already (a saved region, from
    this cache or a fleet's): inductor builds its precompiled C++ header before it looks for
    the built kernel, which on a worker without that header (a new container, a fleet worker)
    cost ~5 s of a 5.4 s load. Header precompiling is off inside the block: a kernel that is
    built loads at once, one that is missing compiles without the header (the same library,
    compiled slower). Nothing changes where this torch has no such setting."""
    import torch._inductor.config as inductor_config
    if not isinstance(getattr(inductor_config, "cpp_cache_precompile_headers", None), bool):
        yield
        return
    with inductor_config.patch(cpp_cache_precompile_headers=False):
        yield


def precompiled_header_dir_now() -> str | None:
    """Where inductor builds precompiled headers now (for the leak checks), if it is imported."""
    return getattr(sys.modules.get("torch._inductor.codecache"), "_HEADER_DIR", None)


def warm_fx_tracers() -> None:
    """Run, on the calling thread, the one-time torch.fx symbolic trace inductor does on first
    use (``loop_body.InterpreterShim._dummy_gm``, cached for the process). A symbolic trace
    patches ``nn.Module.__call__`` process-wide while it runs; done here, before a background
    compile starts, it cannot catch an eager step of the main thread (``background``)."""
    try:
        from torch._inductor.loop_body import InterpreterShim
        InterpreterShim._dummy_gm()
    except Exception:  # noqa: BLE001 - not on this torch: background.eager_beside_worker copes
        pass


def graph_count() -> int:
    """Graphs dynamo has compiled in this process (its ``unique_graphs`` counter)."""
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


def graph_break_count() -> int:
    """Graph breaks dynamo has met in this process (its ``graph_break`` counters)."""
    from torch._dynamo.utils import counters
    return int(sum(counters["graph_break"].values()))
