"""Compile in a worker thread while the model runs eagerly.

The first model call of a model in background mode runs eagerly and keeps each region's
first inputs (``capture_eager``). One worker thread then compiles the regions on those
inputs (``submit``), and the engine swaps the compiled regions in at the next model call
(a step boundary) after the job is done. Jobs of several models queue on the one worker.

Why one worker, and why nobody else compiles meanwhile: dynamo serialises tracing with a
global lock anyway, and the cache-dir environment variables that a compile's scope sets
are process-wide. So while the worker is busy, models in background mode run eagerly and
others wait for it (``wait_idle``). Each job runs in a copy of the submitting thread's
``contextvars`` context: torch 2.13 keeps config overrides in context variables, so a plain
thread would not see the caller's settings. The job applies the caller's grad and inference
modes (thread-local) too, so its graphs' guards hold on the main thread.

A job may *yield* (``submit(..., yields=True)``): the compile of a model that runs on the CPU,
where the compile and the model share the same cores. It starts once the host is idle and
pauses while a prompt runs (``pacing``); whoever waits for the worker (``wait_idle``) gets it
done at once. A GPU model's compile runs on the CPU beside its sampling, from the start.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import queue
import sys
import threading
import time
from typing import Callable, Iterator

import torch
from torch import nn

from . import fallback, pacing
from ..report import log
from ..torch_support import compile_threads, openmp

MAX_CAPTURED = 16  # region variants whose inputs one capture keeps (identical blocks share one)
# Serialises the moments the worker's compile scope sets or restores the process-wide
# environment with the foreground's own short scopes (``env_lock``).
_ENV_LOCK = threading.RLock()


class Job:
    """One queued compile: ``fn`` runs on the worker; ``done`` is set after, also on error."""

    def __init__(self, fn: Callable[[], None], label: str, yields: bool = False):
        self.fn, self.label, self.yields = fn, label, yields
        self.started = threading.Event()  # the worker runs it (a yielding job: the host was idle)
        self.pauses, self.paused_s = 0, 0.0  # while prompts ran (``pacing``)
        self.paused = False  # sleeping in a pause now
        self.beside: pacing.Beside | None = None  # a yielding job's time beside prompts
        self.compilers_held = 0  # how many times its compilers were stopped for prompts (``compilers``)
        self.context = contextvars.copy_context()
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.failure = ""  # ``error`` explained, where it is a compile failure (``fallback``)
        self.queued = time.perf_counter()
        self.seconds = 0.0  # how long the worker ran it
        self.eager_calls = 0  # model calls that ran eagerly while it was pending
        self.beside_calls = 0  # model calls that ran beside it, eagerly or not (``note_beside``)
        self.what = ""  # what it compiles, for the log ("the first input", "a new input")
        self.result = None  # what ``fn`` returned
        self.on_done: Callable[[], None] | None = None  # called on the worker once ``done`` is set

    def _run(self) -> None:
        start = time.perf_counter()
        try:
            with pacing.paced(self) if self.yields else contextlib.nullcontext():
                self.result = self.context.run(self.fn)
        except BaseException as exc:  # noqa: BLE001 - the engine reports it (one warning)
            # classified while its frames are there; then they go (they hold the captured inputs)
            self.failure = fallback.explain(exc) if fallback.is_compile_failure(exc) else ""
            self.error = exc.with_traceback(None)
        finally:
            self.seconds = time.perf_counter() - start
            # what it ran holds the model's modules and inputs: a done job must not keep the
            # model alive once ComfyUI lets it go (the engine keeps the job until its swap)
            self.fn = self.context = None
            self.done.set()
        on_done, self.on_done = self.on_done, None
        if on_done is not None:
            try:
                on_done()
            except Exception as exc:  # noqa: BLE001 - a notification must not stop the worker
                log.warn_once("job-on-done", "after the background compile of %s: %s: %s",
                              self.label, type(exc).__name__, exc)


class _Worker:
    """A single daemon thread draining a queue of ``Job``s; started on first use."""

    def __init__(self):
        self._queue: "queue.Queue[Job]" = queue.Queue()
        self._pending = 0
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._jobs: list[Job] = []  # queued or running, in order
        self.current: Job | None = None  # the job running now

    def submit(self, job: Job) -> Job:
        with self._lock:
            self._pending += 1
            self._jobs.append(job)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="tcs-background-compile",
                                                daemon=True)
                self._thread.start()
        self._queue.put(job)
        return job

    def busy(self) -> bool:
        return self._pending > 0

    def running(self) -> bool:
        """A job is compiling now (not queued, not waiting for the host, not paused)."""
        job = self.current
        return job is not None and job.started.is_set() and not job.paused

    def wait_idle(self, timeout: float | None = None) -> bool:
        with pacing.waiting(), self._idle:  # (whoever waits needs yielding jobs done now)
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def _loop(self) -> None:
        # (not niced: tracing is Python under the GIL, and a niced thread rarely wins the GIL
        # from a busy main thread; measured: a 25 s compile did not finish in 80 s)
        while True:
            job = self._queue.get()
            self.current = job
            if job.yields:
                pacing.start_when_idle(job.label)
            job.started.set()
            try:
                with short_gil_turns():
                    _in_own_thread(job._run, job.label)
            finally:
                self.current = None
                with self._idle:
                    self._pending -= 1
                    self._jobs.remove(job)
                    self._idle.notify_all()
                job = None  # (not held while the loop waits for the next one)


def _in_own_thread(fn: Callable[[], None], label: str) -> None:
    """Run ``fn`` in a thread that ends with it. A compile runs its graphs once on the captured
    inputs, and on the CPU their OpenMP loops give the calling thread a thread team of its own
    that lives as long as the thread. With a second team alive, the OpenMP runtime has more
    threads than cores and stops spinning between parallel loops, so every later model call is
    slower (measured, 2 cores, tiny WAN: the regional graphs 52 -> 90 ms a call after a compile
    on the long-lived worker; unchanged after one in a thread that ended). Not on a torch where
    a thread that compiled must not end (``compile_threads``): there ``fn`` runs on the worker,
    which never ends, and gives its OpenMP team back after each job (``openmp``)."""
    if not compile_threads.after_a_thread_ends():
        fn()
        openmp.release_thread_team()
        return
    thread = threading.Thread(target=fn, name=f"tcs-compile {label}"[:60], daemon=True)
    thread.start()
    thread.join()


WORKER = _Worker()


SWITCH_INTERVAL = 0.0005  # s, while a job runs (Python's default is 0.005)


@contextlib.contextmanager
def short_gil_turns() -> Iterator[None]:
    """Shorter GIL turns while the worker compiles. Every torch op of an eager step releases
    the GIL, and getting it back means waiting for the worker's turn to end; with Python's
    5 ms turns a step of a few hundred ops took 2.5-4.4 s whenever dynamo's tracing (pure
    Python) ran beside it (measured: 8-block tiny WAN, 55 ms alone). With 0.5 ms turns the
    slowest step beside the compile was 0.8 s and the compile took 7 % longer. The interval
    is process-wide; it is put back after the job, unless someone else changed it meanwhile."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(min(before, SWITCH_INTERVAL))
    ours = sys.getswitchinterval()
    try:
        yield
    finally:
        if sys.getswitchinterval() == ours:
            sys.setswitchinterval(before)


