"""Why compile is slow, breaking or recompiling, measured in the running process.

Users should not need to relaunch with ``TORCH_LOGS`` to learn this. Everything here is
plain torch (no ComfyUI): the node hands over two callables (one eager model step, one
compiled model step) and the ``CompiledModel``, and gets back a ``Report``:

- regions compiled, and the compile time of every frame dynamo compiled for them;
- graph breaks, each with its reason and the user file:line, found by tracing one module of
  each region type on the inputs captured from a real eager call (what
  ``torch._dynamo.explain`` does, minus its ``torch._dynamo.reset()``, which would throw away
  every compiled graph in the process);
- recompiles, each with the guard that failed and what usually causes it;
- in-process reuse and persistent cache hits;
- eager vs compiled step time: one warm-up call of each first (the compiled one includes the
  compile, reported on its own), then alternating calls, compared by median;
- a one-line verdict.
"""
from __future__ import annotations

import dataclasses
import os
import re
from typing import Callable

import torch
from torch import nn

from .graph_breaks import GraphBreak, capture_inputs, find_graph_breaks, one_per_type
from ..torch_support import scoped
from ..torch_support.longpaths import on_windows
from ..plan import knobs
from ..report.recompiles import Recompile, recompiles_from
from ..report.status import status_payload
from ..report.timing import Timing, _cuda, measure


