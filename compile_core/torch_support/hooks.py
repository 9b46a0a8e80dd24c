"""Hooks into inductor's and dynamo's process-wide state that a compile of the pack runs under:
where inductor builds its precompiled C++ headers, header precompiling off while built kernels
load, the points where a background compile may pause, who else uses dynamo's compile lock, and
the one-time fx trace and graph-pass set-up run early. Each leaves things as it found them.
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


# What a compile calls many times a second in its Python phases: where a background compile
# may pause (``pause_points``). (module, class, name): a method of the class, or with class None
# a function of the module (looked up there by the code that calls it). A point this torch
# lacks is skipped. They are, in order: dynamo's bytecode steps, its lazy wrapping of each
# value it meets (one dict such as ``sys.modules`` took 0.05-0.16 s) and its building of each
# guard, each op run on fake tensors (one bytecode step ran 0.16 s of them) and each symbolic
# shape question (sympy), inductor's lowering, the interpreting of each fx node, each pattern
# tried by inductor's graph passes, its scheduler's nodes and fusion candidates, and the C++
# codegen's stride analysis (sympy simplifications, up to 0.19 s in one tiling choice otherwise).
# Then dynamo's wrapping of each dict key (a dict of many keys ran 0.13 s of them), and the
# steps after a frame's guards are built: their check function, the timing of the guards
# (it flushes the CPU cache first), their pickling for a saved region, and their unpickling
# and rebuilding when a block loads a saved region (0.13-0.18 s in one stretch otherwise).
# Each of those runs only where ``Guard.create`` runs too (a frame's compile, or the loading
# of saved guards), so none adds a place where the compile holds another lock.
_PAUSE_POINTS = (("torch._dynamo.symbolic_convert", "InstructionTranslatorBase", "step"),
                 ("torch._dynamo.variables.lazy", "LazyCache", "__init__"),
                 ("torch._guards", "Guard", "create"),
                 ("torch._subclasses.fake_tensor", "FakeTensorMode", "dispatch"),
                 ("torch.fx.experimental.symbolic_shapes", "ShapeEnv", "evaluate_expr"),
                 ("torch._inductor.graph", "GraphLowering", "run_node"),
                 ("torch.fx.interpreter", "Interpreter", "run_node"),
                 ("torch._inductor.pattern_matcher", "MatchContext", "match"),
                 ("torch._inductor.scheduler", "Scheduler", "create_scheduler_node"),
                 ("torch._inductor.scheduler", "Scheduler", "can_fuse"),
                 ("torch._inductor.codegen.cpp", None, "stride_at_vec_range"),
                 ("torch._dynamo.variables.hashable", "HashableTracker", "__init__"),
                 ("torch._dynamo.guards", "CheckFunctionManager", "compile_check_fn"),
                 ("torch._dynamo.guards", None, "profile_guard_manager"),
                 ("torch._dynamo.guards", "CheckFunctionManager", "serialize_guards"),
                 ("torch._dynamo.package", None, "load_guards_state"),
                 ("torch._dynamo.package", None, "load_guard_manager"))


@contextlib.contextmanager
def pause_points(check: Callable[[], None]) -> Iterator[None]:
    """Inside the block, ``check()`` runs on the calling thread at the start of each call of
    ``_PAUSE_POINTS`` (other threads' calls are not touched), so it may pause there. These
    points hold no lock but dynamo's compile lock. The originals are put back after."""
    owner, swapped = threading.get_ident(), []
    for owner_obj, name, original in _pause_targets():
        setattr(owner_obj, name, _with_check(original, check, owner))
        swapped.append((owner_obj, name, original))
    try:
        yield
    finally:
        for owner_obj, name, original in swapped:
            setattr(owner_obj, name, original)


def _pause_targets() -> list[tuple[object, str, Callable]]:
    """(class or module, name, original) of each pause point this torch has. A class attribute
    must be a plain function (a static or class method would lose its binding if wrapped)."""
    import importlib
    import inspect
    targets = []
    for module_name, class_name, name in _PAUSE_POINTS:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        owner_obj = getattr(module, class_name, None) if class_name else module
        if owner_obj is None:
            continue
        original = owner_obj.__dict__.get(name) if class_name else getattr(module, name, None)
        if inspect.isfunction(original) or (class_name is None and callable(original)):
            targets.append((owner_obj, name, original))
    return targets


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
def without_precompiled_header() -> Iterator[None]:
    """Around a saved region's capture and every load of it: its C++ kernels are built and
    looked up without inductor's precompiled C++ header. Whether it is on is part of a
    kernel's cache key (a define on its command line), and torch builds the header before it
    looks for a built kernel: a fleet worker or a new container has none (~5 s of a 5.4 s
    load), and a region captured with it and loaded without it built every kernel twice
    (12-15 s more for one block of the tiny WAN). Without the header a kernel compiles
    slower, but once, and loads at once everywhere.
    Nothing changes where this torch has no such setting."""
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


def warm_inductor_passes(device) -> None:
    """Run, on the calling thread, inductor's one-time set-up of its graph passes for models on
    ``device`` (``joint_graph.lazy_init``, ``post_grad.lazy_init``: imports and traces of their
    pattern replacements, cached for the process; 0.2-0.5 s, in one stretch without a pause
    point when a background compile meets it). Their traces swap ``nn.Module.__call__`` for the
    whole process, so no model may run meanwhile."""
    import inspect
    try:
        from torch._inductor.fx_passes import joint_graph, post_grad
        keyed = bool(inspect.signature(joint_graph.lazy_init).parameters)  # per device (newer torch)
        joint_graph.lazy_init(device) if keyed else joint_graph.lazy_init()
        post_grad.lazy_init()
    except Exception:  # noqa: BLE001 - only an optimisation: the first compile does it itself
        pass
