"""The only module that touches ComfyUI internals (ModelPatcher wrappers, folder_paths).

The compiled model is installed as an ``APPLY_MODEL`` wrapper on a *clone* of the
ModelPatcher, the same mechanism ComfyUI core's TorchCompileModel uses, so the input
model, the other graph branches and the state_dict keys stay untouched.
"""
from __future__ import annotations

import comfy.patcher_extension as patcher_extension
import folder_paths

from ..compile_core import log, warmup
from ..compile_core.status import status_payload

WRAPPER_KEY = "torch_compile_speed"
STATUS_EVENT = "torch_compile_speed.status"  # web/js listens for it (the node badge)
CORE_COMPILE_KEY = "torch.compile"  # comfy_api.torch_helpers' key


def diffusion_model(model_patcher):
    return model_patcher.get_model_object("diffusion_model")


def load_device(model_patcher):
    return model_patcher.load_device


def with_compile_wrapper(model_patcher, compiled, node_id=None):
    clone = model_patcher.clone()
    apply_model = patcher_extension.WrappersMP.APPLY_MODEL
    clone.remove_wrappers_with_key(apply_model, WRAPPER_KEY)
    clone.remove_wrappers_with_key(apply_model, CORE_COMPILE_KEY)  # never compile twice

    def torch_compile_speed_wrapper(executor, *args, **kwargs):
        base_model = executor.class_obj
        x = args[0] if args else kwargs["x"]
        out = compiled.run(base_model.diffusion_model, lambda: executor(*args, **kwargs), x.device)
        if compiled.changed:
            send_status(status_payload(compiled, node_id))
        return out

    clone.add_wrapper_with_key(apply_model, WRAPPER_KEY, torch_compile_speed_wrapper)
    return clone


def compile_ahead(model_patcher, compiled) -> None:
    """Compile before sampling: run the compiled model on inputs shaped like the declared
    latent(s), ``warmup_runs`` times, with ComfyUI's progress bar."""
    import time

    import comfy.model_management
    import comfy.utils
    import torch

    sizes = warmup.ahead_sizes(compiled.settings)
    if not sizes:
        return
    base = model_patcher.model
    comfy.model_management.load_models_gpu([model_patcher])
    device = model_patcher.load_device
    dtype = base.manual_cast_dtype or base.get_dtype()
    runs = compiled.settings.warmup_runs
    pbar = comfy.utils.ProgressBar(runs * len(sizes))
    compiled.mark_warmed()
    for size in sizes:
        inputs = warmup.ahead_inputs(base.diffusion_model, compiled.plan.family,
                                     base.latent_format.latent_channels, size, device, dtype)
        if inputs is None:
            log.info("no compile-ahead recipe for %s; it compiles at the first sampling step",
                     type(base.diffusion_model).__name__)
            return
        start = time.perf_counter()
        for _ in range(runs):
            with torch.no_grad():
                compiled.run(base.diffusion_model, lambda: base.apply_model(**inputs), device)
            pbar.update(1)
        log.info("compiled ahead for %dx%dx%d (%d run(s)) in %.1f s", *size, runs,
                 time.perf_counter() - start)


def user_directory() -> str:
    return folder_paths.get_user_directory()


def temp_directory() -> str:
    return folder_paths.get_temp_directory()


def send_status(payload: dict) -> None:
    """Tell the frontend (all clients) what compile did; never fails the run."""
    try:
        from server import PromptServer
        PromptServer.instance.send_sync(STATUS_EVENT, payload)
    except Exception as exc:  # noqa: BLE001 - a UI message must not break sampling
        log.warn_once("status-send", "could not send the status to the UI: %s", exc)
