"""Persistent warm start: compile caches kept per fingerprint, so a restarted server reuses them.

Each fingerprint gets ``<root>/<fingerprint>/`` holding the inductor cache dir that torch
uses during our runs (FX graph + AOTAutograd caches, the compiled C++ ``.so`` files on CPU,
Triton kernels on GPU) and, on GPU, the torch mega-cache artifacts. The directory size
is bounded: least recently used fingerprints are evicted first. A ``meta.json`` written
after a successful first compile marks the entry as complete.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import torch

from . import log

ROOT_ENV = "TORCH_COMPILE_SPEED_CACHE_DIR"       # operator: where the persistent cache lives
MAX_GB_ENV = "TORCH_COMPILE_SPEED_CACHE_MAX_GB"  # operator: size bound (default below)
DEFAULT_MAX_GB = 20.0
META = "meta.json"
MEGACACHE = "megacache.bin"


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
        if max_bytes is None:
            max_bytes = int(float(os.environ.get(MAX_GB_ENV, DEFAULT_MAX_GB)) * 1024 ** 3)
        self.max_bytes = max_bytes

    @classmethod
    def default(cls, user_dir: str | os.PathLike) -> "PersistentCache | None":
        """The operator's ``TORCH_COMPILE_SPEED_CACHE_DIR`` (``off`` disables), else under ComfyUI's
        user directory."""
        configured = os.environ.get(ROOT_ENV, "").strip()
        if configured.lower() in ("off", "0", "none", "false"):
            return None
        return cls(configured or Path(user_dir) / "torch_compile_speed" / "cache")

    def entry_dir(self, fingerprint: str) -> Path:
        return self.root / fingerprint

    def inductor_dir(self, fingerprint: str) -> Path:
        return self.entry_dir(fingerprint) / "inductor"

    def env(self, fingerprint: str) -> dict[str, str]:
        d = self.inductor_dir(fingerprint)
        d.mkdir(parents=True, exist_ok=True)
        return {"TORCHINDUCTOR_CACHE_DIR": str(d)}

    def is_complete(self, fingerprint: str) -> bool:
        return (self.entry_dir(fingerprint) / META).is_file()

    def mark_complete(self, fingerprint: str, info: dict) -> None:
        d = self.entry_dir(fingerprint)
        meta = {"fingerprint": fingerprint, "torch": torch.__version__, "saved": time.time(), **info}
        tmp = d / (META + ".tmp")
        tmp.write_text(json.dumps(meta, indent=1))
        os.replace(tmp, d / META)

    def touch(self, fingerprint: str) -> None:
        d = self.entry_dir(fingerprint)
        if d.exists():
            os.utime(d)

    def entries(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return [p for p in self.root.iterdir() if p.is_dir() and not p.name.startswith(".")]

    def evict(self, keep: str = "") -> list[str]:
        """Drop least recently used entries until the cache fits ``max_bytes``; never ``keep``."""
        sized = [(p.stat().st_mtime, p, dir_size(p)) for p in self.entries()]
        total = sum(s for _, _, s in sized)
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

    # -- mega-cache artifacts (they carry Triton kernels on GPU; on CPU gcc rebuilds anyway)
    def save_megacache(self, fingerprint: str) -> bool:
        try:
            saved = torch.compiler.save_cache_artifacts()
        except Exception as exc:  # noqa: BLE001 - an optional accelerator, never fatal
            log.warn_once("megacache-save", "could not save torch cache artifacts: %s", exc)
            return False
        if not saved:
            return False
        data, _info = saved
        path = self.entry_dir(fingerprint) / MEGACACHE
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
        return True

    def load_megacache(self, fingerprint: str) -> bool:
        path = self.entry_dir(fingerprint) / MEGACACHE
        if not path.is_file():
            return False
        try:
            torch.compiler.load_cache_artifacts(path.read_bytes())
            return True
        except Exception as exc:  # noqa: BLE001 - corrupt or incompatible: compile normally
            log.warning("discarding unreadable torch cache artifacts %s: %s", path, exc)
            path.unlink(missing_ok=True)
            return False
