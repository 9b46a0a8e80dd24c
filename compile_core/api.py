"""The set-up both Apply nodes share, free of ComfyUI: compile_args parsed and checked, the
cache folders under ComfyUI's user directory, preflight, ``engine.prepare`` with its fallback,
and the status payloads the node badge shows.

A node hands in what it took from ComfyUI (the module to compile, its device, the user
directory) and gets back a ``CompiledModel``, or None when the module stays eager (the log
says why). Input that is wrong raises before anything is changed.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from .cache.fleet import Fleet
from .cache.persist import PersistentCache
from .plan.paths import resolve_workflow_cache_dir
from .plan.preflight import preflight
from .plan.settings import CompileSettings
from .plan.vae import CHOICES as VAE_CHOICES
from .plan.vae import plan_vae
from .report import log
from .report.status import status_payload
from .run import background, fallback, warmup
from .run.engine import CompiledModel, prepare
from .torch_support import probe_memo

__all__ = ["VAE_CHOICES", "CompileRequest", "CompiledModel", "model_request", "compile_model",
           "run_model_call", "compiles_ahead", "compile_vae", "status", "first_call_status", "changed_status"]


@dataclasses.dataclass(frozen=True)
class CompileRequest:
    """A node's parsed ``compile_args``, ComfyUI's user directory (the caches live under it)
    and the PTX kernel cache folder, where one was resolved."""
    settings: CompileSettings
    user_dir: str
    ptx_cache_dir: Path | None = None


def model_request(compile_args: dict, user_dir: str) -> CompileRequest:
    """Apply Torch Compile's request. Bad input raises here, before the model is touched: an
    ``experimental_ptx`` cache folder is checked even where preflight keeps the model eager
    (only ``<user>/torch_compile_speed/`` or an operator root: never temp/input/output)."""
    settings = CompileSettings.from_args(compile_args)
    return CompileRequest(settings, user_dir, _ptx_dir(settings, user_dir))


def compile_model(diffusion_model: nn.Module, device: torch.device,
                  request: CompileRequest) -> CompiledModel | None:
    """The compiled form of a diffusion model, or None: it stays eager (preflight found a
    missing compiler, or the compile could not be set up; one log line says which)."""
    _keep_probe_answers(request.user_dir)
    checked = _preflight(request.settings, device, diffusion_model)
    if checked is None:
        return None
    settings = background.settings_for(checked, device)
    return _prepare(diffusion_model, settings, request, "model")


def run_model_call(compiled: CompiledModel, run: Callable[[], object], call: Callable[[], object],
                   passthrough: tuple[type[BaseException], ...] = ()):
    """``run()``, the model call through ``compiled``; where it raises, ``call()`` (the same
    model call, eager) runs in its place: a compile never breaks a workflow. Where the eager
    call raises too, the error is the model's own and propagates; else the model stays eager
    from now on, said once. ``passthrough`` (the host's interrupt) propagates at once."""
    if compiled.entry.failed or compiled.entry.slower:  # the eager route: its errors are the model's own
        return run()
    try:
        return run()
    except passthrough:
        raise
    except Exception as exc:  # noqa: BLE001 - judged by the eager call below
        why = fallback.explain(exc)
    # (outside the handler: the failed call's tensors, held by its traceback, are freed first)
    return compiled.run_eagerly_after(why, call)


def compiles_ahead(compiled: CompiledModel) -> bool:
    """Whether the Apply node compiles declared sizes before sampling (``warmup.ahead_sizes``)."""
    return bool(warmup.ahead_sizes(compiled.settings))


def compile_vae(compile_args: dict, which: str, vae_model: nn.Module | None,
                device: torch.device, user_dir: str) -> CompiledModel | None:
    """The compiled form of a VAE's ``first_stage_model`` for ``which`` of ``VAE_CHOICES``, or
    None: it stays eager (no VAE, nothing to compile, preflight, or set-up failed). Bad
    ``compile_args`` raise first; the PTX cache folder is checked once preflight passed."""
    settings = CompileSettings.from_args(compile_args)
    plan = plan_vae(vae_model, which, settings.blocks_only) if vae_model is not None else None
    if plan is None:
        return None
    _keep_probe_answers(user_dir)
    checked = _preflight(settings, device, vae_model)
    if checked is None:
        return None
    request = CompileRequest(checked, user_dir, _ptx_dir(checked, user_dir))
    return _prepare(vae_model, checked, request, "VAE", plan=plan)


def status(compiled: CompiledModel, node_id: str | None = None) -> dict:
    """The node badge's payload for this compiled model (``report.status.status_payload``)."""
    return status_payload(compiled, node_id)


def first_call_status(compiled: CompiledModel, node_id: str | None = None) -> dict | None:
    """Before a compiled call: the 'compiling' payload while the call will compile in the
    foreground (nothing ran, nothing failed, no background worker), else None."""
    if not compiled.entry.runs and not compiled.entry.failed \
            and not compiled.compiling_in_background:
        return {**status_payload(compiled, node_id), "state": "compiling"}
    return None


def changed_status(compiled: CompiledModel, node_id: str | None = None) -> dict | None:
    """After a compiled call: the new payload when the call changed what the badge shows."""
    return status_payload(compiled, node_id) if compiled.changed else None


def _ptx_dir(settings: CompileSettings, user_dir: str) -> Path | None:
    if not settings.experimental_ptx:
        return None
    return resolve_workflow_cache_dir(settings.ptx_cache_dir, user_dir)


def _keep_probe_answers(user_dir: str) -> None:
    """The feature probes' answers are kept beside the persistent cache (``probe_memo``)."""
    cache = PersistentCache.default(user_dir)
    probe_memo.use(cache.root if cache else None)


def _preflight(settings: CompileSettings, device: torch.device,
               module: nn.Module) -> CompileSettings | None:
    """``preflight`` with each finding logged once; None when the module must stay eager."""
    checked, findings = preflight(settings, device, {p.dtype for p in module.parameters()})
    for f in findings:
        log.warn_once(f"preflight:{f.check}:{f.message}", "preflight: %s", f.message)
    return checked


def _prepare(module: nn.Module, settings: CompileSettings, request: CompileRequest,
             what: str, plan=None) -> CompiledModel | None:
    """``engine.prepare`` with the persistent cache and fleet of ``request.user_dir``."""
    persistent, fleet = PersistentCache.default(request.user_dir), Fleet.from_env()
    try:
        return prepare(module, settings, ptx_cache_dir=request.ptx_cache_dir, plan=plan,
                       persistent=persistent, fleet=fleet)
    except Exception as exc:  # noqa: BLE001 - nothing of the module has run yet, so any
        # failure here is compile set-up (e.g. torch.compile() importing a third-party
        # backend whose package is broken raises ImportError): the module stays eager.
        log.warning("torch.compile could not be set up with backend %r, so the %s stays "
                    "eager. %s", settings.backend, what, fallback.explain(exc))
        return None
