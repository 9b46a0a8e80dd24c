"""Apply Torch Compile (VAE): VAE + WANCOMPILEARGS -> a copy of the VAE whose decode/encode
run compiled (regions from ``compile_core.plan.vae``, engine, reuse and caches as for models)."""
from __future__ import annotations

from ..compile_core import api


class ApplyTorchCompileVAE:
    CATEGORY = "optimization"
    RETURN_TYPES = ("VAE",)
    RETURN_NAMES = ("vae",)
    FUNCTION = "apply"
    DESCRIPTION = ("Compiles the VAE's repeated blocks with torch.compile for decode, encode or "
                   "both, on a copy: other branches that use the input VAE stay eager. One graph "
                   "serves every size, tiled decode included; if compiling fails, it runs eagerly.")

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "vae": ("VAE", {"tooltip": "The VAE to compile (copied, never changed)."}),
            "compile_args": ("WANCOMPILEARGS", {"tooltip": "From 'Torch Compile Speed Settings'."}),
            "compile": (list(api.VAE_CHOICES), {"default": "decode",
                                                "tooltip": "Which VAE calls run compiled."}),
        }, "hidden": {"unique_id": "UNIQUE_ID"}}

    def apply(self, vae, compile_args, compile="decode", unique_id=None):
        # imported here: the pack imports without ComfyUI (tests, tooling), comfy_bridge needs it
        from . import comfy_bridge

        # bad input: clear error, nothing changed
        compiled = api.compile_vae(compile_args, compile, comfy_bridge.vae_model(vae),
                                   comfy_bridge.vae_device(vae), comfy_bridge.user_directory())
        if compiled is None:
            return (vae,)
        comfy_bridge.send_status(api.status(compiled, unique_id))
        return (comfy_bridge.with_vae_compile(vae, compiled, compile, unique_id),)
