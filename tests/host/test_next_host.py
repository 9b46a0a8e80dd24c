"""The overlay host only (``TCS_COMFY_HOST=next``: ComfyUI 0.33.0 with the post-0.33 overlay,
reporting 0.38.1): what a compile pack meets there that the other hosts do not.

- WAN's attention blocks carry a ``comfy_attention`` submodule (``ComfyAttention``, passed as
  ``preferred_attention=``): it stays inside the compiled block (one region per block, as on
  0.33), and the compiled output matches eager.
- ComfyUI's memory compiler (``comfy/model_prefetch.py``) is loaded: on the CPU it records
  nothing (``malloc_graph_enabled`` is False), so the pack's pause of it is a no-op here;
  with ``--disable-comfy-compiler`` the server starts and compiles the same. The pause itself is
  tested with a fake of the module (``tests/unit/test_memory_compiler.py``).
- ``modulate()`` through comfy-kitchen's ``adaln`` op and a checkpoint's ``ComfyAttention.function``
  run only on CUDA; a FAKE of the GPU (``TCSTestCudaPaths``) takes them on the CPU: the op
  compiles inside the block (one new graph for both blocks), and a function set after the compile
  is never served by the graph traced without it.
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


def _cuda_paths(tiny_wan, path, tag, apply=True):
    """A prompt whose model goes through ``TCSTestCudaPaths`` (``path``) before Apply (or the sampler)."""
    p = wan_t2v_prompt(tiny_wan, apply=apply, compile_settings=FAST if apply else None, prefix=f"{tag}_{path}")
    p["cuda"] = {"class_type": "TCSTestCudaPaths", "inputs": {"model": ["loader", 0], "path": path}}
    for node in (("apply",) if apply else ("sampler", "probe")):
        p[node]["inputs"]["model"] = ["cuda", 0]
    return p


def test_kitchens_adaln_op_compiles_inside_the_block(comfy_host, tiny_wan):
    host = comfy_host
    try:
        plain = host.latent(host.run(_cuda_paths(tiny_wan, "none", "ck", apply=False)))
        eager = host.latent(host.run(_cuda_paths(tiny_wan, "adaln", "ck", apply=False)))
        assert rel_l2(eager, plain) < 1e-5  # the op computes what the addcmul path does
        before = host.probe(host.run(_cuda_paths(tiny_wan, "none", "ck")))["pack_status"]["graphs"]
        offset = host.log_offset()
        hist = host.run(_cuda_paths(tiny_wan, "adaln", "ck"))
        status = host.probe(hist)["pack_status"]
        assert rel_l2(host.latent(hist), eager) < 1e-3
        # one new graph serves both blocks (modulate is a new global): a break at the op would
        # split each block into pieces, more than one new graph
        assert status["graphs"] == before + 1 and not status["fallback_reason"], (before, status)
        assert not fallback_lines(host.log_text(since=offset))
    finally:
        host.run(_cuda_paths(tiny_wan, "none", "ck_reset", apply=False))


def test_an_attention_function_set_after_the_compile_is_never_run_stale(comfy_host, tiny_wan):
    host = comfy_host
    try:
        eager = host.latent(host.run(_cuda_paths(tiny_wan, "none", "fn", apply=False)))
        compiled = host.latent(host.run(_cuda_paths(tiny_wan, "none", "fn")))
        assert rel_l2(compiled, eager) < 1e-3
        eager_fn = host.latent(host.run(_cuda_paths(tiny_wan, "attention_function", "fn", apply=False)))
        assert rel_l2(eager_fn, eager) > 1e-2  # the stand-in attention changes the output
        hist = host.run(_cuda_paths(tiny_wan, "attention_function", "fn"))
        assert rel_l2(host.latent(hist), eager_fn) < 1e-3, "the graph traced without the function ran"
        assert host.probe(hist)["comfy_attention_modules"] == 4
    finally:
        host.run(_cuda_paths(tiny_wan, "none", "fn_reset", apply=False))
