"""A background compile of a CPU model yields to prompts.

On the CPU the compile and the model share the same cores, and dynamo's tracing (pure Python)
shares the interpreter lock with the sampling thread: a compile beside a prompt made its steps
2-4x slower (``benchmarks/results/background_cpu.md``). So a *yielding* job starts only once the
host is idle (ComfyUI: no prompt running or queued, ``set_idle_check``), and once started it
gives way to prompts (``paced``):
- in its Python phases it pauses at torch's per-instruction and per-node methods
  (``hooks.pause_points``; a profile hook at every call cost 30-50 % of the compile),
  sleeping without the interpreter lock until the host is idle again; at each point it gives
  back the OpenMP thread team its last parallel op left (``openmp``);
- where it waits for child processes of its own (torch's CPU ISA probe: a C++ build and a
  Python that loads it, per ISA) it runs them one at a time, each after a ``pause_point`` and
  started at the lowest CPU priority (``lowered_step``);
- the C++ compilers the process runs meanwhile (inductor's g++ and the like) run at the lowest
  CPU priority, and the job's own are stopped while the host is busy (``compilers``). The
  compile's own thread keeps its priority: a thread that holds the interpreter lock must not
  wait for a core behind the compilers while the sampling thread waits for the lock.

A pause must never hold something the prompt needs:
- not inside the logging or import machinery (their locks), nor inside ``unpaused`` (the pack's
  own locks the sampling thread takes): the hook waits for a later call;
- dynamo compiles under one process-wide lock, which the paused compile holds: while another
  thread is inside dynamo (another pack's torch.compile in the prompt, waiting for that lock),
  the compile goes on until it is done with the lock;
- whoever waits for the worker (``waiting``: a foreground compile, Diagnostics, a benchmark)
  needs it done: no pause then, and a job that has not started starts at once.
"""
from __future__ import annotations

import contextlib
import contextvars
import os
import sys
import threading
import time
from typing import Callable, Iterator, TypeVar

from ..report import log
from ..torch_support import hooks, openmp
from .compilers import Compilers

T = TypeVar("T")
CHECK_INTERVAL = 0.02  # s between the questions at the pause points
POLL = 0.05  # s between questions while paused or waiting to start
_IDLE_CHECK: list[Callable[[], bool]] = [lambda: True]
_STARTED: list[Callable[[], int]] = [lambda: 0]  # the host's count of prompts started so far
_waiters = 0
_lock = threading.Lock()
# frames of these modules may hold a lock the prompt's thread takes too: no pause inside them
_NO_PAUSE_IN = ("logging", "importlib._bootstrap", "importlib._bootstrap_external")
_unpaused = threading.local()  # ``depth``: inside ``unpaused`` on this thread


def set_idle_check(check: Callable[[], bool], started: Callable[[], int] | None = None) -> None:
    """The host's "nothing is running or queued" test (default: always idle) and, where it has
    one, its count of the prompts it has started so far: with it a job's record (``Beside``)
    sees a prompt that began and ended between two of the job's checks."""
    _IDLE_CHECK[0] = check
    _STARTED[0] = started or (lambda: 0)


def host_idle() -> bool:
    try:
        return bool(_IDLE_CHECK[0]())
    except Exception as exc:  # noqa: BLE001 - a broken check must not hold a compile forever
        log.warn_once("bg-idle-check", "could not tell whether the server is idle (%s: %s); the "
                      "background compile runs on", type(exc).__name__, exc)
        return True


def prompts_started() -> int:
    """The host's count of prompts started (0 where it has none or cannot say)."""
    try:
        return int(_STARTED[0]())
    except Exception as exc:  # noqa: BLE001 - a broken count only blinds the record
        log.warn_once("bg-prompt-count", "could not count the server's prompts (%s: %s); the "
                      "background compile's record of what it ran beside them misses some",
                      type(exc).__name__, exc)
        return 0


