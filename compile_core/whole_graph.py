"""After a regional compile, the whole model as one graph, its blocks nested (experimental, #16).

A regional compile leaves the glue between the blocks eager (WAN's text and time embeddings,
its RoPE tables, the head) and makes every block a compiled call of its own. On a small model
that is the steady gap to core's whole-model compile (``benchmarks/results/regional_cpu.md``).
With ``TORCH_COMPILE_SPEED_WHOLE_GRAPH=1`` a regional model whose compile has settled (a model
call that compiled nothing) gets a second compile: the whole diffusion model as one graph, with
each region module's forward as a ``torch.compiler.nested_compile_region`` (torch's hierarchical
compile: dynamo traces one block of a class and reuses the trace for the others, so the compile
grows little with depth).

- It runs on the background worker, only once the sampling run is over and the server is idle
  (``background.defer``). If a prompt comes while it compiles, model calls run the regional
  graphs beside it rather than wait (``beside``).
- From then on, a model call that the whole graph's guards accept runs it. Any other call (a
  new size, a patch the graph did not see) runs the regional graphs as before
  (``RegionalOnMiss``), so the whole graph never compiles on the sampling thread.
- A failed or empty compile leaves the regional graphs in place, with one warning.
- The compile traces a twin of the model (``twin``): the shared model gets the nested forwards
  only for the length of one call on the sampling thread.

Nothing is saved across restarts beyond inductor's own FX-graph cache (in its default folder):
a restarted server takes its saved regions first, and this compile runs again when it is idle.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import types
from typing import Callable, Iterator

import torch
from torch import nn

from . import background, log, shapes, stage_trial, switches, torch_compat, twin
from .regions import WHOLE_MODEL, RegionPlan
from .registry import CompiledEntry

ENV = "TORCH_COMPILE_SPEED_WHOLE_GRAPH"  # operator: "1" on (kept without a trial), "0" off


def wanted(plan: RegionPlan, settings) -> str:
    """For a regional compile: "timed" where the settings node's ``whole_graph`` turns the stage
    on (it stays if its calls time no slower than the regional graphs', ``stage_trial``),
    "forced" where the operator's ``ENV`` is "1" (kept without the trial), "" where it is off
    (the node's option, or ``ENV`` "0")."""
    if not plan.regional or not switches.switch(ENV, settings.whole_graph):
        return ""
    return "forced" if switches.switch(ENV, False) else "timed"


def _nested(forward: Callable, reuse: int) -> Callable:
    """``forward`` as one nested compile region, keeping ``reuse`` traces where this torch can."""
    try:
        return torch.compiler.nested_compile_region(forward, max_reuse_entries=reuse)
    except TypeError:  # a torch without max_reuse_entries
        return torch.compiler.nested_compile_region(forward)


def _region_forward(region: Callable) -> Callable:
    """A region module's forward through ``region``, its first input made contiguous: block 0
    of WAN gets the patch embedding's transposed view, the others a contiguous tensor, and
    torch reuses a nested region's trace only for inputs with the same strides."""
    def forward(self, *args, **kwargs):
        if args and isinstance(args[0], torch.Tensor):
            args = (args[0].contiguous(), *args[1:])
        return region(self, *args, **kwargs)
    return forward


class NestedBlocks:
    """The region modules' forwards as nested compile regions (one per class), while attached.
    One function per class, bound to each module: the graph a twin's compile traced
    (``twin``) takes the original modules with the same function attached."""

    def __init__(self):
        self._regions: dict[type, Callable] = {}
        self._on: list[tuple[nn.Module, Callable]] = []

    def _forward(self, module: nn.Module, count: int) -> Callable:
        cls = type(module)
        if cls not in self._regions:
            self._regions[cls] = _region_forward(_nested(cls.forward, count + 8))
        return types.MethodType(self._regions[cls], module)

    def ours(self, name: str, value: object) -> bool:
        """Whether an instance attribute in ``twin.TRANSIENT`` was attached by a call of ours."""
        if name == "forward":
            return getattr(value, "__func__", None) in self._regions.values()
        return shapes.is_region_call(value)

    @contextlib.contextmanager
    def attached(self, modules: list[nn.Module]) -> Iterator[None]:
        """Inside the block each module's ``forward`` is its nested region (an instance
        attribute, removed after). A module whose forward someone else replaced is left as it is
        (traced inline)."""
        on = [(m, self._forward(m, len(modules))) for m in modules if "forward" not in m.__dict__]
        for m, f in on:
            m.__dict__["forward"] = f
        self._on = on
        try:
            yield
        finally:
            _detach(on)
            self._on = []

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """The modules' own forwards inside the block (the regional graphs must not trace the
        nested ones)."""
        on = self._on
        _detach(on)
        try:
            yield
        finally:
            for m, f in on:
                m.__dict__.setdefault("forward", f)


def _detach(on: list[tuple[nn.Module, Callable]]) -> None:
    """Take the attached forwards off, each only if it is still ours (someone may have set
    their own meanwhile)."""
    for m, f in on:
        if m.__dict__.get("forward") is f:
            del m.__dict__["forward"]


class RegionalOnMiss:
    """The whole graph's ``miss`` (see ``shapes.shaped_call``): a call no graph of it takes runs
    the regional graphs instead, never a compile of the whole model on this thread.

    After a call the whole graph took, the next one goes straight to it with misses refused
    (``torch_compat.misses_refused``): dynamo checks its guards once, and a refused call runs
    the regional graphs. After a refusal, calls are checked ahead (``cached_graph_accepts``)
    until one is taken again, so a run at a size the whole graph lacks pays no refusals.
    Only for a whole graph without graph breaks: there a refused call has run nothing. With a
    break, a refusal in a later frame would come after the code before it had run (a hook's
    counter, say), and the regional graphs would run that code again; such a model's calls
    are always checked ahead."""

    def __init__(self, stage: "WholeGraph", regional, device: torch.device):
        self.stage, self.regional, self.device = stage, regional, device

    def run(self, module, args, kwargs, shaped, shaped_kwargs, fast=None) -> tuple | None:
        stage = self.stage
        out = stage.direct_call(module, shaped, shaped_kwargs) if stage.direct else None
        if out:
            return out
        if out is None and torch_compat.cached_graph_accepts(stage.cm.entry.compiled, module, shaped,
                                                             shaped_kwargs):
            stage.direct = stage.breaks == 0 and not stage.no_refusal
            return None
        stage.regional_calls += 1
        with stage.nested.suspended():
            return (self.regional._run_compiled(module, lambda: nn.Module._call_impl(module, *args, **kwargs),
                                                self.device),)


@dataclasses.dataclass
class WholeGraph:
    """The second stage of one regional ``engine.CompiledModel``."""
    state: str = "waiting"  # -> "queued" -> "ready" | "failed"; "ready" -> "slower" (its trial)
    cm: object = None  # the whole model's CompiledModel, made when its inputs are captured
    job: background.Job | None = None
    run_over: bool = False  # the sampling run that captured the inputs has ended
    nested: NestedBlocks = dataclasses.field(default_factory=NestedBlocks)
    taken: int = 0  # model calls the whole graph ran
    regional_calls: int = 0  # model calls it did not take (they ran the regional graphs)
    direct: bool = False  # the next call goes straight to the graph (``RegionalOnMiss``)
    refusals: int = 0  # calls sent straight to it that it refused
    breaks: int = -1  # graph breaks its compile met (its entry's count; -1: not compiled yet)
    no_refusal: bool = False  # this torch cannot refuse a miss (``torch_compat.refusal_works``)
    trial: stage_trial.Trial | None = None  # its first calls timed against the regional graphs'

    def run(self, regional, dm: nn.Module, call: Callable[[], object], device: torch.device,
            quiet: bool) -> tuple | None:
        """``(output,)`` of a call this stage ran (the whole graph, or the call whose inputs it
        captured); None: the regional path runs it. ``quiet``: the model's previous call
        compiled nothing."""
        if self.state == "queued" and self.job.done.is_set() and not background.busy():
            self._finish(regional)
        if self.state == "ready" and not background.busy():  # (else: as any call beside a compile)
            return (self._run_ready(regional, dm, call, device),)
        if self.state == "waiting" and quiet and _settled(regional):
            return (self._capture(regional, dm, call, device),)
        return None

    def _capture(self, regional, dm, call, device):
        """Run the call on the regional graphs, keeping the diffusion model's inputs, and defer
        the whole graph's compile on them (if the call compiled nothing new)."""
        out, captured = background.capture_eager([dm], lambda: regional._run_compiled(dm, call, device), type)
        if captured and not regional.changed and not regional.entry.failed:
            self._defer(regional, dm, captured, device)
        return out

    def _defer(self, regional, dm, captured: list, device: torch.device) -> None:
        from . import engine
        settings = background.settings_for(dataclasses.replace(
            regional.settings, blocks_only=False, background_compile=True), device)
        entry = CompiledEntry(f"{regional.fingerprint}-whole", engine.make_compiled_call(settings))
        self.cm = engine.CompiledModel(settings, RegionPlan((WHOLE_MODEL,), ""), entry, False,
                                       f"{regional.description} as one graph", regional.ptx_cache_dir)
        blocks, outer = regional.plan.modules(dm), regional._worker_context
        self.run_over = regional._sampling_run == 0
        torch_compat.guard_check()  # (answered now, while nothing compiles: calls beside the job ask it)
        self.job = background.defer(functools.partial(self._compile, captured, device, outer, blocks),
                                    self.cm.description, lambda: self.run_over)
        self.state = "queued"
        log.info("%s: its regional compile has settled; compiling it as one graph (blocks nested) "
                 "in the background once the server is idle", regional.description)

    def _compile(self, captured: list, device: torch.device, outer: Callable | None,
                 blocks: list[nn.Module]) -> int:
        """On the worker: trace a twin of the model (``twin``), its blocks' forwards nested;
        the shared model is left as it is while this compiles."""
        log.info("the server is idle: compiling %s in the background now", self.cm.description)
        (c,) = captured  # the diffusion model's call
        c.module, twins = twin.twin(c.module, blocks, self.nested.ours)
        context = functools.partial(_both, outer, functools.partial(self.nested.attached, twins))
        graphs = self.cm._compile_captured(captured, device, context)
        self.breaks = self.cm.entry.graph_breaks  # (counted by the compile pass: nothing else compiles meanwhile)
        return graphs

    def _finish(self, regional) -> None:
        job, regional.changed = self.job, True
        self.job = None  # (its function holds the captured inputs: on a GPU, a copy of the latent)
        if job.error is not None or not job.result:
            self.state = "failed"
            why = f"{type(job.error).__name__}: {job.error}" if job.error is not None else "it compiled no graph"
            log.warning("the whole-graph compile of %s did not succeed, so it keeps running its regional "
                        "graphs (output unchanged): %s", regional.description, str(why)[:500])
            return
        self.state = "ready"
        log.info("compiled %s in the background in %.1f s; model calls its guards accept run it from "
                 "now on%s", self.cm.description, job.seconds,
                 f" ({self.breaks} graph break(s): each call's guards are checked before it)"
                 if self.breaks else "")

    def direct_call(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
        """``(output,)`` of the whole graph; ``()`` when no graph of it takes the call (it
        then ran nothing); None when it cannot be called straight now (a job is pending, or
        torch sets no stance here): the caller checks the call ahead instead. Only while no
        other compile runs or starts, since misses are refused process-wide meanwhile; the
        refusal is probed there too, on first use."""
        with background.quiet() as quiet:
            if not quiet:
                return None
            if not torch_compat.refusal_works():
                self.direct, self.no_refusal = False, True
                return None
            with torch_compat.misses_refused() as on:
                if on:
                    try:
                        return (self.cm.entry.compiled(module, *args, **kwargs),)
                    except RuntimeError as exc:
                        if not torch_compat.refused(exc):
                            raise
        if not on:
            return None
        self.refusals, self.direct = self.refusals + 1, False
        return ()

    def _run_ready(self, regional, dm, call, device):
        """A call once the whole graph is ready; during its trial, whole and regional calls
        take turns, timed (``stage_trial``)."""
        trial = self.trial
        if trial is None or trial.done:
            return self._run_whole(regional, dm, call, device)
        if trial.regional_turn():
            out, seconds = trial.timed(device, lambda: regional._run_compiled(dm, call, device))
            if not regional.changed:  # (a call that compiled or loaded a graph is not a step's time)
                trial.add(False, seconds)
            return out
        before = self.regional_calls
        out, seconds = trial.timed(device, lambda: self._run_whole(regional, dm, call, device))
        if self.state == "ready" and self.regional_calls == before and trial.add(True, seconds):
            self._judge(regional)
        return out

    def _judge(self, regional) -> None:
        """The trial is over: keep the whole graph, or let it go if it was slower."""
        r = self.trial.report()
        times = (f"its fastest of {stage_trial.SAMPLES} model calls took {r['whole_ms']:.1f} ms on the whole graph "
                 f"and {r['regional_ms']:.1f} ms on the regional graphs ({r['ratio']:.2f}x)")
        regional.changed = True
        if self.trial.keep:
            log.info("%s: %s, so the whole graph takes the calls its guards accept from now on",
                     regional.description, times)
            return
        self.state, self.cm = "slower", None
        log.info("%s: %s; the whole graph is slower here, so it is let go and the regional graphs "
                 "run from now on", regional.description, times)

    def _run_whole(self, regional, dm, call, device):
        from . import engine
        cm = self.cm
        scope, _ = cm._scope(device.type == "cuda")
        miss = RegionalOnMiss(self, regional, device)
        before = self.regional_calls
        try:
            with scope.active(), self.nested.attached(regional.plan.modules(dm)), \
                    engine.attached([dm], cm.entry.compiled, "", cm.settings.shape_policy, True, None,
                                    cm._shapers, miss):
                out = call()
        except torch.OutOfMemoryError as exc:
            if self.regional_calls != before:  # the regional graphs ran out: not this stage's doing
                raise
            return self._out_of_memory(regional, dm, call, device, exc)
        self.taken += self.regional_calls == before
        return out

    def _out_of_memory(self, regional, dm, call, device, exc):
        """The whole graph needs more memory than this device has left: it is dropped, and
        the call runs again on the regional graphs (a model call changes no state)."""
        self.state, self.cm, regional.changed = "failed", None, True
        log.warning("the whole graph of %s ran out of memory, so it keeps running its regional "
                    "graphs (output unchanged): %s", regional.description, str(exc)[:300])
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return regional._run_compiled(dm, call, device)


def of(entry: CompiledEntry, how: str) -> WholeGraph:
    """The stage of a compiled entry, made on first use: every Apply that reuses the entry
    (a re-run node, a clone) shares its whole graph, as it shares its regional graphs.
    ``how``: ``wanted``'s answer (the first Apply's decides whether it has a trial)."""
    if entry.whole is None:
        entry.whole = WholeGraph(trial=stage_trial.Trial() if how == "timed" else None)
    return entry.whole


def _settled(regional) -> bool:
    """Compiled, nothing pending, not failed, and no compile queued anywhere."""
    return (regional.entry.graphs > 0 and not regional.entry.failed and regional._job is None
            and regional._ran and not background.busy())


@contextlib.contextmanager
def _both(outer: Callable | None, inner: Callable) -> Iterator[None]:
    with (outer() if outer is not None else contextlib.nullcontext()), inner():
        yield
