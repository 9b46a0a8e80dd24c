"""Torch Compile Diagnostics: MODEL (from Apply Torch Compile) + LATENT -> MODEL + a report."""
from __future__ import annotations

from ..compile_core.diagnose import diagnostics
from ..compile_core.report import log
from ..compile_core.report.status import remember_measurement, status_payload

_TIPS = {
    "model": "The compiled model from 'Apply Torch Compile'. It is measured as it is and passed "
             "on unchanged (unless auto_disable_if_slower applies).",
    "samples": "A latent of the size you will sample (e.g. the sampler's latent_image): its shape "
               "is used, with random values, for the measured model steps.",
    "measure_runs": "Measured model steps per variant (eager and compiled, alternating) after one "
                    "warm-up step each; the report compares medians.",
    "auto_disable_if_slower": "If compiled steps are measured slower than eager, output the model "
                              "without compile (one log line says so).",
}


class TorchCompileDiagnostics:
    CATEGORY = "optimization"
    RETURN_TYPES = ("MODEL", "STRING")
    RETURN_NAMES = ("model", "report")
    FUNCTION = "diagnose"
    OUTPUT_NODE = True  # the report shows in the UI even when nothing uses the outputs
    DESCRIPTION = ("Explains what torch.compile does for this model, without relaunching with "
                   "TORCH_LOGS: regions compiled, compile time per frame, graph breaks with reason "
                   "and file:line, recompiles with the failed guard and its likely cause, cache "
                   "hits, and eager vs compiled step time (median of alternating runs after "
                   "warm-up). Place it after 'Apply Torch Compile'.")

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": ("MODEL", {"tooltip": _TIPS["model"]}),
            "samples": ("LATENT", {"tooltip": _TIPS["samples"]}),
            "measure_runs": ("INT", {"default": 5, "min": 1, "max": 50, "step": 1,
                                     "tooltip": _TIPS["measure_runs"]}),
            "auto_disable_if_slower": ("BOOLEAN", {"default": False,
                                                   "tooltip": _TIPS["auto_disable_if_slower"]}),
        }, "hidden": {"unique_id": "UNIQUE_ID"}}

    def diagnose(self, model, samples, measure_runs, auto_disable_if_slower, unique_id=None):
        # imported here: the pack imports without ComfyUI (tests, tooling), comfy_bridge needs it
        from . import comfy_bridge

        compiled, apply_node = comfy_bridge.compiled_model_of(model)
        if compiled is None:
            text = ("Torch Compile Diagnostics: this model is not compiled by 'Apply Torch Compile' "
                    "(connect the Apply node's output here); nothing to diagnose.")
            return {"ui": {"text": [text]}, "result": (model, text)}
        calls = comfy_bridge.diagnosis_calls(model, compiled, samples["samples"])
        with compiled.foreground():  # measure compiled steps, not eager ones beside a worker
            report = diagnostics.diagnose(
                compiled, calls.diffusion_model, calls.eager, calls.compiled, measure_runs,
                device=calls.device, inputs_note=calls.note, auto_disable=auto_disable_if_slower,
                path_roots=calls.path_roots, reraise=calls.reraise,
                check_interrupt=calls.check_interrupt)
        out = model
        if report.auto_disabled:
            out = comfy_bridge.without_compile_wrapper(model)
            log.info("compiled %s measured slower than eager (%.2fx): auto_disable_if_slower "
                     "returns the eager model", report.regions, report.timing.speedup)
        text = report.render()
        log.info("diagnostics: %s", report.verdict())
        fields = report.status_fields()
        if report.timing is not None:  # later statuses of this compiled model keep showing it
            remember_measurement(compiled.entry, fields)
        comfy_bridge.send_status({**status_payload(compiled, apply_node), **fields,
                                  "diagnostics_node": unique_id})
        return {"ui": {"text": [text]}, "result": (out, text)}
