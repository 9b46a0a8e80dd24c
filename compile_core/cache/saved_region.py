"""One saved region: a region call traced and compiled with torch's AOT API (``capture``), its
file pair (``save``: torch's bytes and our checks), and loading it back in another process
(``load``: the sources, tensor subclasses and globals it relied on checked first). ``precompiled``
keeps the variants of each region and decides which call takes which.
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
import json
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ..report import log
from . import source_check
from ..torch_support import aot, hooks, inductor_names
from .persist import write_atomic
from .guard_names import bind_subclasses, subclass_globals
from ..torch_support.guard_pickling import ValuePickler
from .saved_guards import GlobalChecks, LocalChecks, NotSaveable, guard_checker, keep_guard


@dataclasses.dataclass
class _Region:
    fn: Callable                 # torch's AOTCompiledFunction
    checks: GlobalChecks
    locals: LocalChecks
    sources: list = dataclasses.field(default_factory=list)  # source_check.Source of its trace
    ran: bool = False            # called once in this process (inside the run's scope)
    guards: Callable | None = None  # torch's saved guards as check(module, args, kwargs), see
    # ``_first_check``; None: not yet decided

    def accepts(self, module: nn.Module, args: tuple, kwargs: dict) -> bool:
        """torch's saved guards, then ours on the functions the call passes in."""
        guards = self.guards or self._first_check
        return guards(module, args, kwargs) and self.locals.accepts(module, args, kwargs)

    def _guard_check(self, module: nn.Module, args: tuple, kwargs: dict) -> bool:
        return self.fn.guard_check(module, *args, **kwargs)

    def _first_check(self, module: nn.Module, args: tuple, kwargs: dict) -> bool:
        """``guard_check``, until it accepts a call: then ``saved_guards.guard_checker``'s
        direct check (no signature binding) is kept for later calls if it accepts that call too."""
        ok = self._guard_check(module, args, kwargs)
        if not ok:
            return ok
        direct = guard_checker(self.fn)
        try:
            same = direct is not None and direct(module, args, kwargs) is True
        except Exception:  # noqa: BLE001 - a torch whose guards need more: its own check
            same = False
        if direct is not None and not same:
            log.info_once("direct-guard-check", "torch %s: a saved region's guards checked "
                          "without its signature rejected a call guard_check accepts; using "
                          "guard_check", torch.__version__)
        self.guards = direct if same else self._guard_check
        return ok

    def rejection(self, module: nn.Module, args: tuple, kwargs: dict) -> str:
        """Why this call is not accepted, for the log: torch's first failing guard, else ours."""
        try:
            if self.fn.guard_check(module, *args, **kwargs):
                return "a function, enum member or class constant the pack checks differs"
            f_locals = self.fn.prepare_f_locals(module, *args, **kwargs)
            info = self.fn._artifacts.guard_manager.check_verbose(f_locals)
            parts = (str(p).split("  #")[0].strip() for p in info.verbose_code_parts)  # (no source)
            return f"torch's guard {'; '.join(parts)[:300]} fails"
        except Exception as exc:  # noqa: BLE001 - only a log line
            return f"torch's guards reject it ({exc.__class__.__name__})"


def mode_options(mode: str | None, dynamic: bool | None) -> dict:
    """A torch mode as the inductor options it stands for: ``torch.compile`` takes a mode or
    options, never both, and the trace needs options (the guard filter)."""
    if not mode or mode == "default":
        return {}
    return inductor_names.mode_options(mode, dynamic)


