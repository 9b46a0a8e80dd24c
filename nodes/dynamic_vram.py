"""The compiled clone of a model that ComfyUI loaded with dynamic VRAM (comfy-aimdo, 0.33+ on
an NVIDIA GPU).

Under dynamic VRAM every comfy op fetches its weight through comfy-aimdo at each call
(``comfy/ops.py`` ``cast_modules_with_vbar``: ctypes calls that torch.compile cannot trace, so
each layer would split the compiled graph), and LoRA is applied at op time. So the clone is made
non-dynamic, as core's TorchCompileModel does: ``clone(disable_dynamic=True)`` reloads the model
from its loader's file without dynamic VRAM. The input patcher is not touched
(``get_non_dynamic_delegate`` would cache the reload on it).

That reload has a flaw of ComfyUI's that also breaks core's compile: while comfy-aimdo is on,
``comfy.ops`` loads each Linear's weight lazily in the file's dtype and records the model's
dtype beside it (``weight_comfy_model_dtype``). The dynamic patcher casts to that dtype when it
loads the weights; the plain ``ModelPatcher`` of the reload does not, so a float32 or bfloat16
file meets float16 activations (``mat1 and mat2 must have the same dtype``). The clone's weights
are cast to the dtypes ComfyUI recorded, as the dynamic patcher would have done.

``TORCH_COMPILE_SPEED_DYNAMIC_VRAM_FETCH=1`` keeps the clone dynamic instead (a plain clone, the
same model): each compiled layer's weight fetch goes through ``tcs::layer_fetch``
(``dynamic_fetch``), so the blocks trace as one graph while comfy-aimdo keeps managing the
weights, with no reload and no second copy in RAM.
"""
from __future__ import annotations

import torch

from ..compile_core.report import log
from . import dynamic_fetch


def is_dynamic(model_patcher) -> bool:
    """True for ComfyUI's dynamic-VRAM patcher (``ModelPatcherDynamic``). Feature-detected:
    older ComfyUI (0.3.75) has no ``is_dynamic``."""
    check = getattr(model_patcher, "is_dynamic", None)
    return bool(check()) if callable(check) else False


def compile_clone(model_patcher):
    """``(clone, memory)``: the clone that gets the compile wrapper and the memory path it runs
    (None for a model without dynamic VRAM). A plain ``clone()``; for a dynamic patcher a
    non-dynamic reload with the model's dtypes (module docstring), or with
    ``dynamic_fetch.FETCH_ENV`` on a dynamic clone whose weights are fetched in the graph. If
    the model cannot be reloaded (a loader without ``cached_patcher_init``), the clone stays
    dynamic, with a warning."""
    if not is_dynamic(model_patcher):
        return model_patcher.clone(), None
    name = type(getattr(model_patcher, "model", None)).__name__
    if dynamic_fetch.enabled():
        log.info("dynamic VRAM stays on for the compiled %s: each compiled layer fetches its "
                 "weights through comfy-aimdo inside one op (tcs::layer_fetch), so its blocks "
                 "trace without graph breaks", name)
        return model_patcher.clone(), "dynamic VRAM, weights fetched in the graph"
    try:
        clone = model_patcher.clone(disable_dynamic=True)
    except Exception as exc:  # noqa: BLE001 - e.g. RuntimeError: no cached_patcher_init
        log.warning("dynamic VRAM stays on for the compiled %s: it could not be reloaded without "
                    "it (%s: %s). torch.compile then splits its graphs at every weight fetch, "
                    "which can be slower than eager. Fix: load it with a core loader, or start "
                    "ComfyUI with --disable-dynamic-vram.", name, type(exc).__name__, exc)
        return model_patcher.clone(), "dynamic VRAM (graph breaks at its weight fetches)"
    cast = restore_model_dtypes(clone.model)
    log.info("dynamic VRAM turned off for the compiled %s, as core's TorchCompileModel does: "
             "under it every weight is fetched through comfy-aimdo at each op, which "
             "torch.compile cannot trace. ComfyUI reloaded the model for this clone%s; the input "
             "model and other branches keep dynamic VRAM.", name,
             f" ({cast} tensor(s) cast to the model's dtype, as dynamic VRAM does)" if cast else "")
    return clone, "dynamic VRAM off for the compiled clone"


def restore_model_dtypes(model: torch.nn.Module) -> int:
    """Cast every parameter and buffer whose module records a model dtype
    (``<name>_comfy_model_dtype``) that it does not have to that dtype; returns how many were
    cast. ``model`` must be the clone's own reload: nothing else shares it."""
    cast = 0
    with torch.no_grad():
        for module in model.modules():
            tensors = list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False))
            for name, tensor in tensors:
                want = getattr(module, f"{name}_comfy_model_dtype", None)
                if isinstance(want, torch.dtype) and tensor.dtype != want:
                    tensor.data = tensor.data.to(dtype=want)
                    cast += 1
    return cast
