"""Writes the pack's UI-format workflows (LiteGraph format 0.4, as ComfyUI frontends save them).

- ``example_workflows/wan_t2v_compile.json`` and ``wanvideowrapper_compile_args.json``: served by
  ComfyUI as the pack's templates (``/api/workflow_templates/<pack folder>/<name>.json``).
- ``tests/browser/fixtures/original_pack_ui_workflow.json``: a workflow as users of the ORIGINAL
  pack saved it (its 12 Settings widgets only, in its order, with distinctive values). It stands
  for files that already exist: keep it as it is.

Run ``.venv/bin/python tests/browser/make_workflows.py``, then ``pytest tests/browser``.
The Settings nodes carry the 14 contract widgets; inputs added after those load with their
defaults, so the files need no update when a widget is appended.
"""
from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OPTIONAL_SHAPE = 7  # LiteGraph's RenderShape.HollowCircle: how frontends mark optional inputs


class Workflow:
    """Builds a LiteGraph 0.4 workflow: nodes with widget values by position, and links."""

    def __init__(self, workflow_id: str):
        self.id = workflow_id
        self.nodes: list[dict] = []
        self.links: list[list] = []
        self.by_id: dict[int, dict] = {}

    def node(self, node_id, node_type, pos, size, *, inputs=(), widgets=(), outputs=(), title=None,
             properties=None, color=None, bgcolor=None, widget_slots=True):
        """``inputs``: (name, type[, "optional"]) link inputs. ``widgets``: (name, type, value
        [, "optional"]) in widget order; type None means a widget without an input slot (e.g.
        control_after_generate). ``widget_slots``: also write an input slot per widget, as
        frontends since 2025 do."""
        slots = []
        for name, typ, *opt in inputs:
            slots.append(self._slot(name, typ, opt))
        if widget_slots:
            for name, typ, _value, *opt in widgets:
                if typ is not None:
                    slots.append(self._slot(name, typ, opt, widget=True))
        node = {"id": node_id, "type": node_type, "pos": list(pos), "size": list(size), "flags": {},
                "order": len(self.nodes), "mode": 0, "inputs": slots,
                "outputs": [{"localized_name": name, "name": name, "type": typ, "links": []}
                            for name, typ in outputs]}
        if title:
            node["title"] = title
        node["properties"] = {"Node name for S&R": node_type, **(properties or {})}
        node["widgets_values"] = [w[2] for w in widgets]
        if color:
            node["color"], node["bgcolor"] = color, bgcolor
        self.nodes.append(node)
        self.by_id[node_id] = node
        return node

    def note(self, node_id, pos, size, text):
        node = self.node(node_id, "Note", pos, size, widgets=[("text", None, text)], widget_slots=False,
                         color="#432", bgcolor="#653")
        node["properties"] = {}
        return node

    @staticmethod
    def _slot(name, typ, opt, widget=False):
        """An input slot, keys in the order the frontend writes them."""
        slot = {"localized_name": name, "name": name}
        if opt and opt[0] == "optional":
            slot["shape"] = OPTIONAL_SHAPE
        slot["type"] = typ
        if widget:
            slot["widget"] = {"name": name}
        slot["link"] = None
        return slot

    def link(self, src, src_slot, dst, dst_input):
        link_id = len(self.links) + 1
        source, target = self.by_id[src], self.by_id[dst]
        slot = next(i for i, s in enumerate(target["inputs"]) if s["name"] == dst_input)
        typ = source["outputs"][src_slot]["type"]
        source["outputs"][src_slot]["links"].append(link_id)
        target["inputs"][slot]["link"] = link_id
        self.links.append([link_id, src, src_slot, dst, slot, typ])

    def write(self, path, extra=None):
        data = {"id": self.id, "revision": 0, "last_node_id": max(self.by_id),
                "last_link_id": len(self.links), "nodes": self.nodes, "links": self.links,
                "groups": [], "config": {},
                "extra": {"ds": {"scale": 0.8, "offset": [40, 40]}, **(extra or {})}, "version": 0.4}
        Path(path).write_text(json.dumps(data, indent=2) + "\n")
        print("wrote", Path(path).relative_to(ROOT))