def capture(module: nn.Module, args: tuple, kwargs: dict, compile_kwargs: dict) -> _Region:
    """Trace and compile one region call with torch's AOT API (raises when it cannot, or when
    the trace relies on a guard that nothing would check on the fast path)."""
    dropped: set[str] = set()
    local_fns: set[str] = set()
    unchecked: set[str] = set()
    kw = {k: v for k, v in compile_kwargs.items() if k in ("backend", "dynamic")}
    options = {**mode_options(compile_kwargs.get("mode"), kw.get("dynamic")),
               "guard_filter_fn": keep_guard(dropped, local_fns, unchecked)}
    # torch 2.9: aot_compile exists only under enable_aot_compile; its kernels are built as
    # every later load looks them up (``hooks.without_precompiled_header``)
    with aot.aot_capture(), hooks.without_precompiled_header():
        compiled = torch.compile(nn.Module._call_impl, fullgraph=True, options=options, **kw)
        with ValuePickler():
            fn = compiled.aot_compile(((module, *args), kwargs))
    if unchecked:
        raise NotSaveable(f"it relies on {sorted(unchecked)[0]}, which torch cannot save "
                          "and the pack does not check")
    sources = source_check.recorded(fn)
    if sources is None:
        raise NotSaveable(f"torch {torch.__version__} records no sources with it, so a later "
                          "process could not tell whether the model's code changed")
    return _Region(fn, GlobalChecks.capture(sorted(dropped), fn.fn.__globals__),
                   LocalChecks.capture(sorted(local_fns), module, args, kwargs), sources=sources)


def save(region: _Region, path: Path, key: str) -> None:
    """``<key>.bin`` (torch's bytes) and ``<key>.json`` (our checks, the sources it was traced
    from, and the digest of the ``.bin`` it belongs to), each written atomically."""
    path.mkdir(parents=True, exist_ok=True)
    data = type(region.fn).serialize(region.fn).serialized_data
    meta = {"region": key, "torch": torch.__version__, "bin_sha256": hashlib.sha256(data).hexdigest(),
            "sources": region.sources, "globals": region.checks.names,
            "described": region.checks.described, "locals": region.locals.names,
            "locals_described": region.locals.described,
            "subclasses": subclass_globals(region.fn.fn, region.checks.names)}
    write_atomic(path / f"{key}.bin", data)
    write_atomic(path / f"{key}.json", json.dumps(meta))


def load(path: Path, key: str) -> tuple[_Region | None, str]:
    """(region, '') from a saved pair, or (None, why not); never raises."""
    try:
        meta = json.loads((path / f"{key}.json").read_text())
        data = (path / f"{key}.bin").read_bytes()
    except (OSError, ValueError):
        return None, ""
    if not isinstance(meta, dict) or meta.get("region") != key or meta.get("torch") != torch.__version__:
        return None, "it was saved for another region or torch"
    if meta.get("bin_sha256") != hashlib.sha256(data).hexdigest():
        return None, "its .bin is not the one its .json was written for"
    sources = meta.get("sources")
    if not isinstance(sources, list) or not all(_is_source(s) for s in sources):
        return None, "it names no sources to check it against"
    sources = [tuple(s) for s in sources]
    changed = source_check.changed(sources)
    if changed:
        return None, f"the model's code changed since it was traced ({changed}): tracing it afresh"
    try:
        subclasses = bind_subclasses(meta.get("subclasses") or {})
    except Exception as exc:  # noqa: BLE001 - ComfyUI-GGUF not loaded, say
        return None, f"a tensor subclass it uses is not there ({exc.__class__.__name__}: {exc})"
    try:
        extra = {"f_globals": subclasses} if subclasses else {}  # (GGUF's GGMLTensor)
        with hooks.without_precompiled_header():
            fn = torch.compiler.load_compiled_function(io.BytesIO(data), **extra)
    except Exception as exc:  # noqa: BLE001 - corrupt, incompatible (torch checks its system info)
        return None, f"torch could not load it ({exc.__class__.__name__}: {str(exc)[:200]})"
    checks = GlobalChecks(list(meta.get("globals", [])), list(meta.get("described", [])))
    problem = checks.matches_now(fn.fn.__globals__)
    if problem:
        return None, f"{problem}, so it was traced for other code"
    local = LocalChecks(list(meta.get("locals", [])), list(meta.get("locals_described", [])))
    return _Region(fn, checks, local, sources=sources), ""


def _is_source(item) -> bool:
    return (isinstance(item, list) and len(item) == 4 and isinstance(item[0], str)
            and isinstance(item[1], int) and isinstance(item[2], int) and isinstance(item[3], str))


