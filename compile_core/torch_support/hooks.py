"""Hooks into inductor's process-wide state that a compile of the pack runs under: header
precompiling off while a saved region's kernels are built and loaded, and the one-time fx trace
run before a background compile starts. Each leaves things as it found them.
"""
from __future__ import annotations

import contextlib
from typing import Iterator


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
