"""What a background compile that yields to prompts relies on (``compile_core/run/pacing.py``):

- ``compilers``: the C++ compilers it starts run at the lowest priority, and the job's own stop
  while the host is busy. The compiler is a FAKE: a ``sleep`` child of this process, its name
  added to ``COMPILERS``.
- ``hooks.compile_lock_users``: which threads hold or wait for dynamo's compile lock, counted
  by the lock itself (no other thread's frames are walked).
- ``hooks.pause_points``: every point is met in a real inductor compile on the CPU, on the
  compiling thread only, and the originals are back afterwards."""
from __future__ import annotations

import inspect
import io
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch._dynamo.convert_frame as convert_frame

from compile_core.run import compilers
from compile_core.torch_support import aot, hooks, scoped

try:
    import psutil  # (ComfyUI's own dependency, and the tests')
except ImportError:
    psutil = None


def test_threads_that_hold_or_wait_for_dynamos_lock_are_counted_and_the_lock_is_put_back():
    original, me = convert_frame.compile_lock, threading.get_ident()
    holding, release = threading.Event(), threading.Event()

    def hold():
        with convert_frame.compile_lock:  # (looked up as dynamo does, at each use)
            holding.set()
            release.wait(10)
    # (torch 2.8's torch.compile() sets TORCHINDUCTOR_CACHE_DIR: the scope puts it back after)
    with scoped.scoped_state(), hooks.compile_lock_users() as others:
        assert not others(me)
        with convert_frame.compile_lock:  # this thread itself does not count
            assert not others(me)
        holder = threading.Thread(target=hold)
        holder.start()
        assert holding.wait(10) and others(me) and not others(holder.ident)
        fresh = eval("lambda x: x.cos() + 1")  # (a code object no other test compiled)
        waiter = threading.Thread(target=lambda: torch.compile(fresh, backend="eager")(torch.ones(2)))
        waiter.start()  # waits for the lock the holder has
        assert _until(lambda: waiter.ident in convert_frame.compile_lock.inside)
        release.set()
        holder.join(10)
        waiter.join(60)
        assert not waiter.is_alive() and not others(me)
    assert convert_frame.compile_lock is original


