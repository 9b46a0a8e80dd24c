"""The C++ compilers a yielding background compile starts: lowest priority, and stopped while
prompts run.

Inductor's C++ builds (through its compile-worker pool) and torch's CPU ISA checks run g++ and
its parts (``COMPILERS``). While a job runs, a thread (``Compilers``) gives every compiler of
the process the lowest CPU priority. That was not enough on a 2-core machine: the compilers
took a core whenever the prompt left one free (its single-threaded parts), and a record of each
run (ComfyUI 0.33, 20-step tiny WAN) found the runs whose first step stalled (121-242 ms
against 40-80 ms) were those in which the compilers had used 40-109 ms of CPU during that step.
So while the host is busy the job's own compilers are stopped (SIGSTOP), and go on once it is
idle. Only compilers that are the job's are stopped, as a prompt may wait for any other:
- the children of the job's threads (its own and ``pacing.lowered_step``'s helper), and theirs;
- those of inductor's compile-worker pool (``POOL_MARK`` in its command line), which only the
  compile that holds dynamo's lock uses: never while another thread is inside dynamo (the
  caller's ``may_run`` says so), and the job holds that lock while it compiles. A thread that
  calls inductor without dynamo could still share the pool, and a prompt would then wait for
  a compiler of its own that is stopped: so they stay stopped at most ``HOLD_LIMIT`` in one
  busy stretch of the host, and after that run at the lowest priority until it is idle.
This needs Linux's per-thread ``children`` files in /proc; elsewhere compilers only get the
lowest priority. Every compiler stopped is continued when the job ends, or the process exits.
"""
from __future__ import annotations

import atexit
import os
import threading
import time
from typing import Callable

from ..report import log

# the processes a compile starts (inductor's C++ builds, Triton's ptxas): lowered while a job runs
COMPILERS = frozenset({"cc1plus", "cc1", "g++", "gcc", "c++", "cc", "clang", "clang++", "as", "ld",
                       "collect2", "ptxas", "nvcc", "cl.exe", "link.exe"})
RENICE_INTERVAL = 0.05  # s: a compiler runs at most this long at its normal priority, or beside a prompt
HOLD_LIMIT = 30.0  # s: the longest the compilers stay stopped while the host is busy
POOL_MARK = "compile_worker"  # in the command line of inductor's compile-worker pool (its sidecar)
_STOPPED: set = set()  # the compilers stopped now, by any job (continued at exit)
_stopped_lock = threading.Lock()


class Compilers:
    """While a job runs, a thread gives the process's compiler children the lowest priority,
    and stops the job's own compilers while ``may_run()`` is False (the host busy, and no
    other thread inside dynamo). ``owners``: the native ids of the job's threads."""

    def __init__(self, may_run: Callable[[], bool]):
        self.may_run, self.owners = may_run, set()
        self.held, self.holding = 0, False  # ``held``: how many times it stopped them
        self.since, self.spent = 0.0, False  # when they were stopped; ``HOLD_LIMIT`` reached
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="tcs-compile-priority", daemon=True)
        self._pool: dict = {}  # process -> is inductor's pool sidecar

    def _loop(self) -> None:
        try:
            import psutil  # (ComfyUI's own dependency)
        except ImportError:
            return
        me, seen = psutil.Process(), set()
        try:
            while not self.stop.wait(RENICE_INTERVAL):
                tree = _linux_tree(me.pid)
                try:
                    children = _descendants(me, tree, psutil)
                except psutil.Error:
                    continue
                for child in children:
                    self._lower(child, seen, psutil)
                if self.may_run():
                    self._release()
                    self.spent = False
                elif self.holding and time.monotonic() - self.since > HOLD_LIMIT:
                    self._release()
                    self.spent = True
                    log.info("the background compile's C++ compilers go on at the lowest priority: "
                             "the server has been busy for %.0f s", HOLD_LIMIT)
                elif tree is not None and not self.spent:
                    owned = self._owned(me.pid, tree, psutil)
                    self._hold([p for p in children if p in seen and p.pid in owned], psutil)
        finally:
            resume_all()

    def _hold(self, compilers: list, psutil) -> None:
        """Stop ``compilers`` (the job's, while the host is busy)."""
        for proc in compilers:
            if proc in _STOPPED:
                continue
            try:
                proc.suspend()
            except psutil.Error:
                continue
            with _stopped_lock:
                _STOPPED.add(proc)
            if not self.holding:
                self.held, self.holding, self.since = self.held + 1, True, time.monotonic()

    def _release(self) -> None:
        if self.holding:
            resume_all()
            self.holding = False

    def _owned(self, root: int, tree: dict, psutil) -> set[int]:
        """The job's processes: its threads' children, inductor's pool, and their descendants."""
        top = tree.get(root, {})
        tops = [pid for tid in tuple(self.owners) for pid in top.get(str(tid), ())]
        tops += [pid for kids in top.values() for pid in kids if self._is_pool(pid, psutil)]
        return {*tops, *(pid for each in tops for pid in _below(each, tree))}

    def _is_pool(self, pid: int, psutil) -> bool:
        try:
            proc = psutil.Process(pid)
            if proc not in self._pool:
                self._pool[proc] = any(POOL_MARK in part for part in proc.cmdline())
            return self._pool[proc]
        except psutil.Error:
            return False

    @staticmethod
    def _lower(child, seen: set, psutil) -> None:
        """Lowest priority for ``child`` if it is a compiler. ``seen``: the compilers lowered (a
        psutil.Process is equal by pid and start time, so a reused pid is another process);
        others are asked again, as a child just forked has its parent's name until it runs
        the compiler."""
        if child in seen:
            return
        try:
            if child.name() in COMPILERS:
                _lowest_priority(child, psutil)
                seen.add(child)
        except (psutil.Error, OSError):
            pass


