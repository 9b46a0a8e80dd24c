"""Apply Torch Compile: MODEL + WANCOMPILEARGS -> a compiled clone of MODEL."""
from __future__ import annotations

from ..compile_core.run import background, engine, fallback, warmup
from ..compile_core.report import log
from ..compile_core.plan.paths import resolve_workflow_cache_dir
from ..compile_core.cache.fleet import Fleet
from ..compile_core.cache.persist import PersistentCache
from ..compile_core.plan.preflight import preflight
from ..compile_core.plan.settings import CompileSettings
from ..compile_core.report.status import status_payload


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
        from . import comfy_bridge  # the one module that touches ComfyUI internals

        settings = CompileSettings.from_args(compile_args)  # bad input: clear error, nothing changed
        user = comfy_bridge.user_directory()
        ptx_dir = None
        if settings.experimental_ptx:
            # only <user>/torch_compile_speed/ or an operator root: never temp/input/output
            ptx_dir = resolve_workflow_cache_dir(settings.ptx_cache_dir, user)
        dm = comfy_bridge.diffusion_model(model)
        checked, findings = preflight(settings, comfy_bridge.load_device(model),
                                      {p.dtype for p in dm.parameters()})
        for f in findings:
            log.warn_once(f"preflight:{f.check}:{f.message}", "preflight: %s", f.message)
        if checked is None:
            return (model,)
        settings = background.settings_for(checked, comfy_bridge.load_device(model))
        persistent, fleet = PersistentCache.default(user), Fleet.from_env()
        try:
            compiled = engine.prepare(dm, settings, ptx_cache_dir=ptx_dir,
                                      persistent=persistent, fleet=fleet)
        except Exception as exc:  # noqa: BLE001 - nothing of the model has run yet, so any
            # failure here is compile set-up (e.g. torch.compile() importing a third-party
            # backend whose package is broken raises ImportError): the model stays eager.
            log.warning("torch.compile could not be set up with backend %r, so the model stays "
                        "eager. %s", settings.backend, fallback.explain(exc))
            return (model,)
        patched = comfy_bridge.with_compile_wrapper(model, compiled, unique_id)
        # logs and skips its own failures; a cancel (ComfyUI's interrupt) propagates. Declared
        # shapes are compiled here, on this thread, even in background mode. Only then does the
        # node wait for a busy background worker (``foreground``): a prompt that only re-runs
        # the node must not wait for another model's compile
        if warmup.ahead_sizes(compiled.settings):
            with compiled.foreground():
                comfy_bridge.compile_ahead(patched, compiled)
        comfy_bridge.send_status(status_payload(compiled, unique_id))
        return (patched,)
