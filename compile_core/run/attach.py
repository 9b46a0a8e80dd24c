"""Route a model's region modules through the compiled callable for one model call."""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator

from torch import nn

from . import fallback
from ..cache import precompiled
from ..plan import shapes


@contextlib.contextmanager
def attached(modules: list[nn.Module], compiled: Callable, family: str = "",
             policy: str = "auto", whole_model: bool = False,
             fast: precompiled.Precompiled | None = None,
             shapers: dict[type, shapes.InputShaper] | None = None,
             failures: list | None = None) -> Iterator[None]:
    """Route each module's ``__call__`` through ``compiled`` (or ``fast`` where it has the
    region) for the duration of the block, with its inputs prepared by the shape policy.
    The hook is ``_compiled_call_impl`` (what ``nn.Module.compile()`` uses, so state_dict keys
    stay clean), removed afterwards: the shared model is untouched between calls.
    ``shapers`` (per region class) may be kept by the caller from one call to the next;
    ``failures``: see ``eager_on_failure``."""
    saved = []
    shapers = {} if shapers is None else shapers
    memo: dict = {}  # inputs every block receives are prepared once per call (shapes.InputShaper)
    try:
        for m in modules:
            shaper = shaper_for(shapers, m, family, policy, whole_model)
            saved.append((m, m.__dict__.get("_compiled_call_impl", _MISSING)))
            region = shapes.shaped_call(compiled, m, shaper, fast, memo)
            m.__dict__["_compiled_call_impl"] = region if failures is None else eager_on_failure(region, m, failures)
        yield
    finally:
        for m, prev in saved:
            if prev is _MISSING:
                m.__dict__.pop("_compiled_call_impl", None)
            else:
                m.__dict__["_compiled_call_impl"] = prev


def eager_on_failure(region: Callable, module: nn.Module, failures: list) -> Callable:
    """``region``, except that a compile failure it raises is added to ``failures`` and the
    region runs eagerly in its place, as does every region after it in the same model call:
    the model call goes on, and nothing outside the regions (ComfyUI's wrappers, a cache
    patch's step state) runs twice. The failing region's own forward may run twice where its
    compiled code failed after a graph break; a region is a block (or the diffusion model),
    whose forward only computes its output."""
    def call(*args, **kwargs):
        if not failures:
            try:
                return region(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - classified right below
                if not fallback.is_compile_failure(exc):
                    raise
                failures.append(exc)
        return module._call_impl(*args, **kwargs)
    return call


def shaper_for(shapers: dict, module: nn.Module, family: str, policy: str, whole_model: bool):
    """The kept ``InputShaper`` of the module's class, made on first use."""
    shaper = shapers.get(type(module))
    if shaper is None:
        shaper = shapers[type(module)] = shapes.InputShaper(module, family, policy, whole_model)
    return shaper


def region_variant(module: nn.Module) -> object:
    """Regions whose first inputs a background compile needs: one per class and structure
    (identical blocks share a graph)."""
    return (type(module), precompiled.region_key(module))


_MISSING = object()
