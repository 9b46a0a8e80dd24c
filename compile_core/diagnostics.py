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

import contextlib
import dataclasses
import os
import re
import statistics
import sys
import time
import types
from typing import Callable, Iterator

import torch
from torch import nn

# --------------------------------------------------------------------------- step timing


@dataclasses.dataclass
class Timing:
    """Milliseconds per call of each variant (measured calls only, warm-ups excluded)."""
    eager_ms: list[float]
    compiled_ms: list[float]
    eager_warmup_s: float
    compiled_warmup_s: float  # the first compiled call: includes compiling when it compiled
    eager_peak_mib: float | None = None
    compiled_peak_mib: float | None = None
    memory_note: str = ""

    @property
    def eager_median_ms(self) -> float:
        return statistics.median(self.eager_ms)

    @property
    def compiled_median_ms(self) -> float:
        return statistics.median(self.compiled_ms)

    @property
    def speedup(self) -> float:
        """Eager median / compiled median: above 1 means compiled is faster."""
        c = self.compiled_median_ms
        return self.eager_median_ms / c if c > 0 else float("inf")


def _cuda(device) -> bool:
    return device is not None and torch.device(device).type == "cuda"


def measure(eager: Callable[[], object], compiled: Callable[[], object], runs: int,
            device: torch.device | None = None,
            clock: Callable[[], float] = time.perf_counter) -> Timing:
    """Warm up each variant once, then call them alternately ``runs`` times each.

    The order flips every round (E C, C E, ...) so slow drift (thermal, another process)
    hits both equally; the medians ignore a stray slow call. On CUDA every call is
    synchronised and the peak allocated memory of the measured calls is kept per variant."""
    if runs < 1:
        raise ValueError("runs must be at least 1")
    on_cuda = _cuda(device)

    def sync():
        if on_cuda:
            torch.cuda.synchronize(device)

    def timed(call) -> float:
        sync()
        start = clock()
        call()
        sync()
        return clock() - start

    eager_warm = timed(eager)
    compiled_warm = timed(compiled)
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    peaks: dict[str, float] = {"eager": 0.0, "compiled": 0.0}
    calls = {"eager": eager, "compiled": compiled}
    for i in range(runs):
        for name in (("eager", "compiled") if i % 2 == 0 else ("compiled", "eager")):
            if on_cuda:
                torch.cuda.reset_peak_memory_stats(device)
            times[name].append(timed(calls[name]) * 1000.0)
            if on_cuda:
                peaks[name] = max(peaks[name], torch.cuda.max_memory_allocated(device) / 2**20)
    timing = Timing(times["eager"], times["compiled"], eager_warm, compiled_warm)
    if on_cuda:
        timing.eager_peak_mib, timing.compiled_peak_mib = peaks["eager"], peaks["compiled"]
        timing.memory_note = "peak allocated by torch during the measured calls (CUDA)"
    else:
        timing.memory_note = ("not measured on CPU: torch has no per-call CPU allocator peak"
                              + _rss_note())
    return timing


def _rss_note() -> str:
    try:
        import resource
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    except (ImportError, OSError):
        return ""
    mib = peak / 1024 if sys.platform != "darwin" else peak / 2**20  # KiB on Linux, bytes on macOS
    return f" (peak RSS of the whole process so far: {mib:.0f} MiB)"


# --------------------------------------------------------------------------- graph breaks


@dataclasses.dataclass
class GraphBreak:
    """One place where dynamo had to cut the graph, seen from the outermost traced frame."""
    reason: str                 # dynamo's reason text (first line: what; then Explanation/Hints)
    where: str                  # "file:line in function": innermost frame of user (model) code
    inside: str = ""            # innermost frame, when that is library code (torch, site-packages)
    stack: list[str] = dataclasses.field(default_factory=list)  # all frames, outermost first
    splits: int = 1             # frames cut by it (a break in nested calls cuts each caller too)
    region: str = ""            # the region type it was found in

    @property
    def summary(self) -> str:
        """The first line of the reason, plus dynamo's one-line Explanation when it has one."""
        lines = [ln.strip() for ln in self.reason.splitlines() if ln.strip()]
        if not lines:
            return "(no reason given)"
        out = lines[0]
        for ln in lines[1:]:
            if ln.startswith("Explanation:"):
                out += " - " + ln[len("Explanation:"):].strip()
                break
        return out

    @property
    def callers(self) -> list[str]:
        """The frames that led to ``where``, innermost first."""
        try:
            i = self.stack.index(self.where)
        except ValueError:
            return []
        return list(reversed(self.stack[:i]))