SETTINGS_OUT = [("torch_compile_args", "WANCOMPILEARGS")]


def settings_widgets(backend, fullgraph, mode, dynamic, cache_limit, blocks_only, reuse, ptx,
                     fast_math, warmup, ptx_dir, recompile_limit, *wan_keys):
    """The original pack's 12 widgets in its order, then (if given) the two WanVideoWrapper keys."""
    widgets = [("backend", "COMBO", backend), ("fullgraph", "BOOLEAN", fullgraph),
               ("mode", "COMBO", mode), ("dynamic", "BOOLEAN", dynamic),
               ("dynamo_cache_size_limit", "INT", cache_limit),
               ("compile_transformer_blocks_only", "BOOLEAN", blocks_only),
               ("reuse_if_similar", "BOOLEAN", reuse), ("experimental_ptx", "BOOLEAN", ptx),
               ("ptx_fast_math", "BOOLEAN", fast_math), ("warmup_runs", "INT", warmup),
               ("ptx_cache_dir", "STRING", ptx_dir, "optional"),
               ("dynamo_recompile_limit", "INT", recompile_limit, "optional")]
    if wan_keys:
        static_shapes, unmerged_lora = wan_keys
        widgets += [("force_parameter_static_shapes", "BOOLEAN", static_shapes, "optional"),
                    ("allow_unmerged_lora_compile", "BOOLEAN", unmerged_lora, "optional")]
    return widgets


def ksampler_widgets(seed, steps, cfg, sampler, scheduler):
    return [("seed", "INT", seed), ("control_after_generate", None, "fixed"), ("steps", "INT", steps),
            ("cfg", "FLOAT", cfg), ("sampler_name", "COMBO", sampler), ("scheduler", "COMBO", scheduler),
            ("denoise", "FLOAT", 1.0)]


KSAMPLER_INPUTS = [("model", "MODEL"), ("positive", "CONDITIONING"), ("negative", "CONDITIONING"),
                   ("latent_image", "LATENT")]
APPLY_INPUTS = [("model", "MODEL"), ("compile_args", "WANCOMPILEARGS")]

# The usual WAN 2.1 T2V 1.3B files (ComfyUI's repackaged release), with download metadata the way
# ComfyUI's own templates carry it.
HF = "https://huggingface.co/Comfy-Org/Wan_2.1_ComfyUI_repackaged/resolve/main/split_files"
UNET = "wan2.1_t2v_1.3B_fp16.safetensors"
CLIP = "umt5_xxl_fp8_e4m3fn_scaled.safetensors"
VAE = "wan_2.1_vae.safetensors"


def model_meta(name, directory):
    return {"models": [{"name": name, "url": f"{HF}/{directory}/{name}", "directory": directory}]}