def held_text(times: int) -> str:
    """The finished compile's log line on its stopped compilers ("" where they never were)."""
    return f"; its C++ compilers stopped {times} time(s) for prompts" if times else ""


def resume_all() -> None:
    """Continue every compiler a job stopped."""
    with _stopped_lock:
        stopped = list(_STOPPED)
        _STOPPED.clear()
    for proc in stopped:
        try:
            proc.resume()
        except Exception:  # noqa: BLE001 - (it ended meanwhile)
            pass


atexit.register(resume_all)


def _descendants(me, tree: dict | None, psutil) -> list:
    """``me``'s child processes, theirs, and so on. On Linux from ``tree`` (each thread's
    ``children`` file in /proc: a few small reads, under 0.1 ms), not psutil's scan of every
    process on the machine: 8 ms with 460 processes, under the interpreter lock, every
    ``RENICE_INTERVAL``. Where the kernel has no such file (``tree`` None), psutil's."""
    return me.children(recursive=True) if tree is None else _processes(_below(me.pid, tree), psutil)


def _processes(pids: list[int], psutil) -> list:
    found = []
    for pid in pids:
        try:
            found.append(psutil.Process(pid))
        except psutil.Error:  # (it ended meanwhile)
            pass
    return found


def _linux_tree(root: int) -> dict[int, dict[str, list[int]]] | None:
    """{process: {thread id: the children it started}} for ``root`` and its descendants, from
    /proc; None where ``root`` has no per-thread ``children`` file."""
    if not os.path.isfile(f"/proc/{root}/task/{root}/children"):
        return None
    tree, todo = {}, [root]
    while todo:
        pid = todo.pop()
        if pid not in tree:
            tree[pid] = _thread_children(pid)
            todo += [kid for kids in tree[pid].values() for kid in kids]
    return tree


def _thread_children(pid: int) -> dict[str, list[int]]:
    """{thread id: the children it started} of process ``pid`` ({} once it has ended)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return {}
    out = {}
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", encoding="ascii") as f:
                out[tid] = [int(k) for k in f.read().split()]
        except (OSError, ValueError):  # (it ended meanwhile)
            continue
    return out


def _below(pid: int, tree: dict) -> list[int]:
    """The descendants of ``pid`` in ``tree``."""
    found, todo = [], [pid]
    while todo:
        for kids in tree.get(todo.pop(), {}).values():
            found += kids
            todo += kids
    return found


def _lowest_priority(child, psutil) -> None:
    """Linux: the idle scheduling class, which runs the process only on a core nothing else
    wants (its C++ compilers inherit it). At nice 19 a g++ beside a prompt still took its
    share of each core: eager steps of a tiny WAN beside a g++ loop were up to 2x slower
    (198 ms against 87-133 ms with no compiler), at the idle class 93-102 ms at worst. Where
    that class is refused or missing: nice 19; on Windows the idle priority class."""
    if os.name == "nt":
        child.nice(psutil.IDLE_PRIORITY_CLASS)
        return
    idle = getattr(os, "SCHED_IDLE", None)
    if idle is not None and hasattr(os, "sched_setscheduler") and child.is_running():
        try:
            os.sched_setscheduler(child.pid, idle, os.sched_param(0))
            return
        except OSError:
            pass
    child.nice(19)