def _library_dirs() -> tuple[str, ...]:
    import sysconfig
    paths = sysconfig.get_paths()
    dirs = {_TORCH_DIR, paths.get("stdlib", ""), paths.get("platstdlib", "")}
    return tuple(sorted(d.rstrip(os.sep) + os.sep for d in dirs if d))


_TORCH_DIR = os.path.dirname(torch.__file__)
_LIBRARY_DIRS = _library_dirs()


def is_library(filename: str) -> bool:
    """torch, the standard library and installed packages: not the model's own code."""
    return (filename.startswith(_LIBRARY_DIRS) or f"{os.sep}site-packages{os.sep}" in filename
            or f"{os.sep}dist-packages{os.sep}" in filename)


def _frame_text(fs) -> str:
    return f"{fs.filename}:{fs.lineno} in {fs.name}"


def _user_frame(stack):
    """The innermost frame of user code; else the innermost outside torch; else the innermost."""
    for keep in (lambda f: not is_library(f.filename),
                 lambda f: not f.filename.startswith(_TORCH_DIR + os.sep)):
        for fs in reversed(stack):
            if keep(fs):
                return fs
    return stack[-1] if stack else None


def breaks_from_records(records, region: str = "") -> list[GraphBreak]:
    """Graph breaks from dynamo's ``GraphCompileReason`` records (``.reason``, ``.user_stack``).

    A break inside nested calls is recorded once per frame it cuts (the caller breaks at the
    call, then the callee, ...); those records' stacks are suffixes of the outermost one, so
    they are folded into it and counted in ``splits``."""
    items = []
    for index, r in enumerate(records):
        frames = list(getattr(r, "user_stack", None) or [])
        key = tuple((f.filename, f.lineno, f.name) for f in frames)
        items.append((str(getattr(r, "reason", "") or ""), key, frames, index))
    kept: list[list] = []  # [reason, key, frames, first index, splits]
    for reason, key, frames, index in sorted(items, key=lambda it: (-len(it[1]), it[3])):
        for k in kept:
            if k[0] == reason and k[1][len(k[1]) - len(key):] == key:
                k[3], k[4] = min(k[3], index), k[4] + 1
                break
        else:
            kept.append([reason, key, frames, index, 1])
    out = []
    for reason, _key, frames, _index, splits in sorted(kept, key=lambda k: k[3]):  # as they ran
        user = _user_frame(frames)
        inner = frames[-1] if frames else None
        out.append(GraphBreak(
            reason=reason, where=_frame_text(user) if user is not None else "(unknown location)",
            inside=_frame_text(inner) if inner is not None and inner is not user else "",
            stack=[_frame_text(f) for f in frames], splits=splits, region=region))
    return out


def _fresh_function(fn: Callable) -> Callable:
    """``fn`` with a code object of its own, so dynamo's cache entries for it die with it."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__,
                              fn.__defaults__, fn.__closure__)


def find_graph_breaks(module: nn.Module, args: tuple, kwargs: dict) -> list[GraphBreak]:
    """Trace ``module(*args, **kwargs)`` with dynamo and return its graph breaks.

    This is ``torch._dynamo.explain``'s mechanism (a backend that collects each graph's
    ``compile_subgraph_reason``) without its two ``torch._dynamo.reset()`` calls: those drop
    every compiled graph in the process, so the next sampling run would compile everything
    again. The call really runs (its graphs run as plain FX code). Frames dynamo compiles for
    it keep a cache entry for this backend only; the pack's compiled runs never use it."""
    import inspect

    records = []

    def collect(gm, example_inputs):
        reason = getattr(gm, "compile_subgraph_reason", None)
        if reason is not None and reason.graph_break:
            records.append(reason)
        return gm.forward

    def target(*a, **k):
        return module(*a, **k)

    kw = {"backend": collect, "fullgraph": False, "dynamic": False}
    if "isolate_recompiles" in inspect.signature(torch.compile).parameters:
        kw["isolate_recompiles"] = True  # its own recompile budget, never the pack's
    before = _break_counts()
    torch.compile(_fresh_function(target), **kw)(*args, **kwargs)
    region = type(module).__name__
    out = breaks_from_records(records, region)
    # A break with nothing traced before it in its frame compiles no graph, so the backend
    # never sees it; dynamo's counters still do (by reason, without a location).
    seen = {b.reason for b in out}
    for reason, n in _break_counts().items():
        if n > before.get(reason, 0) and reason not in seen:
            out.append(GraphBreak(reason=reason, where=UNLOCATED, region=region))
    return out


