"""Torch Compile Speed Settings: widgets in, a WANCOMPILEARGS dict out (no ComfyUI imports)."""
from __future__ import annotations

from ..compile_core.plan.settings import BACKGROUND_DEFAULT, UI_MODES, backend_choices, build_compile_args
from ..compile_core.plan.shapes import POLICIES

# Order matters: UI-format workflows store widget values by position. The first twelve
# inputs are the original pack's, in its order and with its defaults; new ones go last.
# Workflows saved by earlier versions may hold an 18th value (the removed ``whole_graph``, a
# boolean): the frontend ignores values past the last widget, but an input added later at that
# position would receive it.
_TIPS = {
    "backend": "torch.compile backend. 'inductor' generates fused kernels (Triton on GPU, C++ on CPU); "
               "'cudagraphs' only records CUDA graphs. Other registered backends follow.",
    "fullgraph": "Require one graph per compiled region; a graph break becomes an error instead of a "
                 "split. Leave off unless you are debugging.",
    "mode": "torch.compile mode. 'speed' = inductor + max-autotune-no-cudagraphs + dynamic shapes "
            "(the original pack's preset); it is translated before the dict leaves this node.",
    "dynamic": "Symbolic shapes for consumers of this dict such as WanVideoWrapper (mode 'speed' "
               "turns this on). Apply Torch Compile follows shape_policy instead.",
    "dynamo_cache_size_limit": "Recompiles allowed per compiled function before torch silently runs "
                               "that code eagerly (torch._dynamo recompile_limit), only during the run. "
                               "0 (accepted, as the original pack did): torch compiles nothing, so "
                               "Apply Torch Compile runs the model eagerly and says so once.",
    "compile_transformer_blocks_only": "Regional compile: compile each repeated transformer block "
                                       "(identical blocks share one graph, so compile time does not "
                                       "grow with depth). Off = compile the whole diffusion model.",
    "reuse_if_similar": "Reuse compiled work when a model with the same structure and settings was "
                        "compiled before in this server (e.g. the same checkpoint loaded again).",
    "experimental_ptx": "CUDA only: keep Triton/PTX kernels in ptx_cache_dir and warm the model's own "
                        "kernels before sampling. Skipped (with one log line) without CUDA.",
    "ptx_fast_math": "With experimental_ptx on CUDA: let inductor use fast-math Triton kernels "
                     "(slightly less precise, faster), where this torch has the knob.",
    "warmup_runs": "With experimental_ptx on CUDA: how many warm-up runs of the compiled model "
                   "happen on the first real inputs before sampling continues. With "
                   "declared_shapes, > 0 also compiles those sizes ahead.",
    "ptx_cache_dir": "Triton kernel cache for experimental_ptx. Relative paths live under the pack's "
                     "folder in ComfyUI's user directory (user/torch_compile_speed); paths outside the "
                     "allowed roots are refused. Empty = user/torch_compile_speed/triton.",
    "dynamo_recompile_limit": "Total recompiles allowed across all compiled code "
                              "(torch._dynamo accumulated_recompile_limit), only during the run. 0: "
                              "torch compiles nothing, so the model runs eagerly (said once).",
    "force_parameter_static_shapes": "Treat parameter shapes as static (torch default True). "
                                     "Passed to WanVideoWrapper as-is; applied only during the run.",
    "allow_unmerged_lora_compile": "WanVideoWrapper: allow compile with unmerged LoRAs. Native ComfyUI "
                                   "merges LoRA into the weights, which compile handles without it.",
    "shape_policy": "Apply Torch Compile's shapes. auto: batch, frames, height and width are dynamic "
                    "from the first call, so one compile serves every resolution and length (no "
                    "recompile storms). static: one graph per size. dynamic: torch's dynamic=True.",
    "declared_shapes": "Optional sizes you will render, WIDTHxHEIGHTxFRAMES or a MIN-MAX range "
                       "(e.g. 480x480x33-1280x720x81). With warmup_runs > 0 the model is compiled "
                       "ahead at the largest size, before the first sampling step.",
    "background_compile": "On by default: the first run never waits for the compile. It runs "
                          "eagerly while a worker thread compiles; the compiled blocks are swapped "
                          "in at a step once ready (the badge says 'compiling in the background'). "
                          "On CUDA the compile runs on the CPU beside the sampling, in mode "
                          "'default'. A model on the CPU starts its compile once the server is idle "
                          "(they share the cores), at most 2 minutes later. Off: the first step "
                          "compiles and the run waits for it.",
}


def _tip(name: str, spec: tuple) -> tuple:
    opts = dict(spec[1]) if len(spec) > 1 else {}
    opts["tooltip"] = _TIPS[name]
    return (spec[0], opts)


class TorchCompileSpeedSettings:
    CATEGORY = "optimization"
    RETURN_TYPES = ("WANCOMPILEARGS",)
    RETURN_NAMES = ("torch_compile_args",)
    FUNCTION = "build"
    DESCRIPTION = ("Settings for torch.compile. Feed the output to 'Apply Torch Compile', or to "
                   "ComfyUI-WanVideoWrapper's compile_args input, which accepts it unchanged.")

    @classmethod
    def INPUT_TYPES(cls):
        required = {
            "backend": (backend_choices(), {"default": "inductor"}),
            "fullgraph": ("BOOLEAN", {"default": False}),
            "mode": (list(UI_MODES), {"default": "speed"}),
            "dynamic": ("BOOLEAN", {"default": False}),
            "dynamo_cache_size_limit": ("INT", {"default": 64, "min": 0, "max": 1024, "step": 1}),
            "compile_transformer_blocks_only": ("BOOLEAN", {"default": True}),
            "reuse_if_similar": ("BOOLEAN", {"default": True}),
            "experimental_ptx": ("BOOLEAN", {"default": False}),
            "ptx_fast_math": ("BOOLEAN", {"default": True}),
            "warmup_runs": ("INT", {"default": 1, "min": 0, "max": 5, "step": 1}),
        }
        optional = {
            "ptx_cache_dir": ("STRING", {"default": ""}),
            "dynamo_recompile_limit": ("INT", {"default": 128, "min": 0, "max": 1024, "step": 1}),
            "force_parameter_static_shapes": ("BOOLEAN", {"default": False}),
            "allow_unmerged_lora_compile": ("BOOLEAN", {"default": False}),
            "shape_policy": (list(POLICIES), {"default": "auto"}),
            "declared_shapes": ("STRING", {"default": ""}),
            "background_compile": ("BOOLEAN", {"default": BACKGROUND_DEFAULT}),
        }
        return {"required": {k: _tip(k, v) for k, v in required.items()},
                "optional": {k: _tip(k, v) for k, v in optional.items()}}

    def build(self, **inputs):
        return (build_compile_args(**inputs),)
