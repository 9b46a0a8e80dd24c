"""Dynamo-level warm start: each region's traced graph and guards, saved with torch's AOT
compile API, so a restarted server (or a fleet worker) skips dynamo's trace as well.

With the inductor caches warm, most of what is left of a restart's first compiled run is
dynamo tracing one block with symbolic shapes (about 0.9 s of 1.1 s on the benchmark's WAN).
``torch.compile(..., fullgraph=True).aot_compile()`` traces and compiles a region once and
gives a function that ``torch.compiler.load_compiled_function`` loads in another process
without tracing. Saved files live in the entry's inductor dir, so the persistent cache and the
fleet archive carry them.

torch saves only the guards it can rebuild in another process, and refuses the type guards
of ComfyUI's op classes (nested classes such as ``comfy.ops.disable_weight_init.Linear``).
What is not saved is replaced by checks of our own:

- Guards on globals (the functions and modules the block calls, e.g. ComfyUI's
  ``optimized_attention``): each one's value is described when the region is traced, the
  description is compared when the file is loaded, and before every model call the value is
  compared by identity. Any change (a node that patches attention, say) turns the fast path
  off for that region, and the regular ``torch.compile`` path, with all of dynamo's guards,
  takes over.
- Type guards on nested classes, and guards that reach a class through ``type()``: a saved
  function is keyed by the types of every submodule of its region (``region_key``), so it
  only runs on a module made of exactly those classes.
- Local guards (sizes, dtypes, devices, strides, attribute values, dict keys) are saved and
  checked on every call; the identity guards torch cannot save on the call's own arguments
  (an attention override's code, a GGUF weight's enum), and constants of a submodule's class
  (GGUF's ``dequant_dtype``), are replaced by ``LocalChecks``. A GGUF weight's own attributes
  (``tensor_shape``, a LoRA's ``patches``) are saved with it (``ValuePickler``). A
  call no saved variant accepts gets a variant of its own (``Precompiled.VARIANTS``), then
  the regular path. ``saved_guards`` lists every guard kind and what replaces it.

Only regional inductor compiles without CUDA graphs use this (``supported``); any failure
to trace, save or load means the regular path, never an error. Each saved file is loaded
back and checked against the call it was traced for before it is kept. One region's trace,
file pair and load are ``saved_region``'s; this module keeps each region's variants.
"""
from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ..report import log
from . import saved_region
from ..plan import switches
from ..torch_support import aot, torch_compat

DIRNAME = "tcs_saved_regions"  # inside the entry's inductor dir (persisted and shared with it)
MODES = ("default", "max-autotune-no-cudagraphs")
OFF_ENV = "TORCH_COMPILE_SPEED_SAVED_REGIONS"  # operator: "0" turns this module off


def supported(settings, regional: bool) -> bool:
    """Regional inductor without CUDA graphs, not turned off, on a torch where ``aot_compile``
    (with the knob it needs), ``load_compiled_function`` and ``guard_filter_fn`` work."""
    return (regional and settings.backend == "inductor" and settings.mode in MODES
            and switches.switch(OFF_ENV, True)
            and aot.load_compiled_function() and torch_compat.guard_filter_fn())


def region_key(module: nn.Module) -> str:
    """The region's class and the classes of all its submodules. Runs for every region module
    before every model call, so the walk is over ``_modules`` and the hash is cached."""
    types_, stack = [], [module]
    pop, push, add = stack.pop, stack.append, types_.append  # (a plain loop: half the time
    while stack:                                              # of a generator per module)
        m = pop()
        add(type(m))
        for c in m._modules.values():
            if c is not None:
                push(c)
    sig = tuple(types_)
    key = _KEYS.get(sig)
    if key is None:
        names = "|".join(f"{t.__module__}.{t.__qualname__}" for t in sig)
        key = _KEYS[sig] = f"{type(module).__name__}-{hashlib.sha256(names.encode()).hexdigest()[:16]}"
    return key


_KEYS: dict[tuple, str] = {}