UNLOCATED = "(location not recorded: nothing was traced before this break in its frame)"


def _break_counts() -> dict[str, int]:
    from torch._dynamo.utils import counters
    return {str(k): int(v) for k, v in counters["graph_break"].items()}


@contextlib.contextmanager
def capture_inputs(modules: list[nn.Module]) -> Iterator[dict]:
    """Record the ``(args, kwargs)`` of the first call of each module while the block runs.

    Yields ``{module_index: (args, kwargs)}``. The hooks are removed on exit: a hook left on a
    region would be traced into (and guarded by) the compiled graph."""
    captured: dict[int, tuple[tuple, dict]] = {}
    handles = []

    def hook_for(i):
        def hook(mod, args, kwargs):
            captured.setdefault(i, (tuple(args), dict(kwargs)))
        return hook

    try:
        for i, m in enumerate(modules):
            handles.append(m.register_forward_pre_hook(hook_for(i), with_kwargs=True))
        yield captured
    finally:
        for h in handles:
            h.remove()


def one_per_type(modules: list[nn.Module]) -> list[nn.Module]:
    """The first module of each class (identical blocks share code, so share graph breaks)."""
    seen, out = set(), []
    for m in modules:
        if type(m) not in seen:
            seen.add(type(m))
            out.append(m)
    return out


# --------------------------------------------------------------------------- recompiles

# (substring of the failed guard, what usually causes it); first match wins.
RECOMPILE_HINTS: tuple[tuple[str, str], ...] = (
    ("weight_function", "LoRA/lowvram weight_function guard: ComfyUI partial loading attaches "
                        "per-LoRA weight functions; load the model fully or merge LoRAs"),
    ("GLOBAL_STATE changed", "TF32/grad-mode/autocast toggled between runs"),
    ("size mismatch", "a new latent size: use shape_policy auto or declare shapes"),
    ("stride mismatch", "a tensor's memory layout changed (a transposed, sliced or "
                        "channels-last input): shape_policy auto makes region inputs contiguous"),
    ("dtype mismatch", "model dtype changed"),
    ("device mismatch", "a tensor moved to another device between runs (offloading?)"),
    ("requires_grad mismatch", "grad mode or requires_grad on an input changed between runs"),
    ("___check_obj_id", "an object was replaced between runs"),
    ("ID_MATCH", "an object was replaced between runs"),
    ("___check_type_id", "an object of another type was passed (e.g. a different patch or "
                         "transformer_options entry)"),
    ("TYPE_MATCH", "an object of another type was passed (e.g. a different patch or "
                   "transformer_options entry)"),
    ("len(", "a list or dict changed length between runs (patches or transformer_options added)"),
    ("cache_size_limit", "the recompile limit was reached: that code now runs eagerly; raise "
                         "dynamo_cache_size_limit or remove the cause of the recompiles"),
    ("recompile_limit", "the recompile limit was reached: that code now runs eagerly; raise "
                        "dynamo_cache_size_limit or remove the cause of the recompiles"),
)
_NUMBER_GUARD = re.compile(r"==\s*-?\d+(\.\d+)?\s*(;|$)")


def recompile_hint(guard: str) -> str:
    """A plain-language cause for a failed guard ("" when the guard text is all we know)."""
    for needle, hint in RECOMPILE_HINTS:
        if needle in guard:
            return hint
    if _NUMBER_GUARD.search(guard.strip()):
        return ("a Python number this code reads (a token count, a size or a setting) differs "
                "between calls: one graph per value")
    return ""


_GUARD_LINE = re.compile(r"^\s*\d+/\d+:\s*(.*)$")