def submit(fn: Callable[[], None], label: str, yields: bool = False) -> Job:
    """Queue ``fn`` on the worker, in a copy of the caller's context (``yields``: see above)."""
    return WORKER.submit(Job(fn, label, yields))


def note_beside(description: str, eager_why: str = "") -> None:
    """Count a model call that runs beside another model's compile running now, and say so at
    the first (no call beside it is left unsaid): on its own graphs (``beside``), or eagerly
    and why (``eager_why``)."""
    job = WORKER.current
    if job is None:
        return
    job.beside_calls += 1
    if job.beside_calls > 1:
        return
    if eager_why:
        log.info("%s runs eagerly while %s compiles in the background (%s; nothing waits for "
                 "that compile; compiled calls resume when it is done)", description, job.label, eager_why)
    else:
        log.info("%s runs its compiled graphs while %s compiles in the background (a call none of "
                 "them takes runs uncompiled; nothing waits for that compile)", description, job.label)


def busy() -> bool:
    """A job is queued or running."""
    return WORKER.busy()


def wait_idle(timeout: float | None = None) -> bool:
    """Block until every queued job is done (False on timeout)."""
    return WORKER.wait_idle(timeout)


@contextlib.contextmanager
def env_lock() -> Iterator[None]:
    """Hold while a scope sets or restores the pack's process-wide environment variables."""
    with pacing.unpaused(), _ENV_LOCK:
        yield


@contextlib.contextmanager
def locked_scope(scope: contextlib.AbstractContextManager) -> Iterator[None]:
    """Enter and exit ``scope`` under ``env_lock`` (the body runs without the lock)."""
    with env_lock():
        scope.__enter__()
    try:
        yield
    except BaseException as exc:
        with env_lock():
            if not scope.__exit__(type(exc), exc, exc.__traceback__):
                raise
    else:
        with env_lock():
            scope.__exit__(None, None, None)


