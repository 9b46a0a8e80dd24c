"""A compiled model: a small dispatcher over its routes, and ``prepare``, which makes one.

``prepare()`` decides *what* to compile (regions), finds or builds the compiled callable
(reuse registry) and returns a ``CompiledModel``. Each model call takes the first route that
takes it (``run``): eager once the compile failed or was measured not faster; the pairs of
eager and compiled steps that measure it (``verdict``); the background route while a compile
is pending, this model's or another's (``background_route``: eagerly); else the foreground
route, which compiles where needed and runs the regions compiled (``foreground``). Every route
has one method, ``run(diffusion_model, call, device)``, which returns ``(output,)`` or None
(not this route's call).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import nn

from .background_route import Background
from .compiled_call import make_compiled_call
from .foreground import Foreground
from .state import ModelState
from .verdict import Judge
from ..cache.fleet import Fleet
from ..cache.persist import PersistentCache
from ..cache.registry import REGISTRY, CompiledEntry, ReuseRegistry
from ..plan.fingerprint import fingerprint
from ..plan.regions import RegionPlan, plan_regions
from ..plan.settings import CompileSettings
from ..report import log
from ..torch_support import torch_compat


class _Eager:
    """The route of a model whose compile failed, or that is not faster compiled (``verdict``):
    the model's own call."""

    def __init__(self, state: ModelState):
        self.state = state

    def run(self, diffusion_model: nn.Module, call: Callable[[], object], device: torch.device) -> tuple | None:
        e = self.state.entry
        return (call(),) if e.failed or e.slower else None


class CompiledModel:
    """One Apply's compiled model: its shared ``state`` and its routes."""

    memory_path: str | None = None  # the host's memory path for it (ComfyUI's dynamic VRAM), for the badge

    def __init__(self, state: ModelState, judged: bool = True):
        self.state = state
        self.background = Background(state)
        foreground = Foreground(state)
        judge = (Judge(state, self.background, foreground),) if judged else ()
        self.routes = (_Eager(state), *judge, self.background, foreground)

    settings = property(lambda self: self.state.settings)
    plan = property(lambda self: self.state.plan)
    entry = property(lambda self: self.state.entry)
    reused = property(lambda self: self.state.reused)
    description = property(lambda self: self.state.description)
    persistent = property(lambda self: self.state.persistent)
    fingerprint = property(lambda self: self.state.fingerprint)
    changed = property(lambda self: self.state.changed)
    swapped_at = property(lambda self: self.background.swapped_at)
    compiling_in_background = property(lambda self: self.background.compiling)
    compile_held = property(lambda self: self.background.held)

    @property
    def on_background_done(self) -> Callable[[], None] | None:
        """Called on the worker when this model's background compile is done (the badge)."""
        return self.background.on_done

    @on_background_done.setter
    def on_background_done(self, fn: Callable[[], None] | None) -> None:
        self.background.on_done = fn

    def run(self, diffusion_model: nn.Module, call: Callable[[], object], device: torch.device,
            worker_context: Callable[[], contextlib.AbstractContextManager] | None = None):
        """Run ``call`` (one model evaluation) with the regions compiled; eager on failure.

        Afterwards ``self.changed`` is True when this call compiled, recompiled or fell back,
        i.e. when the status shown to the user should be refreshed. A compile this call queues
        runs inside ``worker_context()`` on the worker (what the caller's own context does
        around this call, e.g. the bridge's LoRA routing)."""
        self.state.changed, self.background.worker_context = False, worker_context
        for route in self.routes:
            out = route.run(diffusion_model, call, device)
            if out is not None:
                return out[0]
        raise AssertionError("the foreground route takes every call")

    @contextlib.contextmanager
    def sampling_run(self) -> Iterator[None]:
        """One sampling run: the caller promises that no region's submodule is replaced between
        its model calls (ComfyUI patches modules when it loads the model, before the first
        one), so what depends only on the module structure is worked out once per run."""
        outer, self.state.sampling_run = self.state.sampling_run, 1
        if not outer:
            self.background.retry_stopped()
        try:
            yield
        finally:
            self.state.sampling_run = outer

    def foreground(self) -> contextlib.AbstractContextManager:
        """Compile on the calling thread inside the block (compile-ahead, Diagnostics): a
        pending background compile is finished (and swapped in) first."""
        return self.background.in_foreground()

    def run_eagerly_after(self, why: str, call: Callable[[], object]):
        """The compiled model call failed (``why``): run ``call`` eagerly; where it raises too,
        the error is the model's own and propagates; else every model sharing the entry runs
        eagerly from now on."""
        out = call()
        return self.state.fell_back(why, out, "the model call ran again, eagerly")

    def mark_warmed(self) -> None:
        """Kernels are being warmed elsewhere (compile-ahead): skip the first-call PTX warm-up."""
        self.state.warmed = True


def prepare(diffusion_model: nn.Module, settings: CompileSettings,
            registry: ReuseRegistry = REGISTRY, ptx_cache_dir: Path | None = None,
            persistent: PersistentCache | None = None, fleet: Fleet | None = None,
            plan: RegionPlan | None = None) -> CompiledModel:
    """Plan regions and find (reuse_if_similar) or build the compiled callable for this model.
    ``plan``: regions chosen by the caller (e.g. ``compile_core.plan.vae``), instead of ``plan_regions``:
    such a plan compiles in the foreground (a VAE's decoder carries state from one chunk's call
    to the next, which an eager first call with its inputs captured would not see the same way)."""
    own_plan = plan is not None  # (a VAE: no verdict either, its calls are chunks of unlike sizes)
    if own_plan and settings.background_compile:
        settings = dataclasses.replace(settings, background_compile=False)
    plan = plan or plan_regions(diffusion_model, settings.blocks_only)
    fp = fingerprint(diffusion_model, plan, settings)
    factory = functools.partial(make_compiled_call, settings)
    # a background inductor compile builds its compile object on the worker (``registry``);
    # any other is built here: a backend that cannot be set up fails before any model call
    lazy = settings.background_compile and settings.backend == "inductor"
    unsupported = torch_compat.unsupported()
    if unsupported:
        log.warn_once("torch-unsupported", "%s", unsupported)
        entry, reused = CompiledEntry(fp, None, failed=unsupported), False
    elif settings.reuse_if_similar:
        entry, reused = registry.get_or_create(fp, factory, (settings.cache_size_limit, settings.recompile_limit), lazy)
    else:
        entry, reused = CompiledEntry(fp, factory), False
        entry._compiled = None if lazy else factory()
    description = plan.describe(diffusion_model)
    log.info("%s [%s, mode=%s, fingerprint %s]", _prepared(entry, reused, description),
             settings.backend, settings.mode, fp[:12])
    return CompiledModel(ModelState(settings, plan, entry, reused, description, ptx_cache_dir, persistent, fleet),
                         judged=not own_plan)


def _prepared(entry: CompiledEntry, reused: bool, description: str) -> str:
    """What ``prepare`` found: a failed entry stays eager and says why; a reused one says how
    many graphs it compiled (none yet: not run, or, on torch without isolate_recompiles, its
    runs were served by graphs another compile of the same code made)."""
    if entry.failed:
        return f"{description} stays eager ({entry.failed})"
    if not reused:
        return f"will compile {description}"
    if entry.graphs:
        return f"reusing compiled {description} ({entry.graphs} graph(s) compiled earlier)"
    return f"reusing compiled {description} (no graph of its own yet)"
