"""Model calls while the worker compiles another model: on the graphs this model already has.

A model in background mode whose graphs are built while another model's compile runs (WAN
2.2's two models, say) does not wait for that compile, nor run eagerly until the worker is
idle: it runs the regional graphs that take its calls, on these terms:

- No compile on this thread: each region call is checked ahead against dynamo's cache, as
  dynamo would check it (``StrictMiss``); a call no graph takes for sure runs the block's eager
  forward (also where it cannot be told), and nothing is queued for it.
- No scope on this thread: the scope's knobs and environment matter to a compile only, and
  the worker's scope holds the process-wide environment (restored out of order, a scope of
  this thread would leave the cache folder set).
- Only a model whose graphs have no graph break: a break's resume frame is a graph of its own
  that the check ahead does not see, and a miss there would compile here.
- Not with CUDA graphs (modes ``reduce-overhead``, ``max-autotune`` or the ``cudagraphs``
  backend, on a GPU): their replays are not to share a device with a compile that runs the model.
- Saved regions (``precompiled``) run only in variants that have run here already
  (``Precompiled.takes_ready``): a first call may load, trace or build kernels.
- A tracer of the worker's may catch a module call of this thread; the call then runs again
  (``background.eager_beside_worker``).
- Out of memory beside the compile (on a GPU the compile runs the model once too): the call
  waits for the compile, then runs again alone, so the prompt completes.
- On the CPU, the call keeps every thread (an eager call beside the compile leaves the worker
  one): dynamo's guards pin the thread count the graphs were compiled with, and with one
  thread fewer no graph would take a call.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from . import background
from .state import ModelState
from ..report import log
from ..torch_support import guards, probing

CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


class StrictMiss:
    """For one model call (``shapes.shaped_call``'s ``miss``): a region runs compiled only when
    a graph of it takes the call for sure (its guards, ``guards.cached_graph_accepts``),
    else its eager forward; nothing is kept for a compile."""

    def __init__(self, compiled: Callable):
        self.compiled, self.eager_regions = compiled, 0

    def run(self, module: nn.Module, args: tuple, kwargs: dict, shaped: tuple, shaped_kwargs: dict,
            fast=None) -> tuple | None:
        taken = fast.takes_ready(module, shaped, shaped_kwargs) if fast is not None else None
        if taken is None:
            taken = guards.cached_graph_accepts(self.compiled, module, shaped, shaped_kwargs)
        if taken is True:
            return None
        self.eager_regions += 1
        return (nn.Module._call_impl(module, *args, **kwargs),)


def why_not(state, device: torch.device) -> str:
    """Why this model's calls cannot run its graphs beside the worker ('' when they can)."""
    e, s = state.entry, state.settings
    if e.failed or not e.graphs:  # (of the entry: an Apply node that runs again shares it)
        return "it has no compiled graph yet"
    if e.graph_breaks:
        return "its graphs have graph breaks"
    if device.type == "cuda" and (s.backend == "cudagraphs" or
                                  (s.backend == "inductor" and s.mode in CUDA_GRAPH_MODES)):
        return "its graphs replay CUDA graphs"
    if not probing.answered(guards.guard_check):  # (never run here: see ``answered``)
        return f"torch {torch.__version__} cannot check its graphs' guards ahead, or has not been asked yet"
    return ""


class Beside:
    """The route of a model call in background mode while the worker compiles another model:
    on this model's graphs where they take it, else eagerly; said once per job."""

    def __init__(self, state: ModelState, in_background):
        self.state, self.in_background = state, in_background

    def run(self, diffusion_model: nn.Module, call: Callable[[], object], device: torch.device) -> tuple | None:
        if not self.in_background.active or not background.busy():
            return None
        why = why_not(self.state, device)
        background.note_beside(self.state.description, why)
        try:
            if why:
                return (background.eager_beside_worker(call),)
            return (self._on_its_graphs(diffusion_model, call, device),)
        except torch.OutOfMemoryError as exc:
            return (after_the_compile(self.state.description, call, device, exc),)

    def _on_its_graphs(self, diffusion_model, call, device):
        s = self.state
        modules, fast = s.plan.modules(diffusion_model), s.entry.precompiled or None
        miss = StrictMiss(s.entry.compiled)

        def compiled_call():
            if fast is not None:
                fast.begin_run(modules, device)  # (no scope: ``takes_ready`` lets only built variants run)
            with s.attached(modules, fast, miss):
                return call()
        out = background.eager_beside_worker(compiled_call)  # every thread: see the module's notes
        s.entry.runs += miss.eager_regions == 0  # (a compiled model call, as the foreground counts them)
        return out


def after_the_compile(description: str, call: Callable[[], object], device: torch.device, exc) -> object:
    """Out of memory beside the compile, which runs the model once on the same device: wait
    for it, then run the call again, eagerly and alone (a model call changes no state). The
    prompt completes rather than fail over a background compile."""
    log.warning("%s ran out of memory beside a background compile; it runs again once that compile "
                "is done: %s", description, str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__)
    background.wait_idle()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return call()
