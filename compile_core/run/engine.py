"""Compile a diffusion model's regions and run them, scoped, reused and safe.

``prepare()`` decides *what* to compile (regions), finds or builds the compiled callable
(reuse registry) and returns a ``CompiledModel``. ``CompiledModel.run()`` wraps one model
call: it attaches the compiled callable to the region modules (``_compiled_call_impl``, the
hook ``nn.Module.compile()`` uses, so state_dict keys stay clean), applies the scoped
knobs, and detaches everything afterwards, so the shared model is untouched between calls.
A compile failure is reported once and the call (and later ones) run eagerly. With the
persistent cache on, regions go through ``precompiled`` first: saved regions that a restarted
process loads without a dynamo trace.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
import weakref
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import nn

from . import background, beside, fallback, new_shapes, warmup
from ..report import log
from ..cache import precompiled, prewarm
from ..torch_support import scoped, torch_compat
from ..plan import shapes
from ..plan.fingerprint import fingerprint
from ..cache.fleet import Fleet
from ..cache.persist import PersistentCache
from ..plan.regions import FAMILY_DYNAMO_KNOBS, RegionPlan, plan_regions
from ..cache.registry import REGISTRY, CompiledEntry, ReuseRegistry
from ..plan.settings import CompileSettings


def make_compiled_call(settings: CompileSettings) -> Callable:
    """One ``torch.compile`` object over ``nn.Module._call_impl``; dynamo compiles each region's
    ``forward`` frame, so identical blocks share graphs."""
    kwargs = settings.compile_kwargs()
    # Give each compile its own recompile budget where this torch supports it, so our
    # regions neither consume nor are starved by other compiles of the same code.
    if torch_compat.isolate_recompiles():
        kwargs["isolate_recompiles"] = True
    else:
        log.info_once("shared-recompile-budget", "torch %s has no working isolate_recompiles: every "
                      "compile of a block class shares dynamo's cache and one recompile budget "
                      "(dynamo_cache_size_limit)", torch.__version__)
        if not settings.reuse_if_similar:
            kwargs = _own_backend(kwargs)
    if torch_compat.recompile_limit_kwarg():  # else the scoped config knob sets it (scoped.py)
        kwargs["recompile_limit"] = settings.cache_size_limit
    # torch 2.9's torch.compile() sets TORCHINDUCTOR_CACHE_DIR (a background compile's scope
    # sets it too: the lock keeps the two from restoring each other's value)
    with background.env_lock(), scoped.scoped_state():
        return torch.compile(nn.Module._call_impl, **kwargs)


class _OwnBackend:
    """The backend ``torch.compile`` would build, equal only to itself. Dynamo reuses a cache
    entry of the same code made by an *equal* backend; without ``isolate_recompiles`` (torch
    2.8-2.10) this is how reuse_if_similar off still compiles afresh (it shares the budget)."""

    def __init__(self, backend: str, mode: str | None, dynamic: bool | None):
        with background.env_lock(), scoped.scoped_state():  # inductor's wrapper sets TORCHINDUCTOR_CACHE_DIR (2.8)
            if backend == "inductor":
                self.inner = torch._TorchCompileInductorWrapper(mode, None, dynamic)
            else:
                self.inner = torch._TorchCompileWrapper(backend, mode, None, dynamic)
        self.__name__ = backend

    def __call__(self, gm, example_inputs):
        return self.inner(gm, example_inputs)

    def __getattr__(self, name):  # get_compiler_config, reset, ... of the inner backend
        return getattr(self.__dict__["inner"], name)


def _own_backend(kwargs: dict) -> dict:
    own = _OwnBackend(kwargs["backend"], kwargs.get("mode"), kwargs.get("dynamic"))
    return {**{k: v for k, v in kwargs.items() if k != "mode"}, "backend": own}


@contextlib.contextmanager
def attached(modules: list[nn.Module], compiled: Callable, family: str = "",
             policy: str = "auto", whole_model: bool = False,
             fast: precompiled.Precompiled | None = None,
             shapers: dict[type, shapes.InputShaper] | None = None,
             miss=None, failures: list | None = None) -> Iterator[None]:
    """Route each module's ``__call__`` through ``compiled`` (or ``fast`` where it has the
    region) for the duration of the block, with its inputs prepared by the shape policy.
    ``shapers`` (per region class) may be kept by the caller from one call to the next;
    ``miss``: see ``shapes.shaped_call``; ``failures``: see ``_eager_on_failure``."""
    saved = []
    shapers = {} if shapers is None else shapers
    memo: dict = {}  # inputs every block receives are prepared once per call (shapes.InputShaper)
    try:
        for m in modules:
            shaper = _shaper(shapers, m, family, policy, whole_model)
            saved.append((m, m.__dict__.get("_compiled_call_impl", _MISSING)))
            region = shapes.shaped_call(compiled, m, shaper, fast, memo, miss)
            m.__dict__["_compiled_call_impl"] = region if failures is None else _eager_on_failure(region, m, failures)
        yield
    finally:
        for m, prev in saved:
            if prev is _MISSING:
                m.__dict__.pop("_compiled_call_impl", None)
            else:
                m.__dict__["_compiled_call_impl"] = prev


def _eager_on_failure(region: Callable, module: nn.Module, failures: list) -> Callable:
    """``region``, except that a compile failure it raises is added to ``failures`` and the
    region runs eagerly in its place, as does every region after it in the same model call:
    the model call goes on, and nothing outside the regions (ComfyUI's wrappers, a cache
    patch's step state) runs twice. The failing region's own forward may run twice where its
    compiled code failed after a graph break; a region is a block (or the diffusion model),
    whose forward only computes its output."""
    def call(*args, **kwargs):
        if not failures:
            try:
                return region(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - classified right below
                if not fallback.is_compile_failure(exc):
                    raise
                failures.append(exc)
        return module._call_impl(*args, **kwargs)
    return call


def _queued_compile(ref: "weakref.ref[CompiledModel]", device: torch.device) -> int:
    """A queued background compile: it reaches its model only through ``ref``, so a job that
    waits (for the server to be idle, or behind another) keeps nothing alive, and one whose
    model ComfyUI let go is dropped."""
    cm = ref()
    if cm is None or cm._captured is None:
        log.info("a queued background compile was dropped: its model is gone")
        return 0
    (captured, context), cm._captured = cm._captured, None
    return cm._compile_captured(captured, device, context)


def _background_done(ref: "weakref.ref[CompiledModel]") -> None:
    """On the worker, once the job is done: say so (no model call may come for a while) and
    tell the host (the badge)."""
    cm = ref()
    if cm is None:
        return
    job = cm._job
    if job is not None:
        paused = f", {job.pauses} pause(s) for prompts ({job.paused_s:.1f} s)" if job.pauses else ""
        log.info("background compile of %s finished in %.1f s%s; the model's next call %s",
                 cm.description, job.seconds, paused,
                 "takes the compiled graphs" if job.error is None else "says what happened")
    if cm.on_background_done is not None:
        cm.on_background_done()


def _shaper(shapers: dict, module: nn.Module, family: str, policy: str, whole_model: bool):
    """The kept ``InputShaper`` of the module's class, made on first use."""
    shaper = shapers.get(type(module))
    if shaper is None:
        shaper = shapers[type(module)] = shapes.InputShaper(module, family, policy, whole_model)
    return shaper


_MISSING = object()


def _frames_since(start_us: int) -> list[dict]:
    """Dynamo's own compilation records (one per compiled frame; it keeps the last 64) that
    started after ``start_us``: where, how long, and for recompiles the guard that failed."""
    from torch._dynamo.utils import get_compilation_metrics
    try:
        records = list(get_compilation_metrics())
    except Exception:  # noqa: BLE001 - diagnostics only: never fail a sampling run over them
        return []
    out = []
    for m in records:
        if (getattr(m, "start_time_us", None) or 0) < start_us:  # none on torch 2.5/2.6
            continue
        out.append({
            "frame": f"{getattr(m, 'co_name', '?')} at {getattr(m, 'co_filename', '?')}:"
                     f"{getattr(m, 'co_firstlineno', '?')}",
            "seconds": round(getattr(m, "entire_frame_compile_time_s", None) or 0.0, 3),
            "recompile_reason": getattr(m, "recompile_reason", None) or "",
        })
    return out


def _fx_cache_counts() -> tuple[int, int]:
    from torch._dynamo.utils import counters
    c = counters["inductor"]
    return int(c["fxgraph_cache_hit"]), int(c["fxgraph_cache_miss"])


@dataclasses.dataclass
class _CompilePass:
    """A call that may compile: what it found before (``CompiledModel._begin_compile``)."""
    first_compile: bool
    recorder: object
    fast: precompiled.Precompiled | None
    graphs_before: int
    cache_before: tuple
    start_us: int
    start: float
    breaks_before: int = 0  # dynamo's graph-break count
    new_graphs: int = 0  # set by ``_finish_compile``
    lazy_scope: bool = False  # the saved regions enter the scope (``_begin_compile``)


def _region_variant(module: nn.Module) -> object:
    """Regions whose first inputs a background compile needs: one per class and structure
    (identical blocks share a graph)."""
    return (type(module), precompiled.region_key(module))


@dataclasses.dataclass
class CompiledModel:
    settings: CompileSettings
    plan: RegionPlan
    entry: CompiledEntry
    reused: bool
    description: str
    ptx_cache_dir: Path | None = None
    persistent: PersistentCache | None = None
    fleet: Fleet | None = None
    _warmed: bool = False
    _ran: bool = False
    changed: bool = False
    # the same on every call: kept, not rebuilt per model call (see _scope)
    _scopes: dict = dataclasses.field(default_factory=dict)
    _shapers: dict = dataclasses.field(default_factory=dict)
    _job: background.Job | None = None  # the background compile pending for this model
    _bg_done: bool = False  # its background compile ran (a model call never starts two)
    _bg_retry: bool = False  # it stopped on something other than a compile failure: try again
    _foreground: int = 0  # inside ``foreground()``: compile on the calling thread
    swapped_at: int | None = None  # the model call at which the background compile took over
    _miss_off: bool = False  # new inputs compile in the foreground (see ``_swap``)
    _worker_context: Callable | None = None  # of the current call (see ``run``)
    _captured: tuple | None = None  # (captured region calls, worker context) the queued job takes
    _sampling_run: int = 0  # 0: outside ``sampling_run``, 1: at its first call, 2: after it
    # called on the worker when a background compile of this model is done (the bridge sends
    # the badge's status: a CPU model's compile ends when the server is idle, and no model call
    # would send it then)
    on_background_done: Callable[[], None] | None = None
    # the host found another torch.compile around the model call (core's TorchCompileModel
    # after Apply): it would trace a background compile's input capture, so the model compiles
    # in the foreground
    inside_other_compile: bool = False

    @property
    def fingerprint(self) -> str:
        return self.entry.fingerprint

    @contextlib.contextmanager
    def sampling_run(self) -> Iterator[None]:
        """One sampling run: the caller promises that no region's submodule is replaced between
        its model calls (ComfyUI patches modules when it loads the model, before the first
        one), so what depends only on the module structure is worked out once per run."""
        outer, self._sampling_run = self._sampling_run, 1
        if not outer:
            self._retry_background()
        try:
            yield
        finally:
            self._sampling_run = outer

    def mark_warmed(self) -> None:
        """Kernels are being warmed elsewhere (compile-ahead): skip the first-call PTX warm-up."""
        self._warmed = True

    def run(self, diffusion_model: nn.Module, call: Callable[[], object], device: torch.device,
            worker_context: Callable[[], contextlib.AbstractContextManager] | None = None):
        """Run ``call`` (one model evaluation) with the regions compiled; eager on failure.

        Afterwards ``self.changed`` is True when this call compiled, recompiled or fell back,
        i.e. when the status shown to the user should be refreshed. In background mode a call
        may run eagerly instead while the worker compiles (``_run_background``); a compile this
        call queues runs inside ``worker_context()`` on the worker (what the caller's own
        context does around this call, e.g. the bridge's LoRA routing)."""
        self.changed, self._worker_context = False, worker_context
        if self.entry.failed:
            return call()
        if self.settings.background_compile and not self._foreground and not self.inside_other_compile:
            eager = self._run_background(diffusion_model, call, device)
            if eager is not None:
                return eager[0]
        elif background.busy():  # its compile scope's environment is process-wide: wait
            log.info_once("wait-background", "waiting for a background compile to finish before "
                          "running a model compiled in the foreground")
            background.wait_idle()
        return self._run_compiled(diffusion_model, call, device)

    def _run_compiled(self, diffusion_model: nn.Module, call: Callable[[], object], device: torch.device):
        """The foreground path: compile (first call, recompiles) and run on this thread."""
        scope, ptx = self._scope(device.type == "cuda")
        modules = self.plan.modules(diffusion_model)
        warm = ptx and not self._warmed and self.settings.warmup_runs
        p = self._begin_compile(modules, device, keep_keys=self._sampling_run > 1, scope=scope, warm=warm)
        self._sampling_run += self._sampling_run == 1  # the run's first call keyed them
        miss = self._miss_probe()
        failure, failures = "", []
        try:
            with (contextlib.nullcontext() if p.lazy_scope else scope.active()), \
                    attached(modules, self.entry.compiled, self.plan.family, self.settings.shape_policy,
                             not self.plan.regional, p.fast, self._shapers, miss, failures):
                self._probe_isa(p, device)
                if warm:
                    secs = warmup.warm(call, self.settings.warmup_runs, device)
                    log.info("warmed Triton kernels %d time(s) on %s in %.1f s",
                             self.settings.warmup_runs, device, secs)
                self._warmed = True
                out = call()
        except Exception as exc:  # noqa: BLE001 - classified right below
            if not fallback.is_compile_failure(exc):
                raise
            failure = fallback.explain(exc)
        if failures and not failure:
            # Eager is the judge: dynamo also wraps the model's own errors found while tracing
            # (e.g. a shape mismatch, as TorchRuntimeError); the region's eager run raised none,
            # so only the compile failed. It disables compile for every model sharing this entry.
            return self._fell_back(fallback.explain(failures[0]), out, "the block call it failed "
                                   "in ran eagerly in its place; the model call went on")
        if failure:  # outside the regions (before any ran): the model call runs again, eagerly
            return self._fell_back(failure, call(), "the model call ran again, eagerly")
        first, self._ran = not self._ran, True
        self.changed = self._finish_compile(p, device) or first or self.changed  # (a swap)
        if miss is not None and miss.captured:
            self._queue(list(miss.captured.values()), device, "a new input")
            log.info("%d region call(s) of %s got an input no compiled graph takes: they ran "
                     "eagerly, and it compiles in the background", miss.eager_regions, self.description)
        return out

    def _fell_back(self, failure: str, out, how: str):
        self.entry.failed = failure
        log.warning("torch.compile failed, so this model now runs eagerly (output unchanged; %s). %s",
                    how, failure)
        self.changed = True
        return out

    def _begin_compile(self, modules: list[nn.Module], device: torch.device, keep_keys: bool = False,
                       scope: scoped.Scope | None = None, warm: bool = False) -> "_CompilePass":
        """What a call that may compile needs first (the first compile: prewarm, the fleet),
        and the counters its ``_finish_compile`` compares against. ``keep_keys``: see
        ``sampling_run``. With ``scope``, a call on the saved-region path after the first
        compile leaves the scope to the saved regions (``p.lazy_scope``): they enter it where
        a trace, a load or a first call needs it, so a call they take costs no scope."""
        recorder, first_compile = None, self.entry.graphs == 0
        if first_compile:
            prewarm.wait()  # a background warm-up's imports must not race this compile's
            if self.persistent:
                recorder = prewarm.ImportRecorder()
                self._before_first_compile(device)
        fast = self._precompiled()
        p = _CompilePass(first_compile, recorder, fast, torch_compat.graph_count(), self._cache_counts(),
                         time.time_ns() // 1000, time.perf_counter(), torch_compat.graph_break_count())
        p.lazy_scope = scope is not None and fast is not None and not first_compile and not warm
        if fast is not None:
            fast.begin_run(modules, device, keep_keys, scope.active if p.lazy_scope else None)
        return p

    def _probe_isa(self, p: "_CompilePass", device: torch.device) -> None:
        if p.first_compile and device.type == "cpu" and self.settings.backend == "inductor":
            prewarm.probe_cpu_isa()  # side by side, not one ISA after another

    def _finish_compile(self, p: "_CompilePass", device: torch.device, where: str = "") -> bool:
        """Record the graphs this pass compiled (caches, frames, prewarm manifest); True when
        it compiled or loaded any."""
        # a region loaded by torch's AOT API counts like a graph compiled from the cache
        loaded = p.fast.loaded - p.cache_before[2] if p.fast else 0
        new_graphs = p.new_graphs = torch_compat.graph_count() - p.graphs_before + loaded
        changed = self._record(time.perf_counter() - p.start, new_graphs, loaded, where)
        if new_graphs:
            self.entry.graph_breaks += torch_compat.graph_break_count() - p.breaks_before
            self.entry.frames.extend(_frames_since(p.start_us))
            self._note_cache(p.cache_before, device)
            if p.recorder is not None:  # what a restarted server can warm before its first compile
                isa_dir = self.persistent.inductor_dir(self.fingerprint) if device.type == "cpu" else None
                changed_files = prewarm.record(self.persistent.root, p.recorder.new(),
                                               prewarm.traced_files(), isa_dir and str(isa_dir),
                                               self.fingerprint)
                if changed_files and self.fleet:
                    self.fleet.publish_manifest(changed_files)
        return changed

    # ----------------------------------------------------------------- background

    @property
    def compiling_in_background(self) -> bool:
        return self._job is not None and not self._job.done.is_set()

    @property
    def compile_held(self) -> bool:
        """Its background compile waits for the server to be idle, or pauses while a prompt
        runs (a CPU model: ``pacing``)."""
        job = self._job
        return job is not None and job.yields and not job.done.is_set() \
            and (not job.started.is_set() or job.paused)

    @contextlib.contextmanager
    def foreground(self) -> Iterator[None]:
        """Compile on the calling thread inside the block (compile-ahead, Diagnostics): a
        pending background compile is finished (and swapped in) first."""
        self._foreground += 1
        try:
            if background.busy():
                background.wait_idle()
            if self._job is not None:
                self._swap(self._job)
            yield
        finally:
            self._foreground -= 1

    def _run_background(self, diffusion_model, call, device) -> tuple | None:
        """``(output,)`` of a call that ran beside the worker (eagerly while its own compile is
        pending; on its graphs, where built, while another model's runs: ``beside``), or None
        when the call takes the compiled path (the job is done: swapped in here)."""
        job = self._job
        if not self._sampling_run:  # (outside a sampling run: each call is a run of its own)
            self._retry_background()
        if self._bg_retry:  # its compile stopped (``_swap``): eagerly until the next run
            return (call(),)
        if job is None and self.entry.graphs == 0 and not self._bg_done:
            out = self._start_background(diffusion_model, call, device)
            return (out,)
        # swap only once the worker is idle: another model's compile scope may still hold the
        # process-wide cache environment
        if job is not None and job.done.is_set() and not background.busy():
            self._swap(job)
            return (call(),) if self.entry.failed or self._bg_retry else None
        if job is not None and not job.done.is_set():  # this model's compile runs: eagerly
            job.eager_calls += 1
            try:
                return (background.eager_beside_worker(call, device),)
            except torch.OutOfMemoryError as exc:  # (on a GPU the compile runs the regions too)
                return (beside.after_the_compile(self.description, call, device, exc),)
        if background.busy():  # another model's compile runs: on this one's graphs, where built
            return (beside.run(self, diffusion_model, call, device, attached),)
        return None

    def _start_background(self, diffusion_model, call, device):
        """Run this call eagerly, keeping each region's first inputs, and queue their compile."""
        modules = self.plan.modules(diffusion_model)
        out, captured = background.capture_eager(modules, call, _region_variant)
        if not captured:  # nothing reached the regions: compile in the foreground next call
            self._bg_done = True
            return out
        self._queue(captured, device, "the first input")
        log.info("compiling %s in the background; the model runs eagerly until it is ready",
                 self.description)
        return out

    def _queue(self, captured: list, device: torch.device, what: str) -> None:
        """Queue the compile of ``captured`` on the worker (this call ran them eagerly). A CPU
        model's compile yields to prompts (``pacing``), unless its regions are saved (loading
        them takes a fraction of a second)."""
        fast = self._precompiled()
        yields = device.type == "cpu" and not (fast and fast.saved([c.module for c in captured], device))
        if not yields:  # before the worker starts (a yielding job does it there, when it may)
            torch_compat.warm_fx_tracers()
        self._captured = (captured, self._worker_context)
        self._job = background.submit(functools.partial(_queued_compile, weakref.ref(self), device),
                                      self.description, yields=yields)
        self._job.eager_calls, self._job.what, self.changed = 1, what, True
        self._job.on_done = functools.partial(_background_done, weakref.ref(self))
        if yields:
            log.info("%s runs on the CPU, whose cores its eager steps use: its background "
                     "compile runs while the server is idle and pauses while prompts run",
                     self.description)

    def _miss_probe(self) -> "new_shapes.EagerOnMiss | None":
        """In background mode, once compiled: a region call no graph takes runs eagerly and
        its compile is queued (``new_shapes``), where this torch can tell."""
        if not self.settings.background_compile or self._foreground or self._miss_off:
            return None
        if not new_shapes.EagerOnMiss.available():
            log.info_once("miss-probe-unavailable", "torch %s: a new input of a model compiled in "
                          "the background compiles on the sampling thread (its graphs' guards "
                          "cannot be checked ahead here)", torch.__version__)
            return None
        return new_shapes.EagerOnMiss(self.entry.compiled, _region_variant)

    def _compile_captured(self, captured: list, device: torch.device, context=None) -> int:
        """On the worker: compile each captured region by calling it, compiled, on its inputs
        (the same scope, shapes, saved regions and caches as a foreground compile), inside
        ``context()``. Returns the number of graphs it compiled, traced or loaded."""
        torch_compat.warm_fx_tracers()  # (cached: a no-op unless the job yields)
        scope, _ = self._scope(device.type == "cuda")
        modules = [c.module for c in captured]
        p = self._begin_compile(modules, device)
        with background.locked_scope(scope.active()), \
                (context() if context is not None else contextlib.nullcontext()):
            self._probe_isa(p, device)
            for c in captured:
                shaper = _shaper(self._shapers, c.module, self.plan.family,
                                 self.settings.shape_policy, not self.plan.regional)
                region = shapes.shaped_call(self.entry.compiled, c.module, shaper, p.fast)
                with c.modes():
                    region(*c.args, **c.kwargs)
        self._finish_compile(p, device, where=" in the background")
        return p.new_graphs

    def _swap(self, job) -> None:
        """At a step boundary: the background compile is done; say so, or fall back."""
        self._job, self._bg_done, self.changed = None, True, True
        if job.error is not None and not job.failure:
            # out of memory, an interrupt, a model error: nothing wrong with the compile itself
            self._bg_retry = True
            log.warning("the background compile of %s stopped (%s: %s): it runs eagerly (output "
                        "unchanged) and compiles again at its next sampling run", self.description,
                        type(job.error).__name__, str(job.error).splitlines()[0][:200] if str(job.error) else "")
            return
        if job.error is not None:
            self.entry.failed = self.entry.failed or job.failure
            log.warning("torch.compile failed in the background, so this model keeps running "
                        "eagerly (output unchanged). %s", self.entry.failed)
            return
        self.swapped_at = job.eager_calls + 1
        if job.what == "a new input" and not job.result:
            self._miss_off = True  # told "a compile is needed" where none was: stop asking
            log.info_once("miss-probe-off", "the background compile of a new input of %s compiled "
                          "nothing new; its new inputs now compile on the calling thread",
                          self.description)
        log.info("background compile of %s done in %.1f s; swapped in at model call %d "
                 "(%d call(s) ran eagerly meanwhile)", self.description, job.seconds,
                 job.eager_calls + 1, job.eager_calls)

    def _retry_background(self) -> None:
        """A background compile that stopped on something other than a compile failure
        (``_swap``) starts again with this run's first call."""
        if self._bg_retry and self._job is None:
            self._bg_retry = self._bg_done = False

    def _scope(self, on_cuda: bool) -> tuple[scoped.Scope, dict]:
        """(``scoped.Scope``, PTX env) of a run on CUDA or not: computed on the first
        call (the persistent cache checks its folder then) and kept, unless the cache folder
        could not be used, which the next call tries again."""
        got = self._scopes.get(on_cuda)
        if got is None:
            ptx = warmup.ptx_env(self.settings.experimental_ptx, on_cuda, self.ptx_cache_dir)
            env = {**(self.persistent.env(self.fingerprint) if self.persistent else {}), **ptx}
            headers = self.persistent.header_dir() if self.persistent and not on_cuda and env else None
            knobs = scoped.knobs_for(self.settings, on_cuda)
            knobs["dynamo"].update(FAMILY_DYNAMO_KNOBS.get(self.plan.family, {}))
            got = (scoped.Scope(**knobs, env=env, headers=headers), ptx)
            if env or not self.persistent:
                self._scopes[on_cuda] = got
        return got

    def _precompiled(self) -> precompiled.Precompiled | None:
        """The entry's dynamo-level warm start (``compile_core.cache.precompiled``), where it applies."""
        e = self.entry
        if e.precompiled is None and self.persistent and precompiled.supported(self.settings, self.plan.regional):
            e.precompiled = precompiled.Precompiled(
                self.persistent.inductor_dir(self.fingerprint) / precompiled.DIRNAME,
                self.settings.compile_kwargs())
        elif e.precompiled is None and self.persistent and not torch_compat.load_compiled_function():
            log.info_once("no-saved-regions", "torch %s cannot save and load a compiled function "
                          "(torch.compiler.load_compiled_function), so no saved regions: a restart "
                          "compiles again from the persistent FX-graph cache", torch.__version__)
        return e.precompiled or None

    def _cache_counts(self) -> tuple[int, int, int, int]:
        """(FX-graph cache hits, misses, regions loaded precompiled, regions captured)."""
        fast = self.entry.precompiled
        return (*_fx_cache_counts(), fast.loaded if fast else 0, fast.captured if fast else 0)

    def _before_first_compile(self, device: torch.device) -> None:
        """Warm the local cache from the fleet's shared store (once)."""
        fp, local = self.fingerprint, self.persistent
        if self.fleet and not self.entry.fleet_checked and not local.is_complete(fp):
            self.entry.fleet_checked = True
            self.entry.fleet_hit = self.fleet.fetch_into(fp, device, local.inductor_dir(fp))

    def _note_cache(self, before: tuple[int, int, int, int], device: torch.device) -> None:
        """Record (and log) whether the caches served this compile, and persist it. A region
        loaded precompiled is a hit; one traced and saved is a miss."""
        fx_hits, fx_misses, loaded, captured = (a - b for a, b in zip(self._cache_counts(), before))
        hits, misses = fx_hits + loaded, fx_misses + captured
        e = self.entry
        e.cache_hits += hits
        e.cache_misses += misses
        if self.persistent is None or self.settings.backend != "inductor":
            return
        where = self.persistent.entry_dir(self.fingerprint)
        if hits and not misses:
            log.info("persistent cache hit: %d compiled graph(s) loaded from %s", hits, where)
        else:
            log.info("persistent cache miss (%d hit, %d new): saving to %s", hits, misses, where)
        self.persistent.mark_complete(self.fingerprint, {"regions": self.description})
        if self.fleet and misses:  # this worker built something the fleet may not have
            self.fleet.publish_from(self.fingerprint, device, self.persistent.inductor_dir(self.fingerprint))
        self.persistent.touch(self.fingerprint)
        self.persistent.evict(keep=self.fingerprint)

    def _record(self, seconds: float, new_graphs: int, loaded: int = 0, where: str = "") -> bool:
        e = self.entry
        e.runs += 1
        if not new_graphs:
            return False
        if e.graphs == 0:
            e.first_run_graphs = new_graphs
        e.graphs += new_graphs
        e.compile_seconds += seconds
        what = "compiled" if e.graphs == new_graphs else "recompiled"
        if loaded == new_graphs:
            log.info("loaded %s%s: %d saved region(s), no trace, in %.1f s", self.description, where,
                     loaded, seconds)
        else:
            log.info("%s %s%s: %d graph(s) in %.1f s", what, self.description, where, new_graphs, seconds)
        return True


def prepare(diffusion_model: nn.Module, settings: CompileSettings,
            registry: ReuseRegistry = REGISTRY, ptx_cache_dir: Path | None = None,
            persistent: PersistentCache | None = None, fleet: Fleet | None = None,
            plan: RegionPlan | None = None) -> CompiledModel:
    """Plan regions and find (reuse_if_similar) or build the compiled callable for this model.
    ``plan``: regions chosen by the caller (e.g. ``compile_core.plan.vae``), instead of ``plan_regions``:
    such a plan compiles in the foreground (a VAE's decoder carries state from one chunk's call
    to the next, which an eager first call with its inputs captured would not see the same way)."""
    prewarm.wait()
    if plan is not None and settings.background_compile:
        settings = dataclasses.replace(settings, background_compile=False)
    plan = plan or plan_regions(diffusion_model, settings.blocks_only)
    fp = fingerprint(diffusion_model, plan, settings)
    factory = functools.partial(make_compiled_call, settings)
    unsupported = torch_compat.unsupported()
    if unsupported:
        log.warn_once("torch-unsupported", "%s", unsupported)
        entry, reused = CompiledEntry(fp, None, failed=unsupported), False
    elif settings.reuse_if_similar:
        entry, reused = registry.get_or_create(fp, factory)
    else:
        entry, reused = CompiledEntry(fp, factory()), False
    description = plan.describe(diffusion_model)
    log.info("%s [%s, mode=%s, fingerprint %s]", _prepared(entry, reused, description),
             settings.backend, settings.mode, fp[:12])
    return CompiledModel(settings, plan, entry, reused, description, ptx_cache_dir, persistent, fleet)


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
