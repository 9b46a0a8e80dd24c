"""A thread gives its OpenMP thread team back to the runtime (``openmp``)."""
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from compile_core.torch_support import openmp

REPO = Path(__file__).resolve().parents[2]

# In a child process, so that no other thread of the test run comes or goes while it counts.
CHILD = """
import json, os, threading, time, torch
from compile_core.torch_support import openmp

def tasks():
    return len(os.listdir("/proc/self/task"))

def settle(want):  # a team's threads end a moment after the runtime lets them go
    deadline = time.monotonic() + 5
    while tasks() != want and time.monotonic() < deadline:
        time.sleep(0.01)
    return tasks()

torch.set_num_threads(3)
base = tasks()
x = torch.arange(3 * 2 ** 20, dtype=torch.float32).mul(2)  # the main thread's own team
out = {"main_team": tasks() - base}
def helper():
    out["helper_alone"] = tasks()
    y = x.mul(2)  # a team of this thread
    out["helper_team"] = tasks() - out["helper_alone"]
    out["released"] = openmp.release_thread_team()
    out["after"] = settle(out["helper_alone"]) - out["helper_alone"]
    out["threads"] = torch.get_num_threads()
    z = x.mul(3)  # a new team, the same results
    out["right"] = bool(torch.equal(y, x * 2) and torch.equal(z, x * 3))
    out["again"] = tasks() - out["helper_alone"]
t = threading.Thread(target=helper)
t.start()
t.join()
print(json.dumps(out))
"""


@pytest.mark.skipif(openmp._pause_all() is None, reason="GNU OpenMP (5.0 or later) is not loaded by torch here")
def test_a_threads_team_ends_when_given_back_and_other_teams_stay():
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(CHILD)], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["main_team"] == 2 and out["helper_team"] == 2, out  # each thread: a team of its own
    assert out["released"] is True and out["after"] == 0, out  # the helper's team ended
    assert out["threads"] == 3, out  # its thread count is kept (dynamo's guards compare it)
    assert out["right"] and out["again"] == 2, out  # the next parallel op starts a new team


def test_the_runtime_is_the_one_loaded_into_the_process(tmp_path):
    runtime = tmp_path / "libgomp-a34b3233.so.1"
    runtime.write_bytes(b"")
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/libc.so.6\n"
        "7f01-7f02 rw-p 00000000 00:00 0 \n"
        f"7f02-7f03 r-xp 00000000 08:01 2 {runtime}\n")
    assert openmp.loaded_runtime(str(maps)) == str(runtime)
    llvm = tmp_path / "libomp.so"  # LLVM's runtime pauses every thread of the process: not used
    llvm.write_bytes(b"")
    maps.write_text(f"7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/libc.so.6\n7f01-7f02 r-xp 00000000 08:01 3 {llvm}\n")
    assert openmp.loaded_runtime(str(maps)) is None
    assert openmp.loaded_runtime(str(tmp_path / "missing")) is None


def test_on_fake_windows_nothing_is_released(monkeypatch):
    """FAKE Windows (sys.platform only): no runtime is looked up, and nothing is loaded."""
    monkeypatch.setattr(sys, "platform", "win32")
    monkeypatch.setattr(openmp, "loaded_runtime", lambda *a: pytest.fail("looked up a runtime"))
    openmp._pause_all.cache_clear()
    try:
        assert openmp.release_thread_team() is False
    finally:
        monkeypatch.undo()
        openmp._pause_all.cache_clear()
    assert torch.get_num_threads() >= 1