def eager_beside_worker(call: Callable[[], object]):
    """Run an eager model call while the worker may be compiling. torch.fx's tracers patch
    ``nn.Module.__call__`` for the whole process while they trace (inductor traces small
    helpers and its pattern replacements with them), so a module call on this thread can land
    in the worker's tracer and fail (``NameError: module is not installed as a submodule``).
    Such a call is run again as soon as no tracer holds the patch (each trace is short), and
    after ``RETRIES`` such tries once the worker is idle. The model's own errors are raised as
    they are. The call keeps this thread's intra-op thread count: dynamo guards a graph on the
    count of the thread that compiled it, and ``torch.set_num_threads`` sets the count new
    threads (the worker's) start with too."""
    for _ in range(RETRIES):
        try:
            return call()
        except Exception as exc:  # noqa: BLE001 - re-raised unless it came from a tracer's patch
            if not _through_fx_tracer(exc):
                raise
            log.warn_once("bg-fx-race", "an eager step ran into the background compile's torch.fx "
                             "tracer (%s); it runs again once that trace is done", exc)
        _wait_for_unpatched_call()
    wait_idle()
    return call()


RETRIES = 20
_MODULE_CALL = nn.Module.__call__  # as torch defines it; a tracer swaps it while it traces


def _wait_for_unpatched_call(timeout: float = 2.0) -> None:
    """Until ``nn.Module.__call__`` is torch's own again (or ``timeout``: someone else may
    have replaced it for good; the caller then falls back to waiting for the worker)."""
    deadline = time.monotonic() + timeout
    while nn.Module.__call__ is not _MODULE_CALL and time.monotonic() < deadline and busy():
        time.sleep(0.002)


def _through_fx_tracer(exc: BaseException) -> bool:
    tb = exc.__traceback__
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename.replace("\\", "/")
        if "/torch/fx/" in name:
            return True
        tb = tb.tb_next
    return False


# --------------------------------------------------------------------------- capture


class Captured:
    """A region module, its first call's inputs (tensors copied), and the caller's modes."""

    def __init__(self, module: nn.Module, args: tuple, kwargs: dict):
        self.module = module
        self.args = tuple(_snapshot(a) for a in args)
        self.kwargs = {k: _snapshot(v) for k, v in kwargs.items()}
        self.grad = torch.is_grad_enabled()
        self.inference = torch.is_inference_mode_enabled()

    @contextlib.contextmanager
    def modes(self) -> Iterator[None]:
        """The grad and inference modes of the captured call (both are thread-local)."""
        with torch.inference_mode(self.inference), torch.set_grad_enabled(self.grad):
            yield


def _snapshot(value):
    """A copy of a tensor that a later in-place op cannot change, with the same dispatch keys
    (an inference tensor stays one, a normal tensor stays normal), dtype, device and strides;
    other values are kept by reference (a dict is copied one level)."""
    if isinstance(value, torch.Tensor):
        with torch.inference_mode(value.is_inference()):
            return value.detach().clone()
    if isinstance(value, dict):
        return dict(value)
    return value


def capture_eager(modules: list[nn.Module], call: Callable[[], object],
                  key: Callable[[nn.Module], object]) -> tuple[object, list[Captured]]:
    """Run ``call`` eagerly and return (its output, the first inputs of each region ``key``)."""
    seen: dict[object, Captured] = {}
    saved = []

    def recorder(m):
        def record(*args, **kwargs):
            k = key(m)
            if k not in seen and len(seen) < MAX_CAPTURED:
                seen[k] = Captured(m, args, kwargs)
            return nn.Module._call_impl(m, *args, **kwargs)
        return record

    try:
        for m in modules:
            if "_compiled_call_impl" in m.__dict__:
                continue  # someone else's hook: leave it
            saved.append(m)
            m.__dict__["_compiled_call_impl"] = recorder(m)
        out = call()
    finally:
        for m in saved:
            m.__dict__.pop("_compiled_call_impl", None)
    return out, list(seen.values())


# --------------------------------------------------------------------------- settings


def settings_for(settings, device: torch.device):
    """On CUDA a background compile must not autotune next to the running model (autotuning
    allocates benchmark buffers in VRAM and times kernels on a GPU the model keeps busy):
    ``mode`` becomes ``default``."""
    if not settings.background_compile or device.type != "cuda":
        return settings
    if settings.mode == "default":
        return settings
    log.info_once("background-mode-default", "compiling in the background on %s: mode %s becomes "
                  "'default' (no autotuning next to the running model, no extra VRAM)",
                  device, settings.mode)
    return dataclasses.replace(settings, mode="default")