@contextlib.contextmanager
def waiting() -> Iterator[None]:
    """Someone waits for the worker inside the block: yielding jobs neither wait nor pause."""
    global _waiters
    with _lock:
        _waiters += 1
    try:
        yield
    finally:
        with _lock:
            _waiters -= 1


def _may_run() -> bool:
    return _waiters > 0 or host_idle()


def start_when_idle(label: str) -> float:
    """Block until a yielding job may start; the seconds it waited."""
    start = time.monotonic()
    if _may_run():
        return 0.0
    log.info("%s compiles in the background once the server is idle", label)
    while not _may_run():
        time.sleep(POLL)
    return time.monotonic() - start


class _Pacer:
    """Called at the pause points: pauses the job while the host is busy, and records what the
    job ran beside prompts (``Beside``)."""

    def __init__(self, job):
        self.job, self.next_check = job, 0.0
        self.beside = job.beside = Beside()

    def __call__(self, force: bool = False):
        now = time.monotonic()
        if now < self.next_check and not force:
            return
        self.next_check = now + CHECK_INTERVAL
        # a team this thread's last parallel op left (an input copy, a graph's first run) slows
        # every parallel op of a prompt while it lives, paused or not (``openmp``)
        openmp.release_thread_team()
        if _may_run():
            self.beside.free()
            return
        self.beside.busy = True
        if not _safe_to_pause(sys._getframe(1)):
            return
        self.beside.free()
        self.job.pauses += 1
        if self.job.pauses == 1:
            log.info("the background compile of %s pauses while prompts run, and goes on when "
                     "the server is idle", self.job.label)
        self.job.paused = True
        try:
            while not (_may_run() or _other_thread_in_dynamo()):
                time.sleep(POLL)
        finally:
            self.job.paused = False
        self.job.paused_s += time.monotonic() - now
        self.next_check = time.monotonic() + CHECK_INTERVAL
        self.beside.mark()


class Beside:
    """The CPU time a yielding job's thread used beside prompts: each stretch from one check
    (or the job's start, or the end of a pause) to the next, or to the pause, in which a check
    found the host busy or the host started a prompt (``set_idle_check``'s count: a prompt
    that began and ended between two checks, while the job waited for its compilers or ran a
    stretch without a pause point). Where the host counts its prompts this is an upper bound
    of what the job's thread took from them: a whole stretch counts, however little of it a
    prompt met. ``cpu_s`` in all, ``longest`` in one stretch, over ``stretches``. The C++
    compilers and checks the job starts run at the lowest priority and stop while the host is
    busy (``compilers``, ``lowered_step``); they are not counted."""

    def __init__(self):
        self.cpu_s = self.longest = 0.0
        self.stretches = 0
        self.mark()

    def mark(self, started: int | None = None) -> None:
        # ``busy``: a check since found it so; ``started``: the host's prompt count then
        self.since, self.busy = time.thread_time(), False
        self.started = prompts_started() if started is None else started

    def free(self) -> None:
        """At a check that found the host idle, or at a pause: the stretch since the mark."""
        started = prompts_started()
        if self.busy or started != self.started:
            used = time.thread_time() - self.since
            self.cpu_s += used
            self.longest = max(self.longest, used)
            self.stretches += 1
        self.mark(started)

    def end(self) -> None:
        """At the job's end: its last stretch, if a prompt runs now or began in it."""
        self.busy = self.busy or not host_idle()
        self.free()

    def text(self) -> str:
        if not self.stretches:
            return ""
        return (f"; beside prompts it used {self.cpu_s:.2f} s of CPU in {self.stretches} "
                f"stretch(es), at most {1000 * self.longest:.0f} ms in one")


def in_yielding_job() -> bool:
    """This thread runs a yielding job now (inside ``paced``)."""
    return getattr(_in_job, "pacer", None) is not None


