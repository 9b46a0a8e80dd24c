"""The background route: the first call runs eagerly and queues the compile on the worker; the
calls after it run eagerly until the compile is swapped in at a model call boundary. While the
worker compiles another model (WAN 2.2's two models, say), a compiled model's calls run eagerly
too: nothing on the sampling thread waits for a compile, and none compiles there."""
from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Callable, Iterator

import torch
from torch import nn

from . import background, compile_pass
from .attach import region_variant
from .state import ModelState
from ..plan import shapes
from ..report import log
from ..torch_support import hooks


class Background:
    def __init__(self, state: ModelState):
        self.state = state
        self.job: background.Job | None = None  # the background compile pending for this model
        self.done = False  # its background compile ran (a model call never starts two)
        self.retry = False  # it stopped on something other than a compile failure: try again
        self.foreground_depth = 0  # inside ``CompiledModel.foreground()``: compile on the caller's thread
        self.swapped_at: int | None = None  # the model call at which the compile took over
        self.worker_context: Callable | None = None  # of the current call (see ``CompiledModel.run``)
        self.captured: tuple | None = None  # (captured region calls, worker context) the queued job takes
        # called on the worker when a background compile of this model is done (the bridge sends
        # the badge's status: a CPU model's compile ends when the server is idle, and no model
        # call would send it then)
        self.on_done: Callable[[], None] | None = None

    @property
    def active(self) -> bool:
        return self.state.settings.background_compile and not self.foreground_depth

    @property
    def compiling(self) -> bool:
        return self.job is not None and not self.job.done.is_set()

    @property
    def held(self) -> bool:
        """Its compile waits for the server to be idle (``background``)."""
        job = self.job
        return job is not None and job.yields and not job.started.is_set()

    def run(self, diffusion_model: nn.Module, call: Callable[[], object], device: torch.device) -> tuple | None:
        """``(output,)`` of a call that ran eagerly while a compile is pending (this model's or
        another's), or None when the call takes the compiled route (the job is done and swapped
        in here, or was before)."""
        if not self.active:
            return None
        job = self.job
        if not self.state.sampling_run:  # (outside a sampling run: each call is a run of its own)
            self.retry_stopped()
        if self.retry:  # its compile stopped (``swap``): eagerly until the next run
            return (call(),)
        if job is None and self.state.entry.graphs == 0 and not self.done:
            return (self._start(diffusion_model, call, device),)
        # swap only once the worker is idle: another model's compile scope may still hold the
        # process-wide cache environment
        if job is not None and job.done.is_set() and not background.busy():
            self.swap(job)
            return (call(),) if self.state.entry.failed or self.retry else None
        if job is not None and not job.done.is_set():  # this model's compile runs: eagerly
            job.eager_calls += 1
            return (self._eager_beside(call, device),)
        if background.busy():  # another model's compile runs (its scope is process-wide): eagerly
            background.note_beside(self.state.description)
            return (self._eager_beside(call, device),)
        return None

    def _eager_beside(self, call: Callable[[], object], device: torch.device):
        """The call, eagerly, beside the worker's compile. Out of memory beside it (on a GPU
        the compile runs the model once on the same device): it waits for that compile, then
        runs again, alone (a model call changes no state), so the prompt completes."""
        try:
            return background.eager_beside_worker(call)
        except torch.OutOfMemoryError as exc:
            log.warning("%s ran out of memory beside a background compile; it runs again once that "
                        "compile is done: %s", self.state.description,
                        str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__)
            background.wait_idle()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            return call()

    @contextlib.contextmanager
    def in_foreground(self) -> Iterator[None]:
        """Compile on the calling thread inside the block: a pending compile is finished (and
        swapped in) first."""
        self.foreground_depth += 1
        try:
            if background.busy():
                background.wait_idle()
            if self.job is not None:
                self.swap(self.job)
            yield
        finally:
            self.foreground_depth -= 1

    def _start(self, diffusion_model, call, device):
        """Run this call eagerly, keeping each region's first inputs, and queue their compile."""
        modules = self.state.plan.modules(diffusion_model)
        out, captured = background.capture_eager(modules, call, region_variant)
        if not captured:  # nothing reached the regions: compile in the foreground next call
            self.done = True
            return out
        self.queue(captured, device)
        log.info("compiling %s in the background; the model runs eagerly until it is ready",
                 self.state.description)
        return out

    def queue(self, captured: list, device: torch.device) -> None:
        """Queue the compile of ``captured`` on the worker (this call ran them eagerly). A CPU
        model's compile waits for an idle server (``background``), unless its regions are saved (loading
        them takes a fraction of a second)."""
        fast = self.state.precompiled()
        yields = device.type == "cpu" and not (fast and fast.saved([c.module for c in captured], device))
        if not yields:  # here, before the worker starts (see ``hooks``); a job that waits for
            hooks.warm_fx_tracers()  # an idle server does it there, with no step beside it
        self.captured = (captured, self.worker_context)
        ref = weakref.ref(self)
        self.job = background.submit(functools.partial(_queued_compile, ref, device),
                                     self.state.description, yields=yields)
        self.job.eager_calls, self.state.changed = 1, True
        self.job.on_done = functools.partial(_background_done, ref)
        if yields:
            log.info("%s runs on the CPU, whose cores its eager steps use: its background "
                     "compile starts once the server is idle", self.state.description)

    def compile_captured(self, captured: list, device: torch.device, context=None) -> int:
        """On the worker: compile each captured region by calling it, compiled, on its inputs
        (the same scope, shapes, saved regions and caches as a foreground compile), inside
        ``context()``. Returns the number of graphs it compiled, traced or loaded."""
        hooks.warm_fx_tracers()  # (once a process: a no-op unless the job waited for an idle server)
        s = self.state
        scope, _ = s.scope(device.type == "cuda")
        p = compile_pass.begin(s, [c.module for c in captured], device)
        with background.locked_scope(scope.active()), \
                (context() if context is not None else contextlib.nullcontext()):
            for c in captured:
                region = shapes.shaped_call(s.entry.compiled, c.module, s.shaper(c.module), p.fast)
                with c.modes():
                    region(*c.args, **c.kwargs)
        compile_pass.finish(s, p, device, where=" in the background")
        return p.new_graphs

    def swap(self, job) -> None:
        """At a step boundary: the background compile is done; say so, or fall back."""
        s = self.state
        self.job, self.done, s.changed = None, True, True
        if job.error is not None and not job.failure:
            # out of memory, an interrupt, a model error: nothing wrong with the compile itself
            self.retry = True
            log.warning("the background compile of %s stopped (%s: %s): it runs eagerly (output "
                        "unchanged) and compiles again at its next sampling run", s.description,
                        type(job.error).__name__, str(job.error).splitlines()[0][:200] if str(job.error) else "")
            return
        if job.error is not None:
            s.entry.failed = s.entry.failed or job.failure
            log.warning("torch.compile failed in the background, so this model keeps running "
                        "eagerly (output unchanged). %s", s.entry.failed)
            return
        self.swapped_at = job.eager_calls + 1
        log.info("background compile of %s done in %.1f s; swapped in at model call %d "
                 "(%d call(s) ran eagerly meanwhile)", s.description, job.seconds,
                 job.eager_calls + 1, job.eager_calls)

    def retry_stopped(self) -> None:
        """A background compile that stopped on something other than a compile failure
        (``swap``) starts again with this run's first call."""
        if self.retry and self.job is None:
            self.retry = self.done = False


def _queued_compile(ref: "weakref.ref[Background]", device: torch.device) -> int:
    """A queued background compile: it reaches its model only through ``ref``, so a job that
    waits (for the server to be idle, or behind another) keeps nothing alive, and one whose
    model ComfyUI let go is dropped."""
    route = ref()
    if route is None or route.captured is None:
        log.info("a queued background compile was dropped: its model is gone")
        return 0
    (captured, context), route.captured = route.captured, None
    return route.compile_captured(captured, device, context)


def _background_done(ref: "weakref.ref[Background]") -> None:
    """On the worker, once the job is done: say so (no model call may come for a while) and
    tell the host (the badge)."""
    route = ref()
    if route is None:
        return
    job = route.job
    if job is not None:
        waited = f" (after {job.waited_s:.1f} s waiting for an idle server)" if job.waited_s >= 0.1 else ""
        log.info("background compile of %s finished in %.1f s%s; the model's next call %s",
                 route.state.description, job.seconds, waited,
                 "takes the compiled graphs" if job.error is None else "says what happened")
    if route.on_done is not None:
        route.on_done()
