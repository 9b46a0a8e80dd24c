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

A job may *wait for an idle host* (``submit(..., yields=True)``): the compile of a model that
runs on the CPU, where the compile and the model share the same cores. It starts once the host
says it is idle (ComfyUI: no prompt running or queued, ``set_idle_check``), or after
``IDLE_WAIT_S`` on a host that never is; whoever waits for the worker (``wait_idle``) starts it
at once. Once started, it runs to its end like any other job. A GPU model's compile runs on the
CPU beside its sampling, from the start.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import queue
import threading
import time
from typing import Callable, Iterator

import torch
from torch import nn

from . import fallback
from ..report import log

IDLE_WAIT_S = 120.0  # s: the longest a CPU model's compile waits for the host to be idle
POLL_S = 0.05  # s between the questions while it waits
MAX_CAPTURED = 16  # region variants whose inputs one capture keeps (identical blocks share one)
# Serialises the moments the worker's compile scope sets or restores the process-wide
# environment with the foreground's own short scopes (``env_lock``).
_ENV_LOCK = threading.RLock()


class Job:
    """One queued compile: ``fn`` runs on the worker; ``done`` is set after, also on error."""

    def __init__(self, fn: Callable[[], None], label: str, yields: bool = False):
        self.fn, self.label, self.yields = fn, label, yields
        self.started = threading.Event()  # the worker runs it (a yielding job: the host was idle)
        self.waited_s = 0.0  # how long a yielding job waited for the host to be idle
        self.context = contextvars.copy_context()
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.result = None  # what ``fn`` returned
        self.failure = ""  # ``error`` explained, where it is a compile failure (``fallback``)
        self.queued = time.perf_counter()
        self.seconds = 0.0  # how long the worker ran it
        self.eager_calls = 0  # model calls that ran eagerly while it was pending
        self.beside_calls = 0  # other models' calls that ran eagerly beside it (``note_beside``)
        self.on_done: Callable[[], None] | None = None  # called on the worker once ``done`` is set

    def _run(self) -> None:
        start = time.perf_counter()
        try:
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
        self.waiters = 0  # threads in ``wait_idle``: a job waiting for an idle host starts now

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

    def first_pending(self) -> Job | None:
        """The first queued or running job not done yet (one just done may still be listed)."""
        with self._lock:
            return next((j for j in self._jobs if not j.done.is_set()), None)

    def running(self) -> bool:
        """A job is compiling now (not queued, not waiting for the host)."""
        job = self.current
        return job is not None and job.started.is_set()

    def wait_idle(self, timeout: float | None = None) -> bool:
        with self._idle:
            self.waiters += 1
            try:
                return self._idle.wait_for(lambda: self._pending == 0, timeout)
            finally:
                self.waiters -= 1

    def _start_when_idle(self, label: str) -> float:
        """Block until the host is idle, someone waits for the worker, or ``IDLE_WAIT_S``
        passed; the seconds it waited."""
        start = time.monotonic()
        if self.waiters or host_idle():
            return 0.0
        log.info("%s compiles in the background once the server is idle (at most %.0f s from now)",
                 label, IDLE_WAIT_S)
        while not (self.waiters or host_idle()) and time.monotonic() - start < IDLE_WAIT_S:
            time.sleep(POLL_S)
        return time.monotonic() - start

    def _loop(self) -> None:
        # a thread that lives as long as the process: every job runs on it
        while True:
            job = self._queue.get()
            self.current = job
            if job.yields:
                job.waited_s = self._start_when_idle(job.label)
            job.started.set()
            try:
                job._run()
            finally:
                self.current = None
                with self._idle:
                    self._pending -= 1
                    self._jobs.remove(job)
                    self._idle.notify_all()
                job = None  # (not held while the loop waits for the next one)


WORKER = _Worker()
_IDLE_CHECK: list[Callable[[], bool]] = [lambda: True]


def set_idle_check(check: Callable[[], bool]) -> None:
    """The host's "nothing is running or queued" test (default: always idle)."""
    _IDLE_CHECK[0] = check


def host_idle() -> bool:
    try:
        return bool(_IDLE_CHECK[0]())
    except Exception as exc:  # noqa: BLE001 - a broken check must not hold a compile back
        log.warn_once("bg-idle-check", "could not tell whether the server is idle (%s: %s); the "
                      "background compile starts now", type(exc).__name__, exc)
        return True


def submit(fn: Callable[[], None], label: str, yields: bool = False) -> Job:
    """Queue ``fn`` on the worker, in a copy of the caller's context (``yields``: see above)."""
    return WORKER.submit(Job(fn, label, yields))


def note_beside(description: str) -> None:
    """Count a model call that runs eagerly beside another model's compile running now, and
    say so at the first (no call beside it is left unsaid)."""
    job = WORKER.first_pending()
    if job is None:
        return
    job.beside_calls += 1
    if job.beside_calls == 1:
        log.info("%s runs eagerly while %s compiles in the background (nothing waits for that "
                 "compile; compiled calls resume when it is done)", description, job.label)


def busy() -> bool:
    """A job is queued or running."""
    return WORKER.busy()


def wait_idle(timeout: float | None = None) -> bool:
    """Block until every queued job is done (False on timeout)."""
    return WORKER.wait_idle(timeout)


@contextlib.contextmanager
def env_lock() -> Iterator[None]:
    """Hold while a scope sets or restores the pack's process-wide environment variables."""
    with _ENV_LOCK:
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
