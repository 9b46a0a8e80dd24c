"""Whether this torch may compile on a thread after another thread that compiled has ended.

Torch 2.11.0 may not: once a thread that compiled has ended, a compile on any other thread
crashes the whole process (a segmentation fault in ``FakeTensorMode.__enter__``; found with
ComfyUI 0.33 on torch 2.11.0, Python 3.11 and 3.12; not on torch 2.8, 2.13 or 2.14). A CPU
model's background compile runs in a thread that ends with it (``background``) only where
this probe says that is safe.

The probe is that sequence in a child process (a crash there costs nothing), about 4 s, run
on the background worker at the first CPU model's compile, never at start-up; its "yes" is
kept per torch build (``probe_memo``). A child that cannot run counts as a crash: the pack
then keeps to the worker thread, which is always safe.
"""
from __future__ import annotations

import os
import subprocess
import sys

import torch

from ..report import log
from . import probe_memo

PROBE = """
import threading, torch
def first():
    torch.compile(lambda x: x * 2, backend="eager")(torch.ones(2))
def second():
    torch.compile(lambda x: x.sin(), backend="eager")(torch.ones(2, 2))
for fn in (first, second):
    t = threading.Thread(target=fn)
    t.start()
    t.join()
print("compiled on a second thread")
"""
TIMEOUT = 300  # s: a first import of torch from a slow disk (Windows, a network share)
NO_WINDOW = 0x08000000  # Windows' CREATE_NO_WINDOW: no console flashes up under ComfyUI Desktop


@probe_memo.remembered
def after_a_thread_ends() -> bool:
    """True where a compile on one thread after another compiling thread has ended is safe."""
    why = _probe()
    if why:
        log.info_once(f"compile-threads:{why}", "torch %s: %s; so the pack compiles only on threads that stay "
                      "(a CPU model's background compile runs on the background worker itself)", torch.__version__, why)
    return not why


def _probe() -> str:
    """'' when the child process compiled on its second thread; else what happened."""
    try:
        proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                              timeout=TIMEOUT, env=dict(os.environ), stdin=subprocess.DEVNULL,
                              creationflags=NO_WINDOW if sys.platform == "win32" else 0)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"the thread-safety probe could not run ({type(exc).__name__}: {exc})"
    if proc.returncode == 0 and "compiled on a second thread" in proc.stdout:
        return ""
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1][:200]
    return (f"a compile on a second thread, after the first compiling thread ended, failed in a "
            f"child process (exit code {proc.returncode}: {tail})")