@dataclasses.dataclass
class Report:
    regions: str = ""
    region_count: int = 0
    regional: bool = True
    backend: str = ""
    mode: str = ""
    shape_policy: str = ""
    state: str = ""                 # compile_core.report.status state
    failed: str = ""                # compile abandoned (runs eagerly): the reason
    reused: bool = False            # compiled work found in this server (reuse_if_similar)
    compile_seconds: float = 0.0    # entry total
    frames: list[dict] = dataclasses.field(default_factory=list)
    new_frames_from: int | None = None
    graph_breaks: list[GraphBreak] | None = None  # None: not analysed
    breaks_note: str = ""
    recompiles: list[Recompile] = dataclasses.field(default_factory=list)
    persistent: bool = False
    cache_hits: int = 0
    cache_misses: int = 0
    timing: Timing | None = None
    timing_note: str = ""           # why there is no timing, or what was measured on
    auto_disable_requested: bool = False
    auto_disabled: bool = False
    path_roots: tuple[str, ...] = ()
    compile_threads: int | None = None  # inductor's; torch forces 1 on Windows

    # -- decisions
    @property
    def break_count(self) -> int | None:
        return None if self.graph_breaks is None else len(self.graph_breaks)

    @property
    def resume_frames(self) -> int:
        """Compiled frames that continue after a graph break (dynamo's ``resume_in`` code)."""
        return sum(1 for f in self.frames if str(f.get("frame", "")).startswith(RESUME_PREFIX))

    def verdict(self) -> str:
        if self.failed:
            head = "compile failed, so the model runs eagerly"
        elif self.timing is None:
            head = "step time not measured"
        elif self.timing.speedup >= 1.0:
            head = f"compiled is {self.timing.speedup:.2f}x faster"
        else:
            head = f"compiled is slower ({self.timing.speedup:.2f}x)"
        n = self.break_count
        parts = [head, "graph breaks not analysed" if n is None else _plural(n, "graph break"),
                 _plural(len(self.recompiles), "recompile")]
        text = "; ".join(parts)
        if self.auto_disabled:
            text += " — auto-disabled: eager model returned"
        elif self.auto_disable_requested and self.timing is not None and not self.failed:
            text += " — kept compiled (not slower)"
        return text

    def status_fields(self) -> dict:
        """Extra keys for the status event (the Apply node badge shows ``speedup``)."""
        t = self.timing
        return {"speedup": round(t.speedup, 3) if t else None,
                "eager_ms": round(t.eager_median_ms, 3) if t else None,
                "compiled_ms": round(t.compiled_median_ms, 3) if t else None,
                "graph_breaks": self.break_count,
                "auto_disabled": self.auto_disabled,
                "verdict": self.verdict()}

    # -- text
    def short(self, text: str) -> str:
        """Source paths in ``text`` shortened: relative to a known root (the ComfyUI dir, the
        working dir), or to site-packages; relative paths dynamo printed are matched too."""
        roots = list(dict.fromkeys(r.rstrip(os.sep) for r in (*self.path_roots, os.getcwd()) if r))
        return _PATH_AT_LINE.sub(lambda m: _short_path(m.group(0), roots), text)

    def render(self) -> str:
        s = self.short
        lines = [f"Torch Compile Diagnostics: {self.regions or '?'} "
                 f"[{self.backend}, mode {self.mode}, shape_policy {self.shape_policy}]",
                 f"Verdict: {self.verdict()}", ""]
        kind = (f"regional: {self.region_count} module(s), identical blocks share one graph"
                if self.regional else "whole diffusion model")
        lines.append(f"Regions compiled: {self.regions} ({kind})")
        if self.failed:
            lines.append(f"Compile failed, so the model runs eagerly: {self.failed}")

        lines.append(f"Compile time: {self.compile_seconds:.2f} s in total, "
                     f"{_plural(len(self.frames), 'compiled frame')}"
                     + (" (in-process reuse: compiled before this Apply)" if self.reused and not
                        self.frames else ""))
        for i, f in enumerate(self.frames):
            if i == MAX_FRAME_LINES:
                lines.append(f"  ... and {len(self.frames) - i} more")
                break
            tag = []
            if f.get("recompile_reason"):
                tag.append("recompile")
            if self.new_frames_from is not None and i >= self.new_frames_from:
                tag.append("during this diagnosis")
            lines.append(f"  {s(f.get('frame', '?'))}: {float(f.get('seconds') or 0):.2f} s"
                         + (f" ({', '.join(tag)})" if tag else ""))

        if self.backend == "inductor" and self.compile_threads == 1:
            lines.append(f"Kernel compiles: one at a time ({_threads_reason()}), so a cold compile "
                         "takes longer here; persistent and fleet cache hits skip that work")
        if self.graph_breaks is None:
            n = self.resume_frames
            lines.append("Graph breaks: not analysed" + (f" ({self.breaks_note})" if self.breaks_note else "")
                         + (f"; {_plural(n, 'compiled frame')} resume after a graph break" if n else ""))
        else:
            cuts = sum(b.splits for b in self.graph_breaks)
            lines.append(f"Graph breaks: {len(self.graph_breaks)}"
                         + (f" ({self.breaks_note}" if self.breaks_note else " (")
                         + (f"; {cuts} graph cuts in all, a break inside nested calls cuts each "
                            "caller too)" if cuts != len(self.graph_breaks) else ")"))
            for i, b in enumerate(self.graph_breaks, 1):
                lines.append(f"  {i}. {s(b.where)} [{b.region}]")
                lines.append(f"     reason: {b.summary}")
                if b.inside:
                    lines.append(f"     inside: {s(b.inside)}")
                if b.callers:
                    lines.append(f"     called from: {' <- '.join(s(f) for f in b.callers)}")
        lines.append(f"Recompiles: {len(self.recompiles)}")
        for i, r in enumerate(self.recompiles, 1):
            lines.append(f"  {i}. {s(r.frame)} ({r.seconds:.2f} s"
                         + (", during this diagnosis" if r.during_diagnosis else "") + ")")
            lines.append(f"     guard: {r.guard}" + (f"  (at {s(r.source)})" if r.source else ""))
            if r.hint:
                lines.append(f"     likely cause: {r.hint}")

        reuse = ("reused compiled work already built in this server (reuse_if_similar)"
                 if self.reused else "compiled for this Apply (nothing to reuse in this server)")
        if self.backend != "inductor":
            persist = f"not used (backend {self.backend} builds no inductor code)"
        elif not self.persistent:
            persist = "off"
        elif self.cache_hits or self.cache_misses:
            persist = f"{self.cache_hits} hit(s), {self.cache_misses} miss(es)"
        else:
            persist = "not consulted yet (nothing compiled since this model was applied)"
        lines.append(f"Caches (status {self.state or '?'}): in-process: {reuse}; "
                     f"persistent inductor cache: {persist}")

        t = self.timing
        if t is None:
            lines.append(f"Step time: skipped ({self.timing_note or 'no inputs'})")
        else:
            lines.append(f"Step time ({self.timing_note}; {len(t.eager_ms)} alternating call(s) each, "
                         "median after one warm-up call of each):")
            lines.append(f"  eager     {t.eager_median_ms:9.2f} ms  (min {min(t.eager_ms):.2f}, "
                         f"max {max(t.eager_ms):.2f}; warm-up {t.eager_warmup_s * 1000:.1f} ms)")
            lines.append(f"  compiled  {t.compiled_median_ms:9.2f} ms  (min {min(t.compiled_ms):.2f}, "
                         f"max {max(t.compiled_ms):.2f}; first call incl. any compile "
                         f"{_seconds(t.compiled_warmup_s)})")
            lines.append(f"  ratio     {t.speedup:.2f}x (eager / compiled)")
            if t.eager_peak_mib is not None:
                lines.append(f"Peak memory: eager {t.eager_peak_mib:.0f} MiB, compiled "
                             f"{t.compiled_peak_mib:.0f} MiB ({t.memory_note})")
            else:
                lines.append(f"Peak memory: {t.memory_note}")
        return "\n".join(lines)


MAX_FRAME_LINES = 40
RESUME_PREFIX = "torch_dynamo_resume_in_"
# a path before ":<line>", a Windows drive letter (C:\ or C:/) included
_PATH_AT_LINE = re.compile(r"(?:[A-Za-z]:(?=[\\/]))?[^\s:()\[\]'\"]+\.py(?=:\d+)")