def wan_t2v_compile():
    w = Workflow("5e0c7a52-7d3b-4c0e-9a55-1f1d3c2b7a01")
    w.node(1, "UNETLoader", (20, 60), (330, 82), outputs=[("MODEL", "MODEL")],
           widgets=[("unet_name", "COMBO", UNET), ("weight_dtype", "COMBO", "default")],
           properties=model_meta(UNET, "diffusion_models"))
    w.node(2, "ModelSamplingSD3", (20, 190), (330, 58), inputs=[("model", "MODEL")],
           outputs=[("MODEL", "MODEL")], widgets=[("shift", "FLOAT", 8.0)])
    w.node(3, "TorchCompileSpeedSettings", (20, 300), (330, 440), outputs=SETTINGS_OUT,
           widgets=settings_widgets("inductor", False, "speed", False, 64, True, True, False, True,
                                    1, "", 128, False, False))
    w.node(4, "ApplyTorchCompile", (400, 60), (270, 60), inputs=APPLY_INPUTS, outputs=[("model", "MODEL")])
    w.node(5, "CLIPLoader", (20, 800), (330, 106), outputs=[("CLIP", "CLIP")],
           widgets=[("clip_name", "COMBO", CLIP), ("type", "COMBO", "wan"),
                    ("device", "COMBO", "default", "optional")],
           properties=model_meta(CLIP, "text_encoders"))
    w.node(6, "CLIPTextEncode", (400, 240), (420, 160), inputs=[("clip", "CLIP")],
           outputs=[("CONDITIONING", "CONDITIONING")], title="CLIP Text Encode (Positive Prompt)",
           widgets=[("text", "STRING", "a red fox trotting through fresh snow in a pine forest, "
                                       "morning light, cinematic, shallow depth of field")],
           color="#232", bgcolor="#353")
    w.node(7, "CLIPTextEncode", (400, 450), (420, 160), inputs=[("clip", "CLIP")],
           outputs=[("CONDITIONING", "CONDITIONING")], title="CLIP Text Encode (Negative Prompt)",
           widgets=[("text", "STRING", "blurry, low quality, static, overexposed, watermark, text, "
                                       "deformed, extra limbs, jpeg artifacts")],
           color="#322", bgcolor="#533")
    w.node(8, "EmptyHunyuanLatentVideo", (400, 660), (315, 130), outputs=[("LATENT", "LATENT")],
           widgets=[("width", "INT", 832), ("height", "INT", 480), ("length", "INT", 33),
                    ("batch_size", "INT", 1)])
    w.node(9, "KSampler", (870, 60), (315, 262), inputs=KSAMPLER_INPUTS, outputs=[("LATENT", "LATENT")],
           widgets=ksampler_widgets(42, 30, 6.0, "uni_pc", "simple"))
    w.node(10, "VAELoader", (870, 380), (315, 58), outputs=[("VAE", "VAE")],
           widgets=[("vae_name", "COMBO", VAE)], properties=model_meta(VAE, "vae"))
    w.node(11, "VAEDecode", (1230, 60), (210, 46), inputs=[("samples", "LATENT"), ("vae", "VAE")],
           outputs=[("IMAGE", "IMAGE")])
    w.node(12, "SaveAnimatedWEBP", (1230, 160), (420, 460), inputs=[("images", "IMAGE")],
           widgets=[("filename_prefix", "STRING", "wan_t2v_compiled"), ("fps", "FLOAT", 16.0),
                    ("lossless", "BOOLEAN", False), ("quality", "INT", 90), ("method", "COMBO", "default")])
    w.note(13, (870, 490), (315, 230), (
        "TorchCompileSpeed: native WAN 2.1 T2V\n\n"
        "Apply Torch Compile compiles the model's transformer blocks one by one (regional "
        "compile) on a clone of the model, so other branches stay uncompiled. The first run pays "
        "for the compile; later runs reuse it.\n\n"
        "The badge on the Apply node shows what happened: cold compile, warm (compile cache), "
        "reused, or eager fallback (with the reason), plus compile seconds and recompiles.\n\n"
        "mode 'speed' = inductor + max-autotune-no-cudagraphs + dynamic shapes, so backend and "
        "dynamic are greyed out while it is selected."))
    for link in [(1, 0, 2, "model"), (2, 0, 4, "model"), (3, 0, 4, "compile_args"), (4, 0, 9, "model"),
                 (5, 0, 6, "clip"), (5, 0, 7, "clip"), (6, 0, 9, "positive"), (7, 0, 9, "negative"),
                 (8, 0, 9, "latent_image"), (9, 0, 11, "samples"), (10, 0, 11, "vae"),
                 (11, 0, 12, "images")]:
        w.link(*link)
    w.write(ROOT / "example_workflows" / "wan_t2v_compile.json")