def _until(cond, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return False


def _lowest(pid: int) -> bool:
    """At the lowest priority: the idle scheduling class where there is one (Linux), else nice 19."""
    if hasattr(os, "SCHED_IDLE") and hasattr(os, "sched_getscheduler"):
        return os.sched_getscheduler(pid) == os.SCHED_IDLE
    return psutil.Process(pid).nice() == 19


@pytest.fixture
def fake_compiler(monkeypatch):
    """``sleep`` counts as a compiler (FAKE)."""
    if psutil is None or shutil.which("sleep") is None:
        pytest.skip("no psutil, or no sleep program to stand in for a compiler")
    monkeypatch.setattr(compilers, "COMPILERS", compilers.COMPILERS | {"sleep"})


def test_a_compiler_child_gets_the_lowest_priority_and_other_children_keep_theirs(fake_compiler):
    held = compilers.Compilers(lambda: True)
    held.thread.start()
    fake = subprocess.Popen(["sleep", "60"])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert _until(lambda: _lowest(fake.pid))
        time.sleep(5 * compilers.RENICE_INTERVAL)
        assert psutil.Process(other.pid).nice() == psutil.Process().nice() and not _lowest(other.pid)
    finally:
        held.stop.set()
        held.thread.join(5)
        for proc in (fake, other):
            proc.kill()
            proc.wait()


@pytest.mark.skipif(psutil is None or not sys.platform.startswith("linux") or shutil.which("sh") is None,
                    reason="Linux's /proc children files, psutil and a shell")
def test_the_processes_descendants_come_from_proc_as_psutil_lists_them():
    """A child started by another thread (as a compile's) and a grandchild are found from
    /proc's per-thread ``children`` files, the same set psutil's scan of every process gives;
    where those files are missing, psutil's list is used."""
    started = []
    t = threading.Thread(target=lambda: started.append(subprocess.Popen(["sh", "-c", "sleep 60 & wait"])))
    t.start()
    t.join()
    shell = started[0]
    try:
        me = psutil.Process()
        # (wait for the shell's own child: other tests may have left children of this process)
        assert _until(lambda: psutil.Process(shell.pid).children())
        grandchild = [c.pid for c in psutil.Process(shell.pid).children()]
        tree = compilers._linux_tree(me.pid)
        assert tree is not None and {shell.pid, *grandchild} <= set(compilers._below(me.pid, tree))
        # the same set as psutil's scan (asked again while another test's leftover child exits)
        assert _until(lambda: set(compilers._below(me.pid, compilers._linux_tree(me.pid)))
                      == {c.pid for c in me.children(recursive=True)}
                      == {p.pid for p in compilers._descendants(me, compilers._linux_tree(me.pid), psutil)})

        class FakeMe:  # FAKE: psutil's view of a process on a kernel without the children files
            pid = me.pid

            def children(self, recursive=False):
                return ["psutil's list"] if recursive else []
        assert compilers._descendants(FakeMe(), None, psutil) == ["psutil's list"]
    finally:
        for c in psutil.Process(shell.pid).children(recursive=True):
            c.kill()
        shell.kill()
        shell.wait()


def _stopped(proc) -> bool:
    return psutil.Process(proc.pid).status() == psutil.STATUS_STOPPED


@pytest.mark.skipif(psutil is None or not sys.platform.startswith("linux") or shutil.which("sh") is None,
                    reason="Linux's /proc children files, psutil and a shell")
def test_the_jobs_own_compilers_stop_while_the_host_is_busy_and_no_other_compiler_does(fake_compiler):
    """While ``may_run`` says no (the host busy, no other thread in dynamo), the compilers that
    a job's thread started, and those of inductor's compile-worker pool, are stopped, and go
    on once it says yes and when the job ends; a compiler another thread started (a prompt may
    wait for it) never stops."""
    busy, release, started = [True], threading.Event(), {}
    held = compilers.Compilers(lambda: not busy[0])

    def job_thread():  # (it lives on: a thread's children are looked up by its id)
        held.owners.add(threading.get_native_id())
        started["job"] = subprocess.Popen(["sleep", "60"])
        release.wait(30)
    job = threading.Thread(target=job_thread)
    job.start()
    started["pool"] = subprocess.Popen(["sh", "-c", "sleep 60 & wait", f"torch_inductor_{compilers.POOL_MARK}"])
    started["prompt"] = subprocess.Popen(["sleep", "60"])  # this thread's: not the job's
    try:
        assert _until(lambda: "job" in started and psutil.Process(started["pool"].pid).children())
        pool_compiler = psutil.Process(started["pool"].pid).children()[0]
        held.thread.start()
        assert _until(lambda: _stopped(started["job"]) and _stopped(pool_compiler))
        assert not _stopped(started["prompt"]) and not _stopped(started["pool"])  # (a shell: no compiler)
        busy[0] = False
        assert _until(lambda: not _stopped(started["job"]) and not _stopped(pool_compiler))
        busy[0] = True
        assert _until(lambda: _stopped(started["job"]))
        time.sleep(3 * compilers.RENICE_INTERVAL)
        assert not _stopped(started["prompt"]) and held.held == 2
        held.stop.set()  # the job ends while the host is busy: its compilers go on
        held.thread.join(5)
        assert not _stopped(started["job"]) and not _stopped(pool_compiler) and not compilers._STOPPED
    finally:
        held.stop.set()
        release.set()
        job.join(10)
        compilers.resume_all()
        for proc in [*psutil.Process(started["pool"].pid).children(), *started.values()]:
            proc.kill()
        for proc in started.values():
            proc.wait()


@pytest.mark.skipif(psutil is None or not sys.platform.startswith("linux"),
                    reason="Linux's /proc children files, psutil")
def test_the_jobs_compilers_stay_stopped_at_most_the_hold_limit_in_one_busy_stretch(fake_compiler, monkeypatch):
    """A prompt could wait for a pool compiler that is not the job's (inductor called without
    dynamo): after ``HOLD_LIMIT`` of one busy stretch the compilers go on (at the lowest
    priority) until the host has been idle; the next busy stretch stops them again."""
    monkeypatch.setattr(compilers, "HOLD_LIMIT", 0.5)
    busy, release, started = [True], threading.Event(), {}
    held = compilers.Compilers(lambda: not busy[0])

    def job_thread():
        held.owners.add(threading.get_native_id())
        started["job"] = subprocess.Popen(["sleep", "60"])
        release.wait(30)
    job = threading.Thread(target=job_thread)
    job.start()
    try:
        assert _until(lambda: "job" in started)
        held.thread.start()
        assert _until(lambda: _stopped(started["job"]))
        stopped_at = time.monotonic()
        assert _until(lambda: not _stopped(started["job"]))  # still busy: the limit
        assert time.monotonic() - stopped_at >= 0.4 and _lowest(started["job"].pid)
        time.sleep(5 * compilers.RENICE_INTERVAL)
        assert not _stopped(started["job"]) and held.held == 1
        busy[0] = False  # idle once, then busy again: stopped again
        time.sleep(3 * compilers.RENICE_INTERVAL)
        busy[0] = True
        assert _until(lambda: _stopped(started["job"])) and held.held == 2
    finally:
        held.stop.set()
        held.thread.join(5)
        release.set()
        job.join(10)
        compilers.resume_all()
        if "job" in started:
            started["job"].kill()
            started["job"].wait()


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="no idle scheduling class here")
def test_a_compiler_gets_nice_19_where_the_idle_class_is_refused(fake_compiler, monkeypatch):
    def refused(pid, policy, param):
        raise PermissionError(1, "Operation not permitted")
    monkeypatch.setattr(os, "sched_setscheduler", refused)
    fake = subprocess.Popen(["sleep", "60"])
    try:
        assert _until(lambda: psutil.Process(fake.pid).name() == "sleep")
        compilers.Compilers._lower(psutil.Process(fake.pid), set(), psutil)
        assert psutil.Process(fake.pid).nice() == 19
        assert os.sched_getscheduler(fake.pid) != os.SCHED_IDLE
    finally:
        fake.kill()
        fake.wait()