def _unmarked(values) -> tuple:
    """The same tensors without the dynamic-dim marks the shape policy put on them (a loaded
    function rejects marked inputs): new tensor objects over the same memory."""
    return tuple(v.detach().requires_grad_(v.requires_grad) if isinstance(v, torch.Tensor) else v
                 for v in values)


class Precompiled:
    """The fast path of one compiled entry: per region key, the saved or captured functions
    (variants: torch's saved guards also pin what a call brings besides its sizes, e.g. the
    parameters' ``requires_grad``, which ComfyUI clears on weights a LoRA patched)."""
    VARIANTS = 4  # per region key; a call none of them accepts then takes the regular path

    def __init__(self, directory: Path, compile_kwargs: dict):
        self.dir = directory
        self.compile_kwargs = compile_kwargs
        self.regions: dict[str, list[saved_region._Region]] = {}
        self.regular: set[str] = set()  # keys that use the regular torch.compile path here
        self.loaded = 0                 # regions loaded from disk in this process (and used)
        self.captured = 0
        self._keys: dict[int, str] = {}
        self._keyed: tuple = ()  # (device type, module ids) that ``_keys`` was made for
        self._unused: dict[str, list[saved_region._Region]] = {}  # loaded from disk, no call accepted yet
        self._in_use: set[str] = set()  # variant file names loaded or saved here: never overwritten
        self.scope: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext

    def begin_run(self, modules: list[nn.Module], device: torch.device, keep_keys: bool = False,
                  scope: Callable[[], contextlib.AbstractContextManager] | None = None) -> None:
        """Once per model call: key the region modules (and the device: the same fingerprint
        may run on CPU and GPU), and drop regions whose globals changed. ``keep_keys``: the
        caller knows no submodule was replaced since the last call (one sampling run: ComfyUI
        patches modules before its first model call), so the same modules keep their keys
        (the walk over every submodule cost ~45 us per model call). ``scope``: the run's
        ``scoped.Scope.active``, when the caller has not entered it around the model call:
        this then enters it around what needs the run's knobs and cache folders (loading,
        tracing, a region's first call, the regular path), and a call the saved regions take
        pays for no scope at all."""
        self.scope = scope or contextlib.nullcontext
        keyed = (device.type, *map(id, modules))
        if not (keep_keys and keyed == self._keyed):
            self._keys, self._keyed = {}, keyed
            for m in modules:
                if id(m) not in self._keys:
                    self._keys[id(m)] = f"{region_key(m)}-{device.type}"
        for key, variants in list(self.regions.items()):
            why = next((w for w in (r.checks.changed() for r in variants) if w), "")
            if why:
                self._give_up(key, f"{why} since it was traced")

    def saved(self, modules: list[nn.Module], device: torch.device) -> bool:
        """Every region of ``modules`` has a saved file on ``device`` (loading it is quick)."""
        return all((self.dir / f"{region_key(m)}-{device.type}.bin").is_file() for m in modules)

    def _give_up(self, key: str, why: str) -> None:
        self.regions.pop(key, None)
        self._unused.pop(key, None)
        self.regular.add(key)
        log.info("saved region %s not used (%s): the regular torch.compile path runs it", key, why)

    def call(self, module: nn.Module, args: tuple, kwargs: dict, mark: Callable[[], None],
             regular: Callable):
        """Run one region call on the fast path when it applies, else ``mark()`` + ``regular``."""
        key = self._keys.get(id(module))
        if key and key not in self.regular:
            region = self._find(key, module, args, kwargs) or self._capture(key, module, args, kwargs, mark)
            if region is not None and region.ran:
                return region.fn.fn(module, *args, **kwargs)
            if region is not None:  # its first call may still build kernels: in the cache folders
                with self.scope():
                    out = region.fn.fn(module, *args, **kwargs)
                region.ran = True
                return out
        mark()
        with self.scope():
            return regular(module, *args, **kwargs)

    def _find(self, key, module, args, kwargs) -> saved_region._Region | None:
        """The first variant whose guards accept this call (loading the saved ones once)."""
        variants = self.regions.get(key)
        if variants is None:
            with self.scope():  # (torch writes what it loads into the inductor cache folder)
                self._unused[key] = self._load_saved(key)
            variants = self.regions[key] = []
        for region in variants:
            if region.accepts(module, args, kwargs):
                return region
        for region in self._unused.get(key, ()):
            if region.accepts(module, args, kwargs):
                self._unused[key].remove(region)
                variants.append(region)
                self.loaded += 1
                log.info("saved region %s loaded from %s (no trace)", key, self.dir)
                return region
        return None

    def _load_saved(self, key: str) -> list[saved_region._Region]:
        out = []
        for n in range(self.VARIANTS):
            region, why = saved_region.load(self.dir, _variant_name(key, n))
            if why:
                log.info("saved region %s in %s not used: %s", _variant_name(key, n), self.dir, why)
            if region is not None:
                out.append(region)
                self._in_use.add(_variant_name(key, n))
        return out

    def _capture(self, key, module, args, kwargs, mark) -> saved_region._Region | None:
        """Trace a new variant for a call no variant accepts (saved next to the others)."""
        variants = self.regions[key]
        taken = len(variants) + len(self._unused.get(key, ()))
        if taken >= self.VARIANTS:
            log.info_once(f"variants:{self.dir}:{key}", "saved region %s: none of its %d variants "
                          "accepts this call; the regular torch.compile path runs it", key, taken)
            return None
        if taken:
            first = (variants or self._unused[key])[0]
            log.info("saved region %s: no saved variant accepts this call (%d; for the first, %s); "
                     "tracing another", key, taken, first.rejection(module, args, kwargs))
        mark()
        try:
            with self.scope():
                region = saved_region.capture(module, args, kwargs, self.compile_kwargs)
        except Exception as exc:  # noqa: BLE001 - graph break, unsaved guard, ...: regular path
            self.regular.add(key)
            log.info("AOT compile of %s not possible (%s: %s): the regular torch.compile path "
                     "runs it", key, exc.__class__.__name__, str(exc).splitlines()[0][:200]
                     if str(exc) else "")
            return None
        self.captured += 1
        name = _variant_name(key, self._free_slot(key))
        self._in_use.add(name)
        with self.scope():
            self._save_checked(region, name, module, args, kwargs)
        variants.append(region)
        return region

    def _free_slot(self, key: str) -> int:
        """An empty slot, else one whose file could not be used: never a variant in use."""
        free = [n for n in range(self.VARIANTS) if _variant_name(key, n) not in self._in_use]
        empty = [n for n in free if not (self.dir / f"{_variant_name(key, n)}.bin").exists()]
        return (empty or free)[0]

    def _save_checked(self, region: saved_region._Region, key: str, module, args, kwargs) -> None:
        """Save, then load the file back and check it accepts this very call: a file that a
        restart could not use (torch pickled something it cannot restore) is not kept."""
        try:
            saved_region.save(region, self.dir, key)
            back, why = saved_region.load(self.dir, key)
            args, kwargs = _unmarked(args), {k: v for k, v in zip(kwargs, _unmarked(kwargs.values()))}
            if back is not None and not back.accepts(module, args, kwargs):
                why = "its guards reject the call it was traced for"
            if back is None or why:
                for suffix in (".bin", ".json"):
                    (self.dir / f"{key}{suffix}").unlink(missing_ok=True)
                log.info("region %s not saved: loaded back, %s", key, why or "it could not be read")
                return
            log.info("saved region %s to %s: a restart loads it without a trace", key, self.dir)
        except Exception as exc:  # noqa: BLE001 - a full disk must not stop the run
            log.info("region %s not saved (%s: %s)", key, exc.__class__.__name__, exc)


def _variant_name(key: str, n: int) -> str:
    return key if n == 0 else f"{key}~{n}"