def wanvideowrapper_compile_args():
    w = Workflow("8f5b2d61-2c1e-4f7a-b2a4-6c0d9e3f4b02")
    w.node(1, "TorchCompileSpeedSettings", (20, 60), (330, 440), outputs=SETTINGS_OUT,
           widgets=settings_widgets("inductor", False, "default", False, 64, True, True, False, True,
                                    1, "", 128, False, False))
    # ComfyUI-WanVideoWrapper's loader (its inputs as of late 2025).
    w.node(2, "WanVideoModelLoader", (400, 60), (380, 270),
           inputs=[("compile_args", "WANCOMPILEARGS", "optional"),
                   ("block_swap_args", "BLOCKSWAPARGS", "optional"), ("lora", "WANVIDLORA", "optional"),
                   ("vram_management_args", "VRAM_MANAGEMENTARGS", "optional"),
                   ("extra_model", "VACEPATH", "optional")],
           outputs=[("model", "WANVIDEOMODEL")],
           widgets=[("model", "COMBO", "Wan2_1-T2V-1_3B_bf16.safetensors"),
                    ("base_precision", "COMBO", "bf16"), ("quantization", "COMBO", "disabled"),
                    ("load_device", "COMBO", "offload_device"),
                    ("attention_mode", "COMBO", "sdpa", "optional"),
                    ("rms_norm_function", "COMBO", "default", "optional")],
           properties={"cnr_id": "ComfyUI-WanVideoWrapper"})
    w.note(3, (830, 60), (380, 240), (
        "TorchCompileSpeed + ComfyUI-WanVideoWrapper\n\n"
        "Wire 'Torch Compile Speed Settings' into WanVideoModelLoader's compile_args input. The "
        "dict it emits has every key WanVideoWrapper reads (force_parameter_static_shapes "
        "included), so the wrapper compiles its transformer blocks with these settings; no "
        "Apply node is needed.\n\n"
        "Connect the loader's model output to WanVideoSampler as usual."))
    w.link(1, 0, 2, "compile_args")
    w.write(ROOT / "example_workflows" / "wanvideowrapper_compile_args.json")


def original_pack_fixture():
    """UNETLoader -> ApplyTorchCompile <- TorchCompileSpeedSettings (original 12 widgets) ->
    KSampler -> SaveLatent, on the test server's tiny WAN and zero-conditioning test node."""
    w = Workflow("0b7e3f0e-4a51-4d9b-8f0e-5a2c7d9e1f03")
    w.node(10, "UNETLoader", (40, 60), (330, 82), outputs=[("MODEL", "MODEL")],
           widgets=[("unet_name", "COMBO", "tcs_tiny_wan_l2_d256_s0.safetensors"),
                    ("weight_dtype", "COMBO", "default")])
    w.node(11, "TorchCompileSpeedSettings", (40, 200), (330, 322), outputs=SETTINGS_OUT,
           widgets=settings_widgets("eager", False, "default", True, 77, True, False, False, False,
                                    3, "mycache", 99))
    w.node(12, "ApplyTorchCompile", (420, 60), (250, 46), inputs=APPLY_INPUTS, outputs=[("model", "MODEL")])
    w.node(13, "TCSTestZeroConditioning", (420, 320), (270, 82), outputs=[("CONDITIONING", "CONDITIONING")],
           widgets=[("length", "INT", 8), ("nonce", "INT", 1234, "optional")])
    w.node(14, "EmptyHunyuanLatentVideo", (420, 460), (270, 130), outputs=[("LATENT", "LATENT")],
           widgets=[("width", "INT", 128), ("height", "INT", 128), ("length", "INT", 5),
                    ("batch_size", "INT", 1)])
    w.node(15, "KSampler", (740, 60), (300, 262), inputs=KSAMPLER_INPUTS, outputs=[("LATENT", "LATENT")],
           widgets=ksampler_widgets(7, 4, 1.0, "euler", "simple"))
    w.node(16, "SaveLatent", (1090, 60), (270, 58), inputs=[("samples", "LATENT")],
           widgets=[("filename_prefix", "STRING", "tcs_original_pack")])
    for link in [(10, 0, 12, "model"), (11, 0, 12, "compile_args"), (12, 0, 15, "model"),
                 (13, 0, 15, "positive"), (13, 0, 15, "negative"), (14, 0, 15, "latent_image"),
                 (15, 0, 16, "samples")]:
        w.link(*link)
    w.write(ROOT / "tests" / "browser" / "fixtures" / "original_pack_ui_workflow.json",
            extra={"frontendVersion": "1.18.9"})


if __name__ == "__main__":
    wan_t2v_compile()
    wanvideowrapper_compile_args()
    original_pack_fixture()
