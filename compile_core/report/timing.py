"""Eager vs compiled step time, measured properly: a warm-up call of each first (the
compiled one includes any compile), then alternating calls compared by median."""
from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from typing import Callable

import torch


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
            clock: Callable[[], float] = time.perf_counter,
            check_interrupt: Callable[[], None] | None = None) -> Timing:
    """Warm up each variant once, then call them alternately ``runs`` times each.

    The order flips every round (E C, C E, ...) so slow drift (thermal, another process)
    hits both equally; the medians ignore a stray slow call. On CUDA every call is
    synchronised and the peak allocated memory of the measured calls is kept per variant.

    ``check_interrupt`` (the host's cancel check, e.g. ComfyUI's) is called before every call,
    warm-ups included: whatever it raises stops the measurement and propagates."""
    if runs < 1:
        raise ValueError("runs must be at least 1")
    on_cuda = _cuda(device)

    def sync():
        if on_cuda:
            torch.cuda.synchronize(device)

    def timed(call) -> float:
        if check_interrupt is not None:
            check_interrupt()
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
