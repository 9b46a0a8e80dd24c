"""Regional compile on the REAL ComfyUI model classes of the selected host (``TCS_COMFY_HOST``, see
``harness.resolve_host``: ``.host/comfyui-0.33.0`` by default, or ``.host/comfyui-0.3.75``).

``regions/build_tiny_models.py`` runs in a subprocess (importing ``comfy`` parses argv and sets
global state): it builds each family's model class with a tiny config, prints
``plan_regions(model, blocks_only=True)``, counts how often each planned region is entered through
``nn.Module.__call__`` (where the engine attaches the compiled callable), and runs the model eagerly
and through ``engine.prepare(...).run(...)`` with the ``aot_eager`` backend. No server is started.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from harness import COMFY_DIR, HOST_ENV, HOST_VERSION, PYTHON, host_env  # the host TCS_COMFY_HOST selects

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "regions" / "build_tiny_models.py"


def _blocks(attr, n):
    return [f"{attr}.{i}" for i in range(n)]


FLUX_LIKE = _blocks("double_blocks", 2) + _blocks("single_blocks", 2)
# a SpatialTransformer is planned as its transformer blocks, an Upsample stays eager
# (see regions._layer_paths)
_ST = "transformer_blocks"
UNET_SD15 = ["input_blocks.0.0", "input_blocks.1.0", f"input_blocks.1.1.{_ST}.0", "input_blocks.2.0",
             "input_blocks.3.0", f"input_blocks.3.1.{_ST}.0", "middle_block.0", f"middle_block.1.{_ST}.0",
             "middle_block.2", "output_blocks.0.0", f"output_blocks.0.1.{_ST}.0", "output_blocks.1.0",
             f"output_blocks.1.1.{_ST}.0", "output_blocks.2.0", f"output_blocks.2.1.{_ST}.0",
             "output_blocks.3.0", f"output_blocks.3.1.{_ST}.0"]
UNET_SDXL = ["input_blocks.0.0", "input_blocks.1.0", "input_blocks.2.0", "input_blocks.3.0",
             f"input_blocks.3.1.{_ST}.0", f"input_blocks.3.1.{_ST}.1", "middle_block.0",
             f"middle_block.1.{_ST}.0", f"middle_block.1.{_ST}.1", "middle_block.2", "output_blocks.0.0",
             f"output_blocks.0.1.{_ST}.0", f"output_blocks.0.1.{_ST}.1", "output_blocks.1.0",
             f"output_blocks.1.1.{_ST}.0", f"output_blocks.1.1.{_ST}.1", "output_blocks.2.0", "output_blocks.3.0"]

# case -> (real class, family, planned paths, describe())
PLANS = {
    "wan": ("comfy.ldm.wan.model.WanModel", "WanModel", _blocks("blocks", 3), "WanAttentionBlock x3"),
    "vace_wan": ("comfy.ldm.wan.model.VaceWanModel", "WanModel",
                 _blocks("blocks", 2) + ["vace_blocks.0"], "WanAttentionBlock x2, VaceWanAttentionBlock x1"),
    "flux": ("comfy.ldm.flux.model.Flux", "Flux", FLUX_LIKE, "DoubleStreamBlock x2, SingleStreamBlock x2"),
    "chroma": ("comfy.ldm.chroma.model.Chroma", "Chroma", FLUX_LIKE,
               "DoubleStreamBlock x2, SingleStreamBlock x2"),
    "hunyuan_video": ("comfy.ldm.hunyuan_video.model.HunyuanVideo", "HunyuanVideo", FLUX_LIKE,
                      "DoubleStreamBlock x2, SingleStreamBlock x2"),
    "ltxv": ("comfy.ldm.lightricks.model.LTXVModel", "LTXVModel", _blocks("transformer_blocks", 2),
             "BasicTransformerBlock x2"),
    "qwen_image": ("comfy.ldm.qwen_image.model.QwenImageTransformer2DModel", "QwenImageTransformer2DModel",
                   _blocks("transformer_blocks", 2), "QwenImageTransformerBlock x2"),
    # TimestepEmbedSequential blocks are planned as their layers: ComfyUI's UNet runs them through
    # forward_timestep_embed(), which never calls the block itself (see regions._block_paths).
    "unet_sd15": ("comfy.ldm.modules.diffusionmodules.openaimodel.UNetModel", "UNetModel", UNET_SD15,
                  "Conv2d x1, ResBlock x8, BasicTransformerBlock x7, Downsample x1"),
    "unet_sdxl": ("comfy.ldm.modules.diffusionmodules.openaimodel.UNetModel", "UNetModel", UNET_SDXL,
                  "Conv2d x1, ResBlock x8, Downsample x1, BasicTransformerBlock x8"),
}
UNKNOWN = "unknown_aura"

# Dynamo graphs of the first compiled run (aot_eager). Identical blocks share one graph, so under
# the default shape policy ('auto': region inputs made contiguous, latent dims dynamic) the count is
# the number of distinct block structures:
#   wan: 3 WanAttentionBlocks -> 1; vace_wan: + VaceWanAttentionBlock -> 2;
#   flux/chroma/hunyuan_video: DoubleStreamBlock + SingleStreamBlock -> 2; ltxv, qwen_image -> 1;
#   unknown (whole model) -> 1.
# The UNet runs with the 'static' policy (see RUN_POLICY in the script), where a layer also gets its
# own graph per input shape/stride: 9 distinct conv/ResBlock/Downsample layer+input pairs, plus
# one graph per SpatialTransformer's block (7), because ComfyUI's UNet passes the block's position in
# transformer_options and the transformer blocks look patches up by it (Upsample stays eager).
GRAPHS = {"wan": 1, "vace_wan": 2, "flux": 2, "chroma": 2, "hunyuan_video": 2, "ltxv": 1,
          "qwen_image": 1, "unet_sd15": 16, UNKNOWN: 1}
RUN = tuple(GRAPHS)


@pytest.fixture(scope="module")
def results():
    if not (COMFY_DIR / "comfy").is_dir():
        pytest.skip(f"ComfyUI host {HOST_VERSION} not found at {COMFY_DIR} (run scripts/bootstrap.sh)")
    # the script resolves its host the same way; pass the folder so both use the very same one
    env = host_env(**{HOST_ENV: str(COMFY_DIR)})
    proc = subprocess.run([PYTHON, str(SCRIPT), "--cases", ",".join([*PLANS, UNKNOWN]), "--run", ",".join(RUN)],
                          cwd=COMFY_DIR, env=env, capture_output=True, text=True, timeout=300)
    out = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            rec = json.loads(line)
            out[rec["case"]] = rec
    errors = {k: v.get("traceback") or v["error"] for k, v in out.items() if "error" in v}
    missing = sorted({*PLANS, UNKNOWN} - set(out))
    assert not errors and not missing and proc.returncode == 0, (
        f"host={HOST_VERSION} ({COMFY_DIR})\nrc={proc.returncode}\nerrors={errors}\nmissing={missing}\nstderr tail:\n{proc.stderr[-4000:]}")
    return out


@pytest.mark.parametrize("case", list(PLANS))
def test_plan_finds_the_repeated_blocks(results, case):
    cls, family, paths, describe = PLANS[case]
    rec = results[case]
    assert rec["class"] == cls
    assert rec["family"] == family
    assert rec["regional"] is True
    assert rec["paths"] == paths
    assert rec["describe"] == describe
    assert rec["logs"] == []  # no "whole diffusion model" fallback line for a known family


@pytest.mark.parametrize("case", list(PLANS))
def test_every_region_is_entered_through_call(results, case):
    """The engine attaches the compiled callable as ``_compiled_call_impl``, used only when a module
    is *called*; a region the model runs some other way would silently stay eager."""
    calls = results[case]["calls"]
    assert set(calls) == set(PLANS[case][2])
    assert all(n >= 1 for n in calls.values()), calls


def test_unknown_model_compiles_whole_model(results):
    rec = results[UNKNOWN]
    assert rec["class"] == "comfy.ldm.aura.mmdit.MMDiT"
    assert rec["paths"] == [""]
    assert rec["regional"] is False and rec["family"] == ""
    assert rec["describe"] == "whole model (MMDiT)"
    assert any("whole diffusion model" in line and "MMDiT" in line for line in rec["logs"]), rec["logs"]


@pytest.mark.parametrize("case", RUN)
def test_compiled_matches_eager(results, case):
    run = results[case]["run"]
    assert run["failed"] == "", run["failed"]  # no fallback to eager
    assert run["finite"] and run["out_scale"] > 0.1, run
    tol = 1e-4 * max(1.0, run["out_scale"])
    assert run["max_abs_diff"] < tol, run
    assert run["max_abs_diff_second"] < tol, run
    assert run["leftover_compiled_call_impl"] == [], run  # detached after every call


@pytest.mark.parametrize("case", RUN)
def test_graph_count_is_one_per_distinct_block(results, case):
    run = results[case]["run"]
    assert run["regions_called"] == run["regions"], run
    # static shapes: one graph per distinct (layer structure, input layout); otherwise per structure
    expected = run["distinct_region_signatures" if run["shape_policy"] == "static" else "distinct_region_structures"]
    assert run["graphs_first"] == expected == GRAPHS[case], json.dumps(run)
    assert run["graphs_second"] == 0, run  # the second call reuses every graph


def test_identical_blocks_share_graphs(results):
    """Depth does not multiply compile work: 3 WAN blocks, 2 LTXV/Qwen blocks, 2+2 Flux blocks."""
    for case in ("wan", "ltxv", "qwen_image", "flux", "hunyuan_video"):
        run = results[case]["run"]
        assert run["graphs_first"] < run["regions"], (case, run)
