"""The foreground route: compile (first call, recompiles) and run on the calling thread."""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch import nn

from . import background, compile_pass, fallback
from .state import ModelState
from ..report import log


class Foreground:
    """Runs a model call on the compiled path."""

    def __init__(self, state: ModelState):
        self.state = state

    def run(self, diffusion_model: nn.Module, call: Callable[[], object], device: torch.device) -> tuple:
        if background.busy():  # its compile scope's environment is process-wide: wait
            log.info_once("wait-background", "waiting for a background compile to finish before "
                          "running a model compiled in the foreground")
            background.wait_idle()
        s = self.state
        scope, ptx = s.scope(device.type == "cuda")
        modules = s.plan.modules(diffusion_model)
        warm = bool(ptx and not s.warmed and s.settings.warmup_runs)
        p = compile_pass.begin(s, modules, device, keep_keys=s.sampling_run > 1, scope=scope, warm=warm)
        s.sampling_run += s.sampling_run == 1  # the run's first call keyed them
        failure, failures = "", []
        host = s.compile_context(device) if s.compile_context and not s.ran else contextlib.nullcontext()
        try:
            with host, (contextlib.nullcontext() if p.lazy_scope else scope.active()), \
                    s.attached(modules, p.fast, failures):
                s.warm_if_first(call, device, warm)
                out = call()
        except Exception as exc:  # noqa: BLE001 - classified right below
            if not fallback.is_compile_failure(exc):
                raise
            failure = fallback.explain(exc)
        if failures and not failure:
            # Eager is the judge: dynamo also wraps the model's own errors found while tracing
            # (e.g. a shape mismatch, as TorchRuntimeError); the region's eager run raised none,
            # so only the compile failed. It disables compile for every model sharing this entry.
            return (s.fell_back(fallback.explain(failures[0]), out, "the block call it failed "
                                "in ran eagerly in its place; the model call went on"),)
        if failure:  # outside the regions (before any ran): the model call runs again, eagerly
            return (s.fell_back(failure, call(), "the model call ran again, eagerly"),)
        first, s.ran = not s.ran, True
        s.changed = compile_pass.finish(s, p, device) or first or s.changed  # (a swap)
        return (out,)