def pause_point() -> None:
    """A pause point of the pack's own, between steps that cannot pause inside (each waits for
    a child process): a yielding job pauses here while the host is busy; elsewhere a no-op."""
    pacer = getattr(_in_job, "pacer", None)
    if pacer is not None:
        pacer(force=True)


def lowered_step(fn: Callable[[], T]) -> T:
    """A yielding job's step that waits for child processes (torch's CPU ISA check: a C++ build
    and a Python that loads it): after a ``pause_point``, ``fn`` runs in a helper thread at the
    lowest CPU priority, and the processes it starts inherit that priority from their first
    instruction. ``compilers.Compilers`` lowers (and stops) a compiler only once it sees it
    (up to ``RENICE_INTERVAL`` later, and its own children may start before that) and a
    loader child not at all: a check that a prompt met ran beside it at normal priority
    (prompts near the job's first pause, which a record placed in the probe, had steps stalled
    0.15-0.39 s). The job's thread only waits meanwhile; the helper has the job's context
    variables (torch's config)."""
    pause_point()
    context, out = contextvars.copy_context(), {}
    compilers = getattr(_in_job, "compilers", None)

    def helper():
        owners = compilers.owners if compilers is not None else set()  # its compilers are the job's
        owners.add(threading.get_native_id())
        _lower_this_thread()
        try:
            out["value"] = context.run(fn)
        except BaseException as exc:  # noqa: BLE001 - raised again on the job's thread
            out["error"] = exc
        finally:
            owners.discard(threading.get_native_id())
    thread = threading.Thread(target=helper, name="tcs-lowered-step", daemon=True)
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def _lower_this_thread() -> None:
    """The calling thread (Linux: one task) in the idle scheduling class, or at nice 19 where
    that class is refused; elsewhere unchanged (a thread's priority is not inherited there)."""
    idle = getattr(os, "SCHED_IDLE", None)
    if idle is None or not hasattr(os, "sched_setscheduler"):
        return
    try:
        os.sched_setscheduler(0, idle, os.sched_param(0))
    except OSError:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, 0, 19)


@contextlib.contextmanager
def unpaused() -> Iterator[None]:
    """No pause of this thread inside the block (it holds a lock the sampling thread takes)."""
    _unpaused.depth = getattr(_unpaused, "depth", 0) + 1
    try:
        yield
    finally:
        _unpaused.depth -= 1


def _safe_to_pause(frame) -> bool:
    if getattr(_unpaused, "depth", 0):
        return False
    while frame is not None:
        if frame.f_globals.get("__name__", "") in _NO_PAUSE_IN:
            return False
        frame = frame.f_back
    return not _other_thread_in_dynamo()


def _other_thread_in_dynamo() -> bool:
    """Another thread is inside dynamo now (compiling, or waiting for dynamo's lock, which a
    paused compile holds): it holds or waits for the compile lock (``hooks.compile_lock_users``,
    set up by ``paced``). Other threads' frames are not walked: on Python 3.11 a frame of a
    running thread taken from ``sys._current_frames`` may be freed under the walker (a crash)."""
    others = getattr(_in_job, "others", None)
    return True if others is None else others(threading.get_ident())


_in_job = threading.local()  # the job's ``others`` (``hooks.compile_lock_users``), ``pacer``, ``compilers``


@contextlib.contextmanager
def paced(job) -> Iterator[None]:
    """Inside the block the calling thread gives way to prompts (module docstring)."""
    pacer, me = _Pacer(job), threading.get_ident()
    with hooks.compile_lock_users() as others, hooks.pause_points(pacer):
        held = Compilers(lambda: _may_run() or others(me))
        held.owners.add(threading.get_native_id())
        held.thread.start()
        _in_job.others, _in_job.pacer, _in_job.compilers = others, pacer, held
        try:
            yield
        finally:
            _in_job.others = _in_job.pacer = _in_job.compilers = None
            held.stop.set()
            held.thread.join(5)  # (it continues the compilers it stopped)
            pacer.beside.end()
            job.compilers_held = held.held
