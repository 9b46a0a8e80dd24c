"""ComfyUI 0.33 on the GPU (no ``--cpu``): its loader gives a dynamic-VRAM model (comfy-aimdo),
and Apply Torch Compile with the node's defaults compiles a non-dynamic clone in the background
that, once swapped in, samples like eager. With ``TCS_GPU_TEST_DEVICE=cpu`` the same prompts run on ``--cpu`` (no dynamic VRAM
there), to check the test itself."""
from __future__ import annotations

import os

import pytest

from harness import (ComfyHost, HOST_VERSION, counters_delta, fallback_lines, new_graphs, pack_lines, rel_l2,
                     wan_t2v_prompt)
from test_dynamic_vram import HAS_DYNAMIC_VRAM, TURNED_OFF

pytestmark = pytest.mark.skipif(not HAS_DYNAMIC_VRAM, reason=f"ComfyUI {HOST_VERSION} has no dynamic VRAM")
ON_GPU = os.environ.get("TCS_GPU_TEST_DEVICE", "cuda") == "cuda"  # (the folder's conftest skips it without CUDA)
ENABLED = "DynamicVRAM support detected and enabled"  # ComfyUI's start-up line (main.py)


def test_the_node_defaults_on_a_dynamic_vram_model_compile_a_clone_that_samples_like_eager(
        tmp_path, tiny_wan_path, tiny_wan):
    with ComfyHost(tmp_path / "server", models=[tiny_wan_path], cpu=not ON_GPU) as host:
        start = host.log_text()
        assert (ENABLED in start) == ON_GPU, start[-3000:]
        eager_hist = host.run(wan_t2v_prompt(tiny_wan, apply=False, prefix="eager"))
        before = host.probe(eager_hist)["counters"]
        # the defaults compile in the background: the first prompt runs eagerly, the next compiled
        hist, log = host.run_compiled(lambda: wan_t2v_prompt(tiny_wan, compile_settings={"mode": "speed"},
                                                             prefix="compiled"), timeout=900)
        report = host.probe(hist)
        assert report["pack_status"]["state"] in ("cold", "warm"), report["pack_status"]
        assert report["pack_status"]["mode"] == "default"  # the speed preset, as Apply compiles it
        assert new_graphs(counters_delta(before, report["counters"])) >= 1
        assert len(pack_lines(log, TURNED_OFF)) == ON_GPU, log
        assert pack_lines(log, "compiled WanAttentionBlock x2") and not fallback_lines(log), log
        assert rel_l2(host.latent(hist), host.latent(eager_hist)) < 1e-2
