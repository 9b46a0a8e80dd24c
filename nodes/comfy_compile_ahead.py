"""Compile ahead: the compiled model run on inputs shaped like the declared latent(s) before
sampling, with ComfyUI's progress bar and interrupt."""
from __future__ import annotations

import time

import comfy.model_management
import comfy.utils
import torch

from ..compile_core.plan.regions import family_of
from ..compile_core.report import log
from ..compile_core.run import warmup
from .comfy_model import run_compiled


def compile_ahead(model_patcher, compiled) -> None:
    """Compile before sampling: run the compiled model on inputs shaped like the declared
    latent(s), ``warmup_runs`` times, with ComfyUI's progress bar.

    A cancel (POST /interrupt) is checked before every run and propagates, so the prompt stops
    (ComfyUI 0.3.75's ``InterruptProcessingException`` is an ``Exception``: it must not be taken
    for a compile-ahead failure). Any other failure is logged and sampling compiles instead."""
    sizes = warmup.ahead_sizes(compiled.settings)
    if not sizes:
        return
    try:
        _compile_sizes(model_patcher, compiled, sizes)
    except comfy.model_management.InterruptProcessingException:
        log.info("compile-ahead cancelled (interrupt)")
        raise
    except Exception as exc:  # noqa: BLE001 - an optimisation: sampling compiles instead
        log.warning("compile-ahead skipped (%s: %s); the first sampling step compiles instead",
                    type(exc).__name__, exc)


def _compile_sizes(model_patcher, compiled, sizes) -> None:
    """``warmup_runs`` compiled model calls per size; stops at the first size without a recipe."""
    check_interrupt = comfy.model_management.throw_exception_if_processing_interrupted
    base = model_patcher.model
    check_interrupt()
    comfy.model_management.load_models_gpu([model_patcher])
    device = model_patcher.load_device
    dtype = base.manual_cast_dtype or base.get_dtype()
    runs = compiled.settings.warmup_runs
    pbar = comfy.utils.ProgressBar(runs * len(sizes))
    compiled.mark_warmed()
    for size in sizes:
        inputs = warmup.ahead_inputs(base.diffusion_model, family_of(base.diffusion_model),
                                     base.latent_format.latent_channels, size, device, dtype)
        if inputs is None:
            log.info("no compile-ahead recipe for %s; it compiles at the first sampling step",
                     type(base.diffusion_model).__name__)
            return
        start = time.perf_counter()
        for _ in range(runs):
            check_interrupt()
            with torch.no_grad():
                run_compiled(compiled, base.diffusion_model, lambda: base.apply_model(**inputs), device)
            pbar.update(1)
        log.info("compiled ahead for %dx%dx%d (%d run(s)) in %.1f s", *size, runs,
                 time.perf_counter() - start)
    check_interrupt()