def parse_guard(reason: str) -> tuple[str, str]:
    """``(failed guard(s), source)`` from dynamo's recompile reason.

    Dynamo writes one ``"<frame>/<entry>: <guard>  # <code>  # <file:line in fn>"`` line per
    cache entry that failed, sometimes followed by a user stack trace."""
    lines = [ln for ln in reason.strip().splitlines() if ln.strip()]
    found = [m.group(1) for ln in lines if (m := _GUARD_LINE.match(ln))] or lines[:1]
    guards, source = [], ""
    for g in found:
        parts = [part.strip() for part in re.split(r"\s+#\s+", g.strip())]
        if parts[0] and parts[0] not in guards:
            guards.append(parts[0])
        if not source and len(parts) > 1:
            source = "  ".join(reversed(parts[1:]))  # "file:line in fn  code"
    return "; ".join(guards), source


@dataclasses.dataclass
class Recompile:
    frame: str
    guard: str
    hint: str          # plain-language cause ("" when the guard is all we know)
    seconds: float
    source: str = ""   # where the guarded value is used: "file:line in fn  code"
    during_diagnosis: bool = False


def recompiles_from(frames: list[dict], new_from: int | None = None) -> list[Recompile]:
    """The frames (``CompiledEntry.frames`` records) that were recompiles, with hints.
    ``new_from``: index of the first record added by the diagnosis itself."""
    out = []
    for i, f in enumerate(frames):
        reason = f.get("recompile_reason") or ""
        if not reason:
            continue
        guard, source = parse_guard(reason)
        out.append(Recompile(f.get("frame", "?"), guard, recompile_hint(guard),
                             float(f.get("seconds") or 0.0), source,
                             new_from is not None and i >= new_from))
    return out


# --------------------------------------------------------------------------- the report


@dataclasses.dataclass
class Report:
    regions: str = ""
    region_count: int = 0
    regional: bool = True
    backend: str = ""
    mode: str = ""
    shape_policy: str = ""
    state: str = ""                 # compile_core.status state
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
_PATH_AT_LINE = re.compile(r"[^\s:()\[\]'\"]+\.py(?=:\d+)")


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


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _seconds(s: float) -> str:
    return f"{s * 1000:.1f} ms" if s < 1 else f"{s:.2f} s"


def should_auto_disable(timing: Timing | None, enabled: bool, threshold: float = 1.0) -> bool:
    """Return the eager model when asked to and compiled was measured slower than eager."""
    return bool(enabled and timing is not None and timing.speedup < threshold)


# --------------------------------------------------------------------------- orchestration


def diagnose(compiled_model, diffusion_model: nn.Module, eager: Callable[[], object],
             compiled: Callable[[], object], runs: int, device: torch.device | None = None,
             inputs_note: str = "", auto_disable: bool = False,
             path_roots: tuple[str, ...] = (),
             reraise: tuple[type[BaseException], ...] = ()) -> Report:
    """Everything in the module docstring, for one ``engine.CompiledModel``.

    ``eager``/``compiled``: one model step each on the same inputs (the compiled one through
    ``CompiledModel.run``). A model call that fails (e.g. on inputs guessed for a family
    without a recipe) skips the timing, with the error in the report, instead of failing the
    workflow; ``reraise`` lists exceptions that must propagate (ComfyUI's interrupt)."""
    from . import scoped  # local: keep this module importable without the engine's deps

    cm = compiled_model
    e = cm.entry
    frames_before = len(e.frames)
    rep = Report(regions=cm.description, region_count=len(cm.plan.paths), regional=cm.plan.regional,
                 backend=cm.settings.backend, mode=cm.settings.mode,
                 shape_policy=cm.settings.shape_policy, reused=cm.reused,
                 persistent=cm.persistent is not None, auto_disable_requested=auto_disable,
                 path_roots=path_roots)

    targets = one_per_type(cm.plan.modules(diffusion_model))
    captured: dict = {}
    try:
        with capture_inputs(targets) as captured:
            eager()  # the inputs each region type really gets, from one real eager step
        rep.timing = measure(eager, compiled, runs, device)
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
            try:
                with scoped.scoped_state(**scoped.knobs_for(cm.settings, on_cuda)):
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
    from .status import status_payload
    return status_payload(cm)["state"]
