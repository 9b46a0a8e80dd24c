"""What every route of a compiled model shares: its settings, plan and compiled entry, the
caches it compiles into, and what it keeps from one model call to the next."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from . import attach, warmup
from ..cache import precompiled
from ..cache.fleet import Fleet
from ..cache.persist import PersistentCache
from ..cache.registry import CompiledEntry
from ..plan.knobs import knobs_for
from ..plan.regions import FAMILY_DYNAMO_KNOBS, RegionPlan
from ..plan.settings import CompileSettings
from ..report import log
from ..torch_support import aot, scoped


@dataclasses.dataclass
class ModelState:
    settings: CompileSettings
    plan: RegionPlan
    entry: CompiledEntry
    reused: bool
    description: str
    ptx_cache_dir: Path | None = None
    persistent: PersistentCache | None = None
    fleet: Fleet | None = None
    changed: bool = False  # the last model call compiled, recompiled, swapped or fell back
    warmed: bool = False  # PTX warm-up done (or done elsewhere: compile-ahead)
    ran: bool = False  # a model call ran on the compiled path
    sampling_run: int = 0  # 0: outside ``sampling_run``, 1: at its first call, 2: after it
    # the host's context around a first call that compiles on the calling thread, given the
    # device (ComfyUI's memory compiler paused: ``nodes.memory_compiler``); None: nothing
    compile_context: Callable | None = None
    # the same on every call: kept, not rebuilt per model call (see ``scope``)
    scopes: dict = dataclasses.field(default_factory=dict)
    shapers: dict = dataclasses.field(default_factory=dict)

    @property
    def fingerprint(self) -> str:
        return self.entry.fingerprint

    def attached(self, modules: list[nn.Module], fast=None, failures: list | None = None):
        """``attach.attached`` with this model's compiled callable, plan and shape policy."""
        return attach.attached(modules, self.entry.compiled, self.plan.family, self.settings.shape_policy,
                               not self.plan.regional, fast, self.shapers, failures)

    def shaper(self, module: nn.Module):
        return attach.shaper_for(self.shapers, module, self.plan.family, self.settings.shape_policy,
                                 not self.plan.regional)

    def fell_back(self, failure: str, out, how: str):
        """The compile failed: every model sharing the entry runs eagerly from now on."""
        self.entry.failed = failure
        log.warning("torch.compile failed, so this model now runs eagerly (output unchanged; %s). %s",
                    how, failure)
        self.changed = True
        return out

    def scope(self, on_cuda: bool) -> tuple[scoped.Scope, dict]:
        """(``scoped.Scope``, PTX env) of a run on CUDA or not: computed on the first
        call (the persistent cache checks its folder then) and kept, unless the cache folder
        could not be used, which the next call tries again."""
        got = self.scopes.get(on_cuda)
        if got is None:
            ptx = warmup.ptx_env(self.settings.experimental_ptx, on_cuda, self.ptx_cache_dir)
            env = {**(self.persistent.env(self.fingerprint) if self.persistent else {}), **ptx}
            knobs = knobs_for(self.settings, on_cuda)
            knobs["dynamo"].update(FAMILY_DYNAMO_KNOBS.get(self.plan.family, {}))
            got = (scoped.Scope(**knobs, env=env), ptx)
            if env or not self.persistent:
                self.scopes[on_cuda] = got
        return got

    def precompiled(self) -> precompiled.Precompiled | None:
        """The entry's dynamo-level warm start (``compile_core.cache.precompiled``), where it applies."""
        e = self.entry
        if e.precompiled is None and self.persistent and precompiled.supported(self.settings, self.plan.regional):
            e.precompiled = precompiled.Precompiled(
                self.persistent.inductor_dir(self.fingerprint) / precompiled.DIRNAME,
                self.settings.compile_kwargs())
        elif e.precompiled is None and self.persistent and not aot.load_compiled_function():
            log.info_once("no-saved-regions", "torch %s cannot save and load a compiled function "
                          "(torch.compiler.load_compiled_function), so no saved regions: a restart "
                          "compiles again from the persistent FX-graph cache", torch.__version__)
        return e.precompiled or None

    def warm_if_first(self, call: Callable[[], object], device: torch.device, warm: bool) -> None:
        """The first compiled call on CUDA with PTX warm-up on: run it a few times first."""
        if warm:
            secs = warmup.warm(call, self.settings.warmup_runs, device)
            log.info("warmed Triton kernels %d time(s) on %s in %.1f s",
                     self.settings.warmup_runs, device, secs)
        self.warmed = True
