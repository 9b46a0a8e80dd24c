"""The reuse cache: compiled callables by fingerprint, bounded, and holding no model.

A ``CompiledEntry`` owns one ``torch.compile`` object, built at its first use (building one
for inductor imports inductor's compiler, 0.7-0.9 s on a 2-core CPU: a background compile
pays it on its worker, not in the prompt). Its callable is not bound to any module (it
compiles ``nn.Module._call_impl`` and is attached per call), so the registry never keeps a
model alive, and every model with the same fingerprint shares its graphs.
"""
from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Callable

from ..plan.settings import CompileSettings

DEFAULT_MAX_ENTRIES = 16
# the settings' own recompile limits (``get_or_create``'s ``budget``)
DEFAULT_BUDGET = (CompileSettings.cache_size_limit, CompileSettings.recompile_limit)


_BUILD_LOCK = threading.Lock()


@dataclasses.dataclass
class CompiledEntry:
    fingerprint: str
    make: Callable[[], Callable] | None  # builds the ``torch.compile`` object (``compiled``)
    failed: str = ""           # reason compile was abandoned (then the model runs eagerly)
    slower: str = ""           # compiled measured not faster than eager here (``verdict``): eager
    runs: int = 0              # compiled apply_model calls
    graph_breaks: int = 0      # dynamo graph breaks its compiles met (``beside``)
    graphs: int = 0            # dynamo graphs compiled for it (first run + recompiles)
    first_run_graphs: int = 0  # graphs of its first run (the rest are recompiles)
    compile_seconds: float = 0.0
    reuses: int = 0            # applies that found this entry already built
    cache_hits: int = 0        # inductor FX-graph cache hits while compiling (persistent warm start)
    cache_misses: int = 0
    frames: list = dataclasses.field(default_factory=list)  # compile_pass.frames_since records
    fleet_checked: bool = False  # the shared store was asked once for this entry
    fleet_hit: bool = False
    measurement: dict = dataclasses.field(default_factory=dict)  # last Diagnostics speedup
    trial: object = None  # verdict.Trial: compiled against eager, measured on its own steps
    precompiled: object = None  # precompiled.Precompiled: the dynamo-level warm start, if any
    _compiled: Callable | None = dataclasses.field(default=None, repr=False)

    @property
    def compiled(self) -> Callable | None:
        """The ``torch.compile`` object, built by ``make`` at the first use."""
        if self._compiled is None and self.make is not None:
            with _BUILD_LOCK:
                if self._compiled is None:
                    self._compiled = self.make()
        return self._compiled

    @compiled.setter
    def compiled(self, fn: Callable | None) -> None:
        self._compiled = fn


class ReuseRegistry:
    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES):
        self.max_entries = max_entries
        self._entries: "collections.OrderedDict[tuple, CompiledEntry]" = collections.OrderedDict()
        self._lock = threading.Lock()

    def get_or_create(self, fingerprint: str, factory: Callable[[], Callable],
                      budget: tuple = DEFAULT_BUDGET, lazy: bool = False) -> tuple[CompiledEntry, bool]:
        """Return (entry, reused). ``budget``: the compile object's recompile limits, which the
        fingerprint leaves out (the persistent cache serves any limits) but which decide how
        many graphs it compiles, so an Apply with other limits gets an entry of its own.
        New entries evict the least recently used past the bound.
        A failed entry is replaced by a new one: a compile failure may be transient (e.g. out of
        memory while autotuning), so each new request retries once; a model already holding
        the failed entry keeps running eagerly (no retry per step). ``lazy``: the compile object
        is built at its first use; else here, and a factory that raises leaves no entry."""
        key = (fingerprint, budget)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and not entry.failed:
                self._entries.move_to_end(key)
                entry.reuses += 1
                return entry, True
            entry = CompiledEntry(fingerprint, factory)
            entry._compiled = None if lazy else factory()
            self._entries[key] = entry
            self._entries.move_to_end(key)  # it may replace a failed one
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
            return entry, False

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, fingerprint: str) -> bool:
        return any(key[0] == fingerprint for key in self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


REGISTRY = ReuseRegistry()
