"""Apply Torch Compile: MODEL + WANCOMPILEARGS -> a compiled clone of MODEL."""
from __future__ import annotations

from ..compile_core import api


class ApplyTorchCompile:
    CATEGORY = "optimization"
    RETURN_TYPES = ("MODEL",)
    RETURN_NAMES = ("model",)
    FUNCTION = "apply"
    DESCRIPTION = ("Compiles the model's transformer blocks (or the whole diffusion model) with "
                   "torch.compile on a clone: other branches that use the input model stay eager. "
                   "If compiling fails, the model runs eagerly and the log says why.")

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": ("MODEL", {"tooltip": "The diffusion model to compile (it is cloned, never changed)."}),
            "compile_args": ("WANCOMPILEARGS", {"tooltip": "From 'Torch Compile Speed Settings' "
                                                           "(or WanVideoWrapper's compile settings)."}),
        }, "hidden": {"unique_id": "UNIQUE_ID"}}

    def apply(self, model, compile_args, unique_id=None):
        # imported here: the pack imports without ComfyUI (tests, tooling), comfy_bridge needs it
        from . import comfy_bridge

        # bad input: clear error, nothing changed
        request = api.model_request(compile_args, comfy_bridge.user_directory())
        compiled = api.compile_model(comfy_bridge.diffusion_model(model),
                                     comfy_bridge.load_device(model), request)
        if compiled is None:
            return (model,)
        patched = comfy_bridge.with_compile_wrapper(model, compiled, unique_id)
        # logs and skips its own failures; a cancel (ComfyUI's interrupt) propagates. Declared
        # shapes are compiled here, on this thread, even in background mode. Only then does the
        # node wait for a busy background worker (``foreground``): a prompt that only re-runs
        # the node must not wait for another model's compile
        if api.compiles_ahead(compiled):
            with compiled.foreground():
                comfy_bridge.compile_ahead(patched, compiled)
        comfy_bridge.send_status(api.status(compiled, unique_id))
        return (patched,)
