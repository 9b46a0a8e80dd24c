"""The compiled model on a ComfyUI ModelPatcher.

The compiled model is installed as an ``APPLY_MODEL`` wrapper on a *clone* of the
ModelPatcher, the same mechanism ComfyUI core's TorchCompileModel uses, so the input
model, the other graph branches and the state_dict keys stay untouched. An ``OUTER_SAMPLE``
wrapper marks each sampling run and sends the node badge's status after it.
"""
from __future__ import annotations

import functools

import comfy.model_management
import comfy.patcher_extension as patcher_extension

from ..compile_core import api
from ..compile_core.report import log
from ..compile_core.run import background
from . import weight_routing
from .comfy_server import send_if_any, send_status, server_idle
from .dynamic_vram import compile_clone

WRAPPER_KEY = "torch_compile_speed"
CORE_COMPILE_KEY = "torch.compile"  # comfy_api.torch_helpers' key
APPLY_MODEL = patcher_extension.WrappersMP.APPLY_MODEL
OUTER_SAMPLE = patcher_extension.WrappersMP.OUTER_SAMPLE
# what a cancelled prompt raises inside a model call (an Exception on older ComfyUI): it is no
# failure of the compiled call, so it propagates without an eager run
INTERRUPT = (comfy.model_management.InterruptProcessingException,)


def diffusion_model(model_patcher):
    return model_patcher.get_model_object("diffusion_model")


def load_device(model_patcher):
    return model_patcher.load_device


def with_compile_wrapper(model_patcher, compiled, node_id=None):
    """A clone of ``model_patcher`` (``dynamic_vram.compile_clone``) whose model calls run
    ``compiled``; a TorchCompileModel wrapper of core's on it is removed, with a warning."""
    background.set_idle_check(server_idle)
    clone, compiled.memory_path = compile_clone(model_patcher)
    clone.remove_wrappers_with_key(APPLY_MODEL, WRAPPER_KEY)
    if clone.get_wrappers(APPLY_MODEL, CORE_COMPILE_KEY):  # never compile twice
        clone.remove_wrappers_with_key(APPLY_MODEL, CORE_COMPILE_KEY)
        log.warning("Apply Torch Compile replaced core's TorchCompileModel wrapper: compiling twice "
                    "would trace this pack's runtime code inside core's compiled model (graph "
                    "breaks, a second compile). Remove TorchCompileModel from this model's path.")
    compiled.on_background_done = lambda: send_status(api.status(compiled, node_id))
    clone.add_wrapper_with_key(APPLY_MODEL, WRAPPER_KEY, _apply_model_wrapper(compiled, node_id))
    clone.remove_wrappers_with_key(OUTER_SAMPLE, WRAPPER_KEY)
    clone.add_wrapper_with_key(OUTER_SAMPLE, WRAPPER_KEY, _sampling_wrapper(compiled, node_id))
    return clone


def _apply_model_wrapper(compiled, node_id):
    """The ``APPLY_MODEL`` wrapper: each model call through ``run_compiled``, with the badge's
    status before the first compile and after a call that changed it."""
    other_compile_warned = []  # once per Apply

    def torch_compile_speed_wrapper(executor, *args, **kwargs):
        base_model = executor.class_obj
        x = args[0] if args else kwargs["x"]
        if not other_compile_warned:
            _warn_other_compile(compiled, args, kwargs, other_compile_warned)
        send_if_any(api.first_call_status(compiled, node_id))  # the UI shows "compiling..."
        def eager():
            return executor(*args, **kwargs)
        out = api.run_model_call(compiled, lambda: run_compiled(compiled, base_model.diffusion_model, eager, x.device),
                                 eager, INTERRUPT)
        send_if_any(api.changed_status(compiled, node_id))
        return out

    # found again by compiled_model_of (the Diagnostics node) on this clone and its clones
    torch_compile_speed_wrapper.compiled_model = compiled
    torch_compile_speed_wrapper.node_id = node_id
    return torch_compile_speed_wrapper


def _warn_other_compile(compiled, args, kwargs, warned: list) -> None:
    """Warn once when this call's model also carries another torch.compile wrapper."""
    options = args[5] if len(args) > 5 else kwargs.get("transformer_options") or {}
    others = [k for k in options.get("wrappers", {}).get(APPLY_MODEL, {})
              if k != WRAPPER_KEY and "compile" in str(k).lower()]
    if others:
        warned.append(True)
        compiled.inside_other_compile = True
        log.warning("this compiled model also carries another torch.compile wrapper (%s), "
                    "e.g. core's TorchCompileModel applied after Apply Torch Compile: "
                    "compiling twice, the other compile traces this pack's runtime code "
                    "(graph breaks, slower). Use one of the two.", ", ".join(map(str, others)))


def _sampling_wrapper(compiled, node_id):
    """The ``OUTER_SAMPLE`` wrapper: one sampling run of ``compiled``, then the badge's status."""
    def torch_compile_speed_status(executor, *args, **kwargs):
        try:
            with compiled.sampling_run():
                return executor(*args, **kwargs)
        finally:  # once per sampling run, so a reloaded page or a cached node gets its badge too
            send_status(api.status(compiled, node_id))
    return torch_compile_speed_status


def run_compiled(compiled, dm, call, device):
    """``compiled.run`` with the LoRA-patched weight fetches of its regions behind one custom op
    (``weight_routing``): a strength change is then data, not a recompile."""
    if compiled.entry.failed:
        return compiled.run(dm, call, device)
    with weight_routing.routed(dm, compiled.plan):  # (a background compile holds it too)
        return compiled.run(dm, call, device, functools.partial(weight_routing.routed, dm, compiled.plan))


def compiled_model_of(model_patcher):
    """``(CompiledModel, Apply node id)`` installed on this model by ``with_compile_wrapper``,
    or ``(None, None)`` when the model is not compiled by this pack."""
    for w in model_patcher.get_wrappers(APPLY_MODEL, WRAPPER_KEY):
        compiled = getattr(w, "compiled_model", None)
        if compiled is not None:
            return compiled, getattr(w, "node_id", None)
    return None, None


def without_compile_wrapper(model_patcher):
    """A clone of ``model_patcher`` that runs eagerly (our APPLY_MODEL wrapper removed)."""
    clone = model_patcher.clone()
    clone.remove_wrappers_with_key(APPLY_MODEL, WRAPPER_KEY)
    clone.remove_wrappers_with_key(OUTER_SAMPLE, WRAPPER_KEY)
    return clone
