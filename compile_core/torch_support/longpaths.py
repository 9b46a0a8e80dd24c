"""Windows' 260-character path limit, and a cache root short enough to stay under it.

Torch and Triton nest their cache files deep below the folder they are given. The longest
is Triton's: each file is first written to ``<key>/tmp.pid_<pid>_<uuid4>/`` and then moved to
``<key>/`` (``triton/runtime/cache.py``), and its name carries the kernel's name, e.g.
``__grp__triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0.json``. Windows refuses a path
of 260 characters or more unless long paths are enabled (registry value
``HKLM\\SYSTEM\\CurrentControlSet\\Control\\FileSystem\\LongPathsEnabled``), and Triton then
fails with ``FileNotFoundError`` or ``[WinError 206]``. Other systems have no such limit.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Callable

from ..report import log

MAX_PATH = 260               # characters, the terminating NUL included
LIMIT = MAX_PATH - 1         # the longest path Windows accepts without long paths
KEY = 52                     # torch's and Triton's cache keys: base32 of a SHA-256
KERNEL_NAME = 64             # a Triton kernel name; inductor names a fused kernel after up to
# 10 aten ops, so longer ones exist: those need long paths whatever the root (torch's own
# temp dir included)
PID = 8                      # digits of a process id
UUID = 36
SHORT_DIR = "tcs"            # the pack's own short root: %LOCALAPPDATA%\tcs
LONG_PATHS_KEY = r"SYSTEM\CurrentControlSet\Control\FileSystem"


def below_triton_dir() -> int:
    """Characters Triton adds below ``TRITON_CACHE_DIR`` for its deepest (temporary) file."""
    tmp = len("tmp.pid_") + PID + 1 + UUID
    name = len("__grp__") + KERNEL_NAME + len(".json")
    return 1 + KEY + 1 + tmp + 1 + name


def below_inductor_dir(triton_subdir: str) -> int:
    """Characters torch adds below ``TORCHINDUCTOR_CACHE_DIR`` (``aotautograd/<key>/<key>``,
    ``fxgraph/<2>/<key>/<key>``, ``<2>/<key>.main.cpp``), or Triton below ``triton_subdir``
    inside it, whichever is deeper."""
    fxgraph = len("/fxgraph/ab/") + KEY + 1 + KEY
    aotautograd = len("/aotautograd/") + KEY + 1 + KEY
    return max(fxgraph, aotautograd, 1 + len(triton_subdir) + below_triton_dir())


def on_windows() -> bool:
    return sys.platform == "win32"


def long_paths_enabled() -> bool:
    """Windows' LongPathsEnabled registry value (False when it cannot be read)."""
    try:
        import winreg
        with winreg.OpenKey(winreg.HKEY_LOCAL_MACHINE, LONG_PATHS_KEY) as key:
            value, _kind = winreg.QueryValueEx(key, "LongPathsEnabled")
        return bool(value)
    except (ImportError, OSError, TypeError, ValueError):
        return False


def path_limit() -> int | None:
    """The longest path this system accepts, or None when there is no limit to plan for."""
    if on_windows() and not long_paths_enabled():
        return LIMIT
    return None


def fits(length: int) -> bool:
    limit = path_limit()
    return limit is None or length <= limit


def short_root() -> Path | None:
    """``%LOCALAPPDATA%\\tcs``: per user, outside ComfyUI (no upload writes there)."""
    base = os.environ.get("LOCALAPPDATA", "").strip()
    return Path(base) / SHORT_DIR if base and os.path.isabs(base) else None


def choose_root(root: Path, deepest: Callable[[Path], int], movable: bool) -> Path | None:
    """``root`` when ``deepest(root)`` (the longest path written under it) fits; otherwise,
    when ``movable``, the pack's short root if that fits; otherwise None. Said once."""
    if fits(deepest(root)):
        return root
    short = short_root() if movable else None
    if short is not None and fits(deepest(short)):
        log.info_once(f"longpaths-moved:{root}", "persistent cache in %s instead of %s: torch's "
                      "cache files would nest to %d characters there, past Windows' %d-character "
                      "limit (long paths are not enabled)", short, root, deepest(root), MAX_PATH)
        return short
    log.warn_once(f"longpaths-off:{root}", "persistent cache off: its files would nest to %d "
                  "characters in %s, past Windows' %d-character limit. Compiling still works, "
                  "only without the disk cache. Fix: enable long paths (LongPathsEnabled=1 in "
                  "HKLM\\%s, then reboot)%s", deepest(root), root, MAX_PATH, LONG_PATHS_KEY,
                  "" if movable else ", or set TORCH_COMPILE_SPEED_CACHE_DIR to a shorter folder")
    return None
