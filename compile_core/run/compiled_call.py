"""The one ``torch.compile`` object a model's regions run through (shared by equal models)."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from . import background
from ..plan.settings import CompileSettings
from ..report import log
from ..torch_support import inductor_names, scoped, torch_compat


def make_compiled_call(settings: CompileSettings) -> Callable:
    """One ``torch.compile`` object over ``nn.Module._call_impl``; dynamo compiles each region's
    ``forward`` frame, so identical blocks share graphs."""
    kwargs = settings.compile_kwargs()
    # Give each compile its own recompile budget where this torch supports it, so our
    # regions neither consume nor are starved by other compiles of the same code.
    if torch_compat.isolate_recompiles():
        kwargs["isolate_recompiles"] = True
    else:
        log.info_once("shared-recompile-budget", "torch %s has no working isolate_recompiles: every "
                      "compile of a block class shares dynamo's cache and one recompile budget "
                      "(dynamo_cache_size_limit)", torch.__version__)
        if not settings.reuse_if_similar:
            kwargs = _own_backend(kwargs)
    if torch_compat.recompile_limit_kwarg():  # else the scoped config knob sets it (scoped.py)
        kwargs["recompile_limit"] = settings.cache_size_limit
    # torch 2.9's torch.compile() sets TORCHINDUCTOR_CACHE_DIR (a background compile's scope
    # sets it too: the lock keeps the two from restoring each other's value)
    with background.env_lock(), scoped.scoped_state():
        return torch.compile(nn.Module._call_impl, **kwargs)


def _own_backend(kwargs: dict) -> dict:
    with background.env_lock(), scoped.scoped_state():  # inductor's wrapper sets TORCHINDUCTOR_CACHE_DIR (2.8)
        own = inductor_names.OwnBackend(kwargs["backend"], kwargs.get("mode"), kwargs.get("dynamic"))
    return {**{k: v for k, v in kwargs.items() if k != "mode"}, "backend": own}
