"""One model call that may compile: what it finds before, and what it records after (graphs,
caches, the fleet)."""
from __future__ import annotations

import dataclasses
import time

import torch
from torch import nn

from .state import ModelState
from ..cache import precompiled
from ..report import log
from ..torch_support import dynamo_records, scoped


@dataclasses.dataclass
class CompilePass:
    first_compile: bool
    fast: precompiled.Precompiled | None
    graphs_before: int
    cache_before: tuple
    start_us: int
    start: float
    breaks_before: int = 0  # dynamo's graph-break count
    new_graphs: int = 0  # set by ``finish``
    lazy_scope: bool = False  # the saved regions enter the scope (``begin``)


def begin(state: ModelState, modules: list[nn.Module], device: torch.device, keep_keys: bool = False,
          scope: scoped.Scope | None = None, warm: bool = False) -> CompilePass:
    """What a call that may compile needs first (the first compile: the fleet),
    and the counters ``finish`` compares against. ``keep_keys``: see ``CompiledModel.sampling_run``.
    With ``scope``, a call on the saved-region path after the first compile leaves the scope to
    the saved regions (``p.lazy_scope``): they enter it where a trace, a load or a first call
    needs it, so a call they take costs no scope."""
    first_compile = state.entry.graphs == 0
    if first_compile and state.persistent:
        _before_first_compile(state, device)
    fast = state.precompiled()
    p = CompilePass(first_compile, fast, dynamo_records.graph_count(), cache_counts(state),
                    time.time_ns() // 1000, time.perf_counter(), dynamo_records.graph_break_count())
    p.lazy_scope = scope is not None and fast is not None and not first_compile and not warm
    if fast is not None:
        fast.begin_run(modules, device, keep_keys, scope.active if p.lazy_scope else None)
    return p


def finish(state: ModelState, p: CompilePass, device: torch.device, where: str = "") -> bool:
    """Record the graphs this pass compiled (caches, frames); True when
    it compiled or loaded any."""
    # a region loaded by torch's AOT API counts like a graph compiled from the cache
    loaded = p.fast.loaded - p.cache_before[2] if p.fast else 0
    new_graphs = p.new_graphs = dynamo_records.graph_count() - p.graphs_before + loaded
    changed = _record(state, time.perf_counter() - p.start, new_graphs, loaded, where)
    if new_graphs:
        state.entry.graph_breaks += dynamo_records.graph_break_count() - p.breaks_before
        state.entry.frames.extend(frames_since(p.start_us))
        note_cache(state, p.cache_before, device)
    return changed


def frames_since(start_us: int) -> list[dict]:
    """Dynamo's own compilation records (one per compiled frame; it keeps the last 64) that
    started after ``start_us``: where, how long, and for recompiles the guard that failed."""
    try:
        records = list(dynamo_records.compilation_metrics())
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


def cache_counts(state: ModelState) -> tuple[int, int, int, int]:
    """(FX-graph cache hits, misses, regions loaded precompiled, regions captured)."""
    fast = state.entry.precompiled
    return (*dynamo_records.fx_cache_counts(), fast.loaded if fast else 0, fast.captured if fast else 0)


def _before_first_compile(state: ModelState, device: torch.device) -> None:
    """Warm the local cache from the fleet's shared store (once)."""
    fp, local = state.fingerprint, state.persistent
    if state.fleet and not state.entry.fleet_checked and not local.is_complete(fp):
        state.entry.fleet_checked = True
        state.entry.fleet_hit = state.fleet.fetch_into(fp, device, local.inductor_dir(fp))


def note_cache(state: ModelState, before: tuple[int, int, int, int], device: torch.device) -> None:
    """Record (and log) whether the caches served this compile, and persist it. A region
    loaded precompiled is a hit; one traced and saved is a miss."""
    fx_hits, fx_misses, loaded, captured = (a - b for a, b in zip(cache_counts(state), before))
    hits, misses = fx_hits + loaded, fx_misses + captured
    e, local, fp = state.entry, state.persistent, state.fingerprint
    e.cache_hits += hits
    e.cache_misses += misses
    if local is None or state.settings.backend != "inductor":
        return
    if hits and not misses:
        log.info("persistent cache hit: %d compiled graph(s) loaded from %s", hits, local.entry_dir(fp))
    else:
        log.info("persistent cache miss (%d hit, %d new): saving to %s", hits, misses, local.entry_dir(fp))
    local.mark_complete(fp, {"regions": state.description})
    if state.fleet and misses:  # this worker built something the fleet may not have
        state.fleet.publish_from(fp, device, local.inductor_dir(fp))
    local.touch(fp)
    local.evict(keep=fp)


def _record(state: ModelState, seconds: float, new_graphs: int, loaded: int = 0, where: str = "") -> bool:
    e = state.entry
    e.runs += 1
    if not new_graphs:
        return False
    if e.graphs == 0:
        e.first_run_graphs = new_graphs
    e.graphs += new_graphs
    e.compile_seconds += seconds
    what = "compiled" if e.graphs == new_graphs else "recompiled"
    if loaded == new_graphs:
        log.info("loaded %s%s: %d saved region(s), no trace, in %.1f s", state.description, where,
                 loaded, seconds)
    else:
        log.info("%s %s%s: %d graph(s) in %.1f s", what, state.description, where, new_graphs, seconds)
    return True
