"""The overlay host only (``TCS_COMFY_HOST=next``: ComfyUI 0.33.0 with the post-0.33 overlay,
reporting 0.38.1): what a compile pack meets there that the other hosts do not.

- WAN's attention blocks carry a ``comfy_attention`` submodule (``ComfyAttention``, passed as
  ``preferred_attention=``): it stays inside the compiled block (one region per block, as on
  0.33), and the compiled output matches eager.
- ComfyUI's memory compiler (``comfy/model_prefetch.py``) is loaded: on the CPU it records
  nothing (``malloc_graph_enabled`` is False), so the pack's pause of it is a no-op here;
  with ``--disable-comfy-compiler`` the server starts and compiles the same. The pause itself is
  tested with a fake of the module (``tests/unit/test_memory_compiler.py``); ``ck.adaln`` and
  ``ComfyAttention.function`` run only on CUDA.
"""
import pytest

from harness import HOST_CONFIG, fallback_lines, rel_l2, wan_t2v_prompt

pytestmark = pytest.mark.skipif(HOST_CONFIG.get("overlay") != "next",
                                reason="the overlay host only (TCS_COMFY_HOST=next)")
FAST = {"backend": "aot_eager", "background_compile": False}


def _compiled_matches_eager(host, tiny_wan, tag):
    eager = host.latent(host.run(wan_t2v_prompt(tiny_wan, apply=False, prefix=f"{tag}_e")))
    offset = host.log_offset()
    hist = host.run(wan_t2v_prompt(tiny_wan, compile_settings=FAST, prefix=f"{tag}_c"))
    probe = host.probe(hist)
    assert rel_l2(host.latent(hist), eager) < 1e-3
    assert not fallback_lines(host.log_text(since=offset))
    return probe


def test_the_overlay_is_what_the_server_runs(comfy_host):
    stats = comfy_host.get("/system_stats")["system"]
    assert stats["comfyui_version"] == "0.38.1", stats


def test_comfy_attention_stays_inside_the_compiled_block(comfy_host, tiny_wan):
    probe = _compiled_matches_eager(comfy_host, tiny_wan, "ca")
    assert probe["comfy_attention_modules"] == 4, probe  # self- and cross-attention of its 2 blocks
    status = probe["pack_status"]
    assert status["regions"] == "WanAttentionBlock x2" and status["graphs"] >= 1, status


def test_with_the_memory_compiler_off_the_pack_compiles_the_same(make_host, tiny_wan):
    host = make_host(extra_args=["--disable-comfy-compiler"])
    probe = _compiled_matches_eager(host, tiny_wan, "nocc")
    assert probe["pack_status"]["graphs"] >= 1 and not probe["pack_status"]["fallback_reason"]
