"""Torch 2.11.0 crashes (a segmentation fault) when a thread compiles after another thread that
compiled has ended; ``compile_threads`` probes that in a child process, and where it fails a
CPU model's background compile runs on the worker itself instead of a thread that ends with it.
The child is real here; the crash is FAKE (a child that segfaults on purpose), since this torch
does not crash."""
import sys
import threading

import pytest
import torch

from compile_core.run import background, engine
from compile_core.torch_support import compile_threads, probe_memo
from tcs_engine_helpers import eager, run, settings

FAKE_CRASH = "import ctypes, sys; sys.stderr.write(\"FAKE crash\\n\"); sys.stderr.flush(); ctypes.string_at(0)"  # FAKE: the child dies as torch 2.11.0's does


@pytest.fixture
def fresh_probe(monkeypatch):
    """The probe runs again, with no answer kept on disk (``probe_memo``)."""
    monkeypatch.setattr(probe_memo, "_root", [None])
    monkeypatch.setattr(probe_memo, "_answers", None)
    compile_threads.after_a_thread_ends.cache_clear()
    yield
    compile_threads.after_a_thread_ends.cache_clear()


CRASHES = torch.__version__.startswith("2.11.")  # seen: 2.11.0 crashes; 2.8, 2.9, 2.13, 2.14 do not


def test_the_probe_finds_what_this_torch_does(fresh_probe):
    """The child process really runs the sequence, on this torch."""
    assert (compile_threads._probe() == "") is not CRASHES
    assert compile_threads.after_a_thread_ends() is not CRASHES


def test_a_child_that_crashes_makes_the_pack_keep_to_threads_that_stay(fresh_probe, monkeypatch, pack_log):
    monkeypatch.setattr(compile_threads, "PROBE", FAKE_CRASH)
    assert compile_threads.after_a_thread_ends() is False
    assert compile_threads.after_a_thread_ends() is False  # (probed once)
    said = [m for m in pack_log.all_infos() if "compiles only on threads that stay" in m]
    assert len(said) == 1 and "exit code -11: FAKE crash" in said[0], pack_log.all_infos()


def test_a_child_that_cannot_start_counts_as_a_crash(fresh_probe, monkeypatch):
    monkeypatch.setattr(sys, "executable", "/nonexistent/python")
    why = compile_threads._probe()
    assert why.startswith("the thread-safety probe could not run (FileNotFoundError")


def test_on_windows_the_child_opens_no_console_window(fresh_probe, monkeypatch):
    """FAKE Windows (the platform name; the child is not started): ComfyUI Desktop runs without
    a console, where a child python would flash one up."""
    seen = {}

    def fake_run(cmd, **kw):
        seen.update(kw)
        raise OSError("FAKE: not started")
    monkeypatch.setattr(sys, "platform", "win32")
    monkeypatch.setattr(compile_threads.subprocess, "run", fake_run)
    assert compile_threads._probe().startswith("the thread-safety probe could not run (OSError")
    assert seen["creationflags"] == 0x08000000 and seen["stdin"] is compile_threads.subprocess.DEVNULL


def _compile_thread(cm, monkeypatch) -> list[str]:
    """The names of the threads the model's background compiles ran on."""
    names, original = [], cm.background.compile_captured
    monkeypatch.setattr(cm.background, "compile_captured",
                        lambda *a: (names.append(threading.current_thread().name), original(*a))[1])
    return names


@pytest.mark.parametrize("safe", [True, False])
def test_background_compiles_run_on_the_worker_itself_where_threads_must_not_end(
        safe, wan, wan_inputs, graph_count, monkeypatch):
    monkeypatch.setattr(compile_threads, "after_a_thread_ends", lambda: safe)  # FAKE of 2.11.0 when False
    model = wan.Model(n_blocks=2).eval()
    x, t = wan_inputs()
    cm = engine.prepare(model, settings(background_compile=True))
    names = _compile_thread(cm, monkeypatch)
    torch.testing.assert_close(run(cm, model, x, t), eager(model, x, t))  # eager; its compile queued
    assert background.wait_idle(timeout=300)
    g = graph_count()
    torch.testing.assert_close(run(cm, model, x, t), eager(model, x, t))
    assert cm.swapped_at == 2 and graph_count() == g  # the worker's graph took it
    assert names == ["tcs-background-compile" if not safe else f"tcs-compile {cm.description}"[:60]]