def _short_path(path: str, roots: list[str]) -> str:
    """``roots`` in order of preference (the ComfyUI dir before the working dir)."""
    if os.path.isabs(path):
        i = path.rfind(f"{os.sep}site-packages{os.sep}")
        if i >= 0:
            return path[i + len(f"{os.sep}site-packages{os.sep}"):]
        for root in roots:
            if path.startswith(root + os.sep):
                return path[len(root) + 1:]
        return path
    parts = path.split(os.sep)
    for root in roots:  # e.g. ".host/comfyui/comfy/a.py", printed relative to another dir
        for i in range(len(parts) - 1):
            if os.path.isfile(os.path.join(root, *parts[i:])):
                return os.path.join(*parts[i:])
    return path


def _threads_reason() -> str:
    if os.environ.get("TORCHINDUCTOR_COMPILE_THREADS", "").strip():
        return "TORCHINDUCTOR_COMPILE_THREADS sets inductor's compile_threads to 1"
    if on_windows():
        return "inductor's compile_threads is 1: torch forces it on Windows"
    return "inductor's compile_threads is 1"


def _compile_threads() -> int | None:
    try:
        from torch._inductor import config as inductor_config
        return inductor_config.compile_threads
    except Exception:  # noqa: BLE001 - no inductor: nothing to say
        return None


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _seconds(s: float) -> str:
    return f"{s * 1000:.1f} ms" if s < 1 else f"{s:.2f} s"


def should_auto_disable(timing: Timing | None, enabled: bool, threshold: float = 1.0) -> bool:
    """Return the eager model when asked to and compiled was measured slower than eager."""
    return bool(enabled and timing is not None and timing.speedup < threshold)


def diagnose(compiled_model, diffusion_model: nn.Module, eager: Callable[[], object],
             compiled: Callable[[], object], runs: int, device: torch.device | None = None,
             inputs_note: str = "", auto_disable: bool = False,
             path_roots: tuple[str, ...] = (),
             reraise: tuple[type[BaseException], ...] = (),
             check_interrupt: Callable[[], None] | None = None) -> Report:
    """Everything in the module docstring, for one ``engine.CompiledModel``.

    ``eager``/``compiled``: one model step each on the same inputs (the compiled one through
    ``CompiledModel.run``). A model call that fails (e.g. on inputs guessed for a family
    without a recipe) skips the timing, with the error in the report, instead of failing the
    workflow; ``reraise`` lists exceptions that must propagate (ComfyUI's interrupt).
    ``check_interrupt`` (the host's cancel check) is called between model calls and before each
    graph-break trace; what it raises propagates, so a cancel stops the diagnosis promptly."""
    cm = compiled_model
    e = cm.entry
    frames_before = len(e.frames)
    rep = Report(regions=cm.description, region_count=len(cm.plan.paths), regional=cm.plan.regional,
                 backend=cm.settings.backend, mode=cm.settings.mode,
                 shape_policy=cm.settings.shape_policy, reused=cm.reused,
                 persistent=cm.persistent is not None, auto_disable_requested=auto_disable,
                 path_roots=path_roots, compile_threads=_compile_threads())

    targets = one_per_type(cm.plan.modules(diffusion_model))
    captured: dict = {}
    try:
        with capture_inputs(targets) as captured:
            eager()  # the inputs each region type really gets, from one real eager step
        rep.timing = measure(eager, compiled, runs, device, check_interrupt=check_interrupt)
        rep.timing_note = inputs_note or "measured"
    except Exception as exc:  # noqa: BLE001 - reported; sampling is what must work
        if isinstance(exc, reraise):
            raise
        rep.timing_note = f"the model call failed ({inputs_note}): {_one_line(exc)}"

    if e.failed:
        rep.breaks_note = "compile failed, nothing to trace"
    elif not captured:
        rep.breaks_note = "no real inputs were captured for the regions"
    else:
        breaks: list[GraphBreak] = []
        notes = []
        on_cuda = _cuda(device)
        for i, module in enumerate(targets):
            if i not in captured:
                notes.append(f"{type(module).__name__} was not called")
                continue
            args, kwargs = captured[i]
            if check_interrupt is not None:
                check_interrupt()
            try:
                with scoped.scoped_state(**knobs.knobs_for(cm.settings, on_cuda)):
                    breaks += find_graph_breaks(module, args, kwargs)
            except Exception as exc:  # noqa: BLE001
                if isinstance(exc, reraise):
                    raise
                notes.append(f"tracing {type(module).__name__} failed: {_one_line(exc)}")
        names = ", ".join(type(m).__name__ for i, m in enumerate(targets) if i in captured)
        rep.graph_breaks = breaks
        rep.breaks_note = "; ".join([f"traced {names} on inputs from a real eager call"] + notes)

    rep.state = _state(cm)
    rep.failed = e.failed
    rep.compile_seconds = e.compile_seconds
    rep.frames = list(e.frames)
    rep.new_frames_from = frames_before if len(e.frames) > frames_before else None
    rep.recompiles = recompiles_from(rep.frames, rep.new_frames_from)
    rep.cache_hits, rep.cache_misses = e.cache_hits, e.cache_misses
    rep.auto_disabled = should_auto_disable(rep.timing, auto_disable) and not e.failed
    return rep


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:200]}" if text else type(exc).__name__


def _state(cm) -> str:
    return status_payload(cm)["state"]
