"""Give the calling thread's OpenMP thread team back to the OpenMP runtime.

A thread that runs one parallel op on CPU tensors (a copy of an input, a compiled graph's first
run) keeps a team of OpenMP threads for as long as it lives. With a second team alive, the GNU
OpenMP runtime (libgomp, which torch's Linux wheels bundle) has more threads than cores and
stops spinning between parallel loops: each parallel op of the sampling thread then waits to
wake its own team (measured on 2 cores: a 512x512 multiply 17 -> 60-100 us, tiny-WAN steps
1.5x, while a background compile that had run a graph was paused). OpenMP 5.0's
``omp_pause_resource_all`` ends the calling thread's team; its next parallel op starts a new one.

Only GNU's runtime, and only once the process has loaded it (found in its memory map, Linux):
there the call ends the calling thread's team alone. LLVM's and Intel's runtimes pause every
thread of the process on that call, the sampling thread's team too. Elsewhere nothing is
released, and a compile's thread still ends with its job (``background._in_own_thread``).
"""
from __future__ import annotations

import ctypes
import functools
import os
import sys
from typing import Callable

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: the team's threads end, the runtime stays set up
RUNTIME = "libgomp"  # GNU's (torch's Linux wheels bundle it: libgomp.so.1 or libgomp-<hash>.so.1)
MAPS = "/proc/self/maps"


def release_thread_team() -> bool:
    """End the calling thread's OpenMP team, if it has one; True when the runtime did (or had
    nothing to end). The thread's torch thread count stays as it was (dynamo's guards compare
    it with the calling thread's). Inside a parallel region the runtime refuses: False."""
    pause = _pause_all()
    return pause is not None and pause(OMP_PAUSE_SOFT) == 0


@functools.lru_cache(maxsize=None)
def _pause_all() -> Callable[[int], int] | None:
    """The loaded runtime's ``omp_pause_resource_all``, or None."""
    if not sys.platform.startswith("linux"):
        return None
    path = loaded_runtime()
    if path is None:
        return None
    try:
        pause = ctypes.CDLL(path).omp_pause_resource_all  # (loaded already: no new library)
    except (OSError, AttributeError):  # an OpenMP runtime older than 5.0
        return None
    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    return pause


def loaded_runtime(maps: str = MAPS) -> str | None:
    """The path of GNU's OpenMP runtime mapped into this process, or None."""
    try:
        with open(maps, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split(None, 5)
        if len(fields) < 6:
            continue
        path = fields[5].strip()
        name = os.path.basename(path)
        if name.startswith(RUNTIME) and ".so" in name and os.path.isfile(path):
            return path
    return None
