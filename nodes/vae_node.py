"""Apply Torch Compile (VAE): VAE + WANCOMPILEARGS -> a copy of the VAE whose decode/encode
run compiled (regions from ``compile_core.plan.vae``, engine, reuse and caches as for models)."""
from __future__ import annotations

from ..compile_core.run import engine, fallback
from ..compile_core.report import log
from ..compile_core.cache.fleet import Fleet
from ..compile_core.plan.paths import resolve_workflow_cache_dir
from ..compile_core.cache.persist import PersistentCache
from ..compile_core.plan.preflight import preflight
from ..compile_core.plan.settings import CompileSettings
from ..compile_core.report.status import status_payload
from ..compile_core.plan.vae import CHOICES, plan_vae


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
            "compile": (list(CHOICES), {"default": "decode",
                                        "tooltip": "Which VAE calls run compiled."}),
        }, "hidden": {"unique_id": "UNIQUE_ID"}}

    def apply(self, vae, compile_args, compile="decode", unique_id=None):
        from . import comfy_bridge  # the one module that touches ComfyUI internals

        settings = CompileSettings.from_args(compile_args)  # bad input: clear error, nothing changed
        model = comfy_bridge.vae_model(vae)
        plan = plan_vae(model, compile, settings.blocks_only) if model is not None else None
        if plan is None:
            return (vae,)
        checked, findings = preflight(settings, comfy_bridge.vae_device(vae),
                                      {p.dtype for p in model.parameters()})
        for f in findings:
            log.warn_once(f"preflight:{f.check}:{f.message}", "preflight: %s", f.message)
        if checked is None:
            return (vae,)
        user = comfy_bridge.user_directory()
        ptx_dir = (resolve_workflow_cache_dir(checked.ptx_cache_dir, user)
                   if checked.experimental_ptx else None)
        try:
            compiled = engine.prepare(model, checked, ptx_cache_dir=ptx_dir, plan=plan,
                                      persistent=PersistentCache.default(user), fleet=Fleet.from_env())
        except Exception as exc:  # noqa: BLE001 - nothing has run yet: compile set-up failed
            log.warning("torch.compile could not be set up with backend %r, so the VAE stays "
                        "eager. %s", checked.backend, fallback.explain(exc))
            return (vae,)
        comfy_bridge.send_status(status_payload(compiled, unique_id))
        return (comfy_bridge.with_vae_compile(vae, compiled, compile, unique_id),)
