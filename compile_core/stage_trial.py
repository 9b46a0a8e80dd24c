"""Whether the whole graph is worth keeping: its calls timed side by side with the regional graphs'.

The whole-graph stage (``whole_graph``) is on by default because, where it was measured (the
CPU), its graph runs a model call faster than the regional graphs. Where it was not (a GPU,
where it compiles in mode ``default`` while the regional graphs may be autotuned), it could be
slower. So once it is ready, its first model calls take turns with the regional graphs'
(whole, regional, whole, ...), each timed to the end of its work on the device, and the stage
stays only if its fastest call is no slower than theirs. Taking turns within the same sampling
runs, and comparing the fastest calls (a busy machine only ever adds time to a call), keeps the
comparison fair on a shared machine: with medians of 3, a 2-core machine busy with other
compiles once judged a whole graph 1.51x slower that timed 1.02x alone. The first whole-graph
call is not counted: a graph's first call loads its kernels.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable

import torch

SAMPLES = 5  # timed calls of each kind
SLOWER = 1.02  # the stage goes when its fastest call takes more than this times the regional graphs'


def _sync(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (a CUDA call returns before its kernels end)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclasses.dataclass
class Trial:
    whole: list[float] = dataclasses.field(default_factory=list)  # seconds per call
    regional: list[float] = dataclasses.field(default_factory=list)
    warmed: bool = False  # the whole graph's first (uncounted) call ran
    ratio: float | None = None  # fastest whole / fastest regional call, once decided

    @property
    def done(self) -> bool:
        return self.ratio is not None

    def regional_turn(self) -> bool:
        """The next call runs on the regional graphs (they take turns with the whole graph)."""
        return self.warmed and len(self.regional) < SAMPLES and len(self.regional) <= len(self.whole)

    @staticmethod
    def timed(device: torch.device, fn: Callable[[], object]) -> tuple[object, float]:
        _sync(device)
        start = time.perf_counter()
        out = fn()
        _sync(device)
        return out, time.perf_counter() - start

    def add(self, whole: bool, seconds: float) -> bool:
        """Count one call; True when this decided the trial (see ``ratio``)."""
        if whole and not self.warmed:
            self.warmed = True
            return False
        (self.whole if whole else self.regional).append(seconds)
        if len(self.whole) < SAMPLES or len(self.regional) < SAMPLES:
            return False
        self.ratio = min(self.whole) / max(min(self.regional), 1e-9)
        return True

    @property
    def keep(self) -> bool:
        return self.ratio is not None and self.ratio <= SLOWER

    def report(self) -> dict | None:
        if not self.done:
            return None
        return {"whole_ms": round(min(self.whole) * 1e3, 2), "regional_ms": round(min(self.regional) * 1e3, 2),
                "ratio": round(self.ratio, 3)}
