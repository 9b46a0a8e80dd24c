"""Hooks into inductor's and dynamo's process-wide state that a compile of the pack runs under:
where inductor builds its precompiled C++ headers, header precompiling off while built kernels
load, the points where a background compile may pause, who else uses dynamo's compile lock, and
a one-time fx trace run early. Each leaves things as it found them.
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
from typing import Callable, Iterator


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


class _CountingLock:
    """dynamo's compile lock (the same lock), counting the threads inside its ``with`` blocks:
    holding it, or waiting for it."""

    def __init__(self, lock):
        self.lock, self.inside, self._mu = lock, {}, threading.Lock()

    def __enter__(self):
        me = threading.get_ident()
        with self._mu:
            self.inside[me] = self.inside.get(me, 0) + 1
        try:
            return self.lock.__enter__()
        except BaseException:
            self._leave(me)
            raise

    def __exit__(self, *exc):
        try:
            return self.lock.__exit__(*exc)
        finally:
            self._leave(threading.get_ident())

    def _leave(self, me: int) -> None:
        with self._mu:
            depth = self.inside.pop(me, 1) - 1
            if depth:
                self.inside[me] = depth

    def __getattr__(self, name):  # acquire, release, ... of the lock itself
        return getattr(self.lock, name)

    def others_inside(self, me: int) -> bool:
        return any(ident != me for ident in list(self.inside))


@contextlib.contextmanager
def compile_lock_users() -> Iterator[Callable[[int], bool]]:
    """Inside the block, dynamo's process-wide compile lock (``convert_frame.compile_lock``,
    which every frame dynamo converts enters, and inductor's compile too) counts the threads
    that hold it or wait for it. Yields ``others(ident)``: whether a thread other than ``ident``
    does now. Where this torch has no such lock, ``others`` is always True (the caller must then
    assume another thread may need dynamo). The lock is put back after."""
    try:
        import torch._dynamo.convert_frame as convert_frame
    except ImportError:
        convert_frame = None
    lock = getattr(convert_frame, "compile_lock", None)
    if not (callable(getattr(lock, "__enter__", None)) and callable(getattr(lock, "__exit__", None))):
        yield lambda ident: True
        return
    counting = _CountingLock(lock)
    convert_frame.compile_lock = counting
    try:
        yield counting.others_inside
    finally:
        if convert_frame.compile_lock is counting:
            convert_frame.compile_lock = lock


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