BIG = {f"entry{i}": i for i in range(3000)}  # a global dict dynamo wraps entry by entry
# Points torch 2.8 lacks (it has no saved regions either)
LATER_POINTS = {("HashableTracker", "__init__"), ("CheckFunctionManager", "serialize_guards"),
                (None, "load_guards_state"), (None, "load_guard_manager")}


def _pausable(x):
    y = (x.t() + 1.0).softmax(-1)  # a transposed load: the C++ codegen's stride analysis
    return y @ y + len(BIG)


def _saveable(x):
    return x.sin() * 2


def test_every_pause_point_is_met_in_a_cpu_compile_on_the_compiling_thread_only(tmp_path):
    """A real inductor compile (no FX-graph cache, so it generates and builds C++), and the
    saved regions' ``aot_compile`` of it (its guards pickled and loaded back), call every point
    of ``_PAUSE_POINTS``; a compile on another thread inside the block calls none, and every
    original is back after the block. The dict of 3000 entries: one check per entry and key.
    Torches without saved regions (2.8) lack the points only those meet."""
    met, other_thread = [], []

    def check():
        met.append(_name(sys._getframe(1).f_locals["original"]))
    targets = hooks._pause_targets()
    have = {(owner.__name__ if isinstance(owner, type) else None, name) for owner, name, _ in targets}
    missing = {(cls, name) for _, cls, name in hooks._PAUSE_POINTS} - have
    assert missing <= LATER_POINTS and (not missing or aot.aot_compile_knobs() != {}), missing
    with scoped.scoped_state(inductor={"fx_graph_cache": False}, env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}):
        with hooks.pause_points(check):
            torch._dynamo.reset()
            torch.compile(_pausable)(torch.randn(16, 16))
            if aot.load_compiled_function():  # a saved region: captured, saved, loaded back
                with aot.aot_capture():
                    fn = torch.compile(_saveable, fullgraph=True).aot_compile(((torch.randn(4),), {}))
                torch.compiler.load_compiled_function(io.BytesIO(type(fn).serialize(fn).serialized_data))
            before = len(met)
            thread = threading.Thread(target=lambda: other_thread.append(
                torch.compile(lambda x: x.cos() + 2)(torch.randn(8))))
            thread.start()
            thread.join(120)
        torch._dynamo.reset()
    assert other_thread and len(met) == before  # the other thread's compile was not touched
    assert {_name(original) for _, _, original in targets} <= set(met), set(met)
    assert all(vars(owner)[name] is original for owner, name, original in targets)
    assert met.count("LazyCache.__init__") >= len(BIG)
    if ("HashableTracker", "__init__") in have:
        assert met.count("HashableTracker.__init__") >= len(BIG)
    if aot.load_compiled_function():  # each step after a frame's guards are built pauses
        assert _in_order(met, ["Guard.create", "CheckFunctionManager.compile_check_fn", "profile_guard_manager",
                               "CheckFunctionManager.serialize_guards", "load_guards_state",
                               "load_guard_manager", "Guard.create"])


def _name(fn) -> str:
    """``Class.method`` of a Python function, the plain name of a builtin."""
    return fn.__qualname__ if inspect.isfunction(fn) else fn.__name__


def _in_order(seq: list, wanted: list) -> bool:
    it = iter(seq)
    return all(any(x == w for x in it) for w in wanted)
