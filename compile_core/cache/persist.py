"""Persistent warm start: compile caches kept per fingerprint, so a restarted server reuses them.

Each fingerprint gets ``<root>/<its first 16 hex digits>/`` holding the inductor cache dir
that torch uses during our runs: FX graph + AOTAutograd caches, the compiled C++ ``.so`` files
on CPU, and on GPU the Triton kernels and autotune results (``TRITON_CACHE_DIR`` is set inside
it, so torch never picks a process-wide one). Torch's mega-cache bytes
(``save_cache_artifacts``) are not written separately: they serialize these same entries,
and torch records them for the whole process rather than per model. The directory size
is bounded: least recently used fingerprints are evicted first. A ``meta.json`` written
after a successful first compile marks the entry as complete.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

from ..report import log
from ..torch_support import longpaths

ROOT_ENV = "TORCH_COMPILE_SPEED_CACHE_DIR"       # operator: where the persistent cache lives
MAX_GB_ENV = "TORCH_COMPILE_SPEED_CACHE_MAX_GB"  # operator: size bound (default below)
DEFAULT_MAX_GB = 20.0
META = "meta.json"
# Short path components: Windows without long paths refuses paths of 260 characters or more,
# and torch nests its files about 190 characters below the inductor dir (see longpaths).
# 16 hex digits keep entries apart (meta.json holds the whole fingerprint and is checked).
ENTRY_CHARS = 16
INDUCTOR_SUBDIR = "inductor"
TRITON_SUBDIR = "t"
WRITING_GRACE_S = 60.0  # a .so younger than this may still be being written by another process


def write_atomic(path: Path, data: bytes | str) -> None:
    """Write ``path`` whole or not at all: a process-unique temp file beside it, then a rename,
    so concurrent writers and readers (processes sharing the cache) never see half a file.
    The temp name ends in ``.tmp``, which the fleet archive skips."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        if isinstance(data, str):
            tmp.write_text(data)
        else:
            tmp.write_bytes(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # a full disk or a file in use leaves no temp file
            tmp.unlink(missing_ok=True)
        raise


def io_failed(root: Path, what: str, exc: OSError) -> None:
    """A disk problem costs the cache, never the run: one warning per cache root and process."""
    log.warn_once(f"persist-io:{Path(root)}", "persistent cache in %s: could not %s (%s: %s); runs "
                  "go on, compiling without it or not saving to it", root, what,
                  type(exc).__name__, exc)


def max_bytes_from_env() -> int:
    """The operator's size bound in bytes; a value that is not a size in GB falls back to the
    default, with one warning naming it."""
    raw = os.environ.get(MAX_GB_ENV, "").strip()
    if raw:
        try:
            gb = float(raw)
            if gb >= 0:  # False for nan; inf raises OverflowError below
                return int(gb * 1024 ** 3)
        except (ValueError, OverflowError):
            pass
        log.warn_once(f"persist-max-gb:{raw}", "%s=%r is not a size in GB (a number >= 0): using "
                      "the default, %g GB", MAX_GB_ENV, raw, DEFAULT_MAX_GB)
    return int(DEFAULT_MAX_GB * 1024 ** 3)


def shared_object_problem(path: Path) -> str:
    """'' when a compiled ``.so`` looks whole: ELF magic, and the section header table (which
    the linker writes last) inside the file. Cheap: reads 64 bytes. Linux only ('' elsewhere)."""
    if not sys.platform.startswith("linux"):
        return ""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
        size = os.path.getsize(path)
    except OSError as exc:
        return f"unreadable ({exc.__class__.__name__})"
    if head[:4] != b"\x7fELF":
        return "not a shared object"
    order = "little" if head[5:6] == b"\x01" else "big"
    if head[4:5] == b"\x02" and len(head) >= 64:  # 64-bit
        shoff, shentsize, shnum = (int.from_bytes(head[a:b], order)
                                   for a, b in ((0x28, 0x30), (0x3A, 0x3C), (0x3C, 0x3E)))
    elif head[4:5] == b"\x01" and len(head) >= 52:  # 32-bit
        shoff, shentsize, shnum = (int.from_bytes(head[a:b], order)
                                   for a, b in ((0x20, 0x24), (0x2E, 0x30), (0x30, 0x32)))
    else:
        return "truncated"
    if shoff + shentsize * shnum > size:
        return "truncated"
    return ""


def dir_size(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return total


class PersistentCache:
    def __init__(self, root: str | os.PathLike, max_bytes: int | None = None):
        self.root = Path(root)
        self.max_bytes = max_bytes_from_env() if max_bytes is None else max_bytes

    @classmethod
    def default(cls, user_dir: str | os.PathLike) -> "PersistentCache | None":
        """The operator's ``TORCH_COMPILE_SPEED_CACHE_DIR`` (``off`` disables), else under ComfyUI's
        user directory. On Windows without long paths, a root too deep for torch's nested files
        moves to ``%LOCALAPPDATA%\\tcs`` (the operator's root never moves: None then, said once)."""
        configured = os.environ.get(ROOT_ENV, "").strip()
        if configured.lower() in ("off", "0", "none", "false"):
            return None
        root = Path(configured) if configured else Path(user_dir) / "torch_compile_speed" / "cache"
        root = longpaths.choose_root(root, deepest_path, movable=not configured)
        return None if root is None else cls(root)

    def entry_dir(self, fingerprint: str) -> Path:
        return self.root / fingerprint[:ENTRY_CHARS]

    def inductor_dir(self, fingerprint: str) -> Path:
        return self.entry_dir(fingerprint) / INDUCTOR_SUBDIR

    def env(self, fingerprint: str) -> dict[str, str]:
        """The run's env; the first time in this process an entry is used, a damaged one is
        discarded (see ``damage``) so this compile rebuilds it. ``{}`` (torch's own cache dir)
        when the entry cannot be made or written (e.g. a read-only user folder)."""
        d = self.inductor_dir(fingerprint)
        try:
            self.discard_if_damaged(fingerprint)
            d.mkdir(parents=True, exist_ok=True)
            if not os.access(d, os.W_OK):
                raise PermissionError(errno.EACCES, "not writable", str(d))
        except OSError as exc:
            io_failed(self.root, "use it", exc)
            return {}
        return {"TORCHINDUCTOR_CACHE_DIR": str(d), "TRITON_CACHE_DIR": str(d / TRITON_SUBDIR)}

    def read_meta(self, fingerprint: str) -> dict | None:
        """meta.json as a dict, or None when it is missing, unreadable or for another entry."""
        try:
            meta = json.loads((self.entry_dir(fingerprint) / META).read_text())
        except (OSError, ValueError):
            return None
        return meta if isinstance(meta, dict) and meta.get("fingerprint") == fingerprint else None

    def is_complete(self, fingerprint: str) -> bool:
        return self.read_meta(fingerprint) is not None

    def damage(self, fingerprint: str) -> str:
        """Why this entry cannot be trusted, or ''. A disk that filled up, a copy cut short or a
        crash while saving leaves garbage that torch does not always survive: unreadable pickles
        are recompiled, but a broken CPU-feature probe ``.so`` silently turns off vectorised
        kernels, and a broken kernel ``.so`` next to an intact FX-graph entry fails the compile."""
        d = self.entry_dir(fingerprint)
        if (d / META).exists() and self.read_meta(fingerprint) is None:
            return f"{META} is unreadable"
        inductor = self.inductor_dir(fingerprint)
        settled = time.time() - WRITING_GRACE_S
        for dirpath, _dirs, files in os.walk(inductor):
            for name in files:
                if name.endswith(".so"):
                    path = Path(dirpath) / name
                    try:
                        if path.stat().st_mtime > settled:
                            continue  # maybe still being written (gcc writes in place) by a
                            # process sharing this cache dir
                    except OSError:
                        continue
                    problem = shared_object_problem(path)
                    if problem:
                        return f"{path.relative_to(d)} is {problem}"
        return ""

    def discard_if_damaged(self, fingerprint: str) -> bool:
        """Check an entry once per process; remove it (with one warning) when it is damaged."""
        d = self.entry_dir(fingerprint)
        if not log._first_time(f"persist-checked:{d}"):
            return False
        problem = self.damage(fingerprint) if d.exists() else ""
        if not problem:
            return False
        shutil.rmtree(d, ignore_errors=True)
        log.warning("persistent cache entry %s was damaged (%s): discarded it, so this compile "
                    "starts cold and saves a fresh copy", d, problem)
        return True

    def mark_complete(self, fingerprint: str, info: dict) -> None:
        d = self.entry_dir(fingerprint)
        meta = {"fingerprint": fingerprint, "torch": torch.__version__, "saved": time.time(), **info}
        try:
            write_atomic(d / META, json.dumps(meta, indent=1))
        except OSError as exc:  # full disk, or (Windows) meta.json open in another process
            io_failed(self.root, f"save {META}", exc)

    def touch(self, fingerprint: str) -> None:
        try:
            os.utime(self.entry_dir(fingerprint))
        except FileNotFoundError:
            pass  # not saved, or evicted meanwhile by another process sharing the cache
        except OSError as exc:
            io_failed(self.root, "mark an entry as used", exc)

    def entries(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return [p for p in self.root.iterdir() if p.is_dir() and not p.name.startswith(".")]

    def evict(self, keep: str = "") -> list[str]:
        """Drop least recently used entries until the cache fits ``max_bytes``; never ``keep``."""
        try:
            sized = [s for s in map(_sized, self.entries()) if s is not None]
        except OSError as exc:
            io_failed(self.root, "list its entries", exc)
            return []
        total = sum(s for _, _, s in sized)
        keep = self.entry_dir(keep).name if keep else ""
        removed = []
        for _mtime, path, size in sorted(sized, key=lambda t: t[0]):
            if total <= self.max_bytes:
                break
            if path.name == keep:
                continue
            shutil.rmtree(path, ignore_errors=True)
            total -= size
            removed.append(path.name)
        if removed:
            log.info("persistent cache over %.1f GB: evicted %d old entr%s", self.max_bytes / 1024 ** 3,
                     len(removed), "y" if len(removed) == 1 else "ies")
        return removed


def deepest_path(root: str | os.PathLike) -> int:
    """Characters in the longest path torch and Triton write under a cache ``root``."""
    inductor = Path(os.path.abspath(root)) / ("0" * ENTRY_CHARS) / INDUCTOR_SUBDIR
    return len(str(inductor)) + longpaths.below_inductor_dir(TRITON_SUBDIR)


def _sized(entry: Path) -> tuple[float, Path, int] | None:
    """(mtime, entry, bytes), or None when it is gone (another process sharing the cache just
    evicted it) or cannot be read: then it is left alone."""
    try:
        return entry.stat().st_mtime, entry, dir_size(entry)
    except OSError:
        return None
