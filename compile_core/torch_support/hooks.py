"""Hooks into inductor's process-wide state that a compile of the pack runs under: where
inductor builds its precompiled C++ headers, header precompiling off while built kernels load,
and the one-time fx trace run before a background compile starts. Each leaves things as it
found them.
"""
from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterator


_HEADER_ATTRS = ("_HEADER_DIR", "_HEADER_LOCK_DIR")


@contextlib.contextmanager
def precompiled_header_dir(path: str | None) -> Iterator[None]:
    """Inside the block, inductor builds its precompiled C++ headers under ``path``. torch puts
    them under TMPDIR (``codecache._HEADER_DIR``, fixed at import, outside
    ``TORCHINDUCTOR_CACHE_DIR``) and builds them before it looks for a cached kernel, so a new
    container rebuilt a 150 MB header (tens of seconds) on a full cache hit. Nothing changes
    where this torch keeps no such directory."""
    codecache = sys.modules.get("torch._inductor.codecache") if path else None
    if codecache is None and path:
        try:
            import torch._inductor.codecache as codecache
        except ImportError:
            codecache = None
    if codecache is None or not all(isinstance(getattr(codecache, n, None), str) for n in _HEADER_ATTRS):
        yield
        return
    saved = [getattr(codecache, n) for n in _HEADER_ATTRS]
    codecache._HEADER_DIR, codecache._HEADER_LOCK_DIR = path, os.path.join(path, "locks")
    try:
        yield
    finally:
        codecache._HEADER_DIR, codecache._HEADER_LOCK_DIR = saved


@contextlib.contextmanager
def without_precompiled_header() -> Iterator[None]:
    """Around a saved region's capture and every load of it: its C++ kernels are built and
    looked up without inductor's precompiled C++ header. Whether it is on is part of a
    kernel's cache key (a define on its command line), and torch builds the header before it
    looks for a built kernel: a fleet worker or a new container has none (~5 s of a 5.4 s
    load), and a region captured with it and loaded without it built every kernel twice
    (12-15 s more for one block of the tiny WAN). Without the header a kernel compiles
    slower, but once, and loads at once everywhere.
    Nothing changes where this torch has no such setting."""
    import torch._inductor.config as inductor_config
    if not isinstance(getattr(inductor_config, "cpp_cache_precompile_headers", None), bool):
        yield
        return
    with inductor_config.patch(cpp_cache_precompile_headers=False):
        yield


def precompiled_header_dir_now() -> str | None:
    """Where inductor builds precompiled headers now (for the leak checks), if it is imported."""
    return getattr(sys.modules.get("torch._inductor.codecache"), "_HEADER_DIR", None)


def warm_fx_tracers() -> None:
    """Run, on the calling thread, the one-time torch.fx symbolic trace inductor does on first
    use (``loop_body.InterpreterShim._dummy_gm``, cached for the process). A symbolic trace
    patches ``nn.Module.__call__`` process-wide while it runs; done here, before a background
    compile starts, it cannot catch an eager step of the main thread (``background``)."""
    try:
        from torch._inductor.loop_body import InterpreterShim
        InterpreterShim._dummy_gm()
    except Exception:  # noqa: BLE001 - not on this torch: background.eager_beside_worker copes
        pass
