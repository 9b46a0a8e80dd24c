"""ComfyUI's memory "model compiler" (``comfy/model_prefetch.py``, ComfyUI after 0.33): on CUDA
with comfy-aimdo it records the sampling thread's allocations as a malloc graph. A compile's
own allocations (dynamo's fake tensors, inductor's autotuning and Triton's benchmarks) are no
part of the model's steady steps, so a compile on the sampling thread runs with that graph
paused, through ComfyUI's public ``pause_malloc_graph()``, wherever ``malloc_graph_enabled``
says the graph is on. Without the module (older ComfyUI), with ``--disable-comfy-compiler`` or
off CUDA it is a no-op. A background compile runs on its own thread, which the per-thread
graph does not record."""
from __future__ import annotations

import contextlib
import importlib


def paused(device, prefetch=None) -> contextlib.AbstractContextManager:
    """ComfyUI's ``pause_malloc_graph()`` where its memory compiler records on ``device``,
    else a no-op context. ``prefetch``: the ``comfy.model_prefetch`` module (found when None)."""
    if prefetch is None:
        try:
            prefetch = importlib.import_module("comfy.model_prefetch")
        except Exception:  # noqa: BLE001 - absent (ComfyUI 0.33 and older) or not importable
            return contextlib.nullcontext()
    enabled = getattr(prefetch, "malloc_graph_enabled", None)
    pause = getattr(prefetch, "pause_malloc_graph", None)
    if not callable(enabled) or not callable(pause) or not enabled(device):
        return contextlib.nullcontext()
    return pause()
