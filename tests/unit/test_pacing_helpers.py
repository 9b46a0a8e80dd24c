"""What a background compile that yields to prompts relies on (``compile_core/run/pacing.py``):

- ``_Compilers``: the C++ compilers it starts run at the lowest priority. The compiler is a
  FAKE: a ``sleep`` child of this process, its name added to ``COMPILERS``.
- ``hooks.compile_lock_users``: which threads hold or wait for dynamo's compile lock, counted
  by the lock itself (no other thread's frames are walked)."""
from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch._dynamo.convert_frame as convert_frame

from compile_core.run import pacing
from compile_core.torch_support import hooks, scoped

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


@pytest.fixture
def fake_compiler(monkeypatch):
    """``sleep`` counts as a compiler (FAKE)."""
    if psutil is None or shutil.which("sleep") is None:
        pytest.skip("no psutil, or no sleep program to stand in for a compiler")
    monkeypatch.setattr(pacing, "COMPILERS", pacing.COMPILERS | {"sleep"})


def test_a_compiler_child_gets_the_lowest_priority_and_other_children_keep_theirs(fake_compiler):
    compilers = pacing._Compilers()
    compilers.thread.start()
    fake = subprocess.Popen(["sleep", "60"])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert _until(lambda: psutil.Process(fake.pid).nice() == 19)
        time.sleep(5 * pacing.RENICE_INTERVAL)
        assert psutil.Process(other.pid).nice() == psutil.Process().nice()
    finally:
        compilers.stop.set()
        compilers.thread.join(5)
        for proc in (fake, other):
            proc.kill()
            proc.wait()
