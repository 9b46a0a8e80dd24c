"""On a real ComfyUI server: Apply Torch Compile (VAE).

Tiny random-weight VAEs loaded by ComfyUI's own VAELoader (``vae_models.py``): a WAN 2.1 video
VAE and an SD-style image VAE. For each, with inductor:

- prompt 0 decodes with the original VAE (the eager references: full and tiled);
- prompt 1 decodes through Apply Torch Compile (VAE): it compiles, no fallback, and matches eager;
- prompt 2 decodes a second latent size, full and tiled (tiles of other sizes), compiled, and
  again with the original VAE: 0 new graphs, compiled matches eager, and the original VAE's
  decode is bit-identical to prompt 0's, with no compile attached and no instance override.
"""
import pytest
import safetensors.torch

from harness import counters_delta, new_graphs, rel_l2, settings_inputs
from vae_models import make_tiny_vae

# kind -> (latent channels, frames (0: an image latent), size A (h, w), size B (h, w), region)
CASES = {
    "wan": (16, 2, (4, 4), (4, 10), "RMS_norm x"),
    "image": (4, 0, (6, 6), (10, 6), "ResnetBlock x"),
}
TILED = {"tile_size": 64, "overlap": 32, "temporal_size": 64, "temporal_overlap": 8}


def _link_vae(host, kind) -> str:
    path = make_tiny_vae(kind)
    folder = host.base_dir / "models" / "vae"
    folder.mkdir(parents=True, exist_ok=True)
    link = folder / path.name
    if not link.exists():
        link.symlink_to(path)
    return path.name


def _decode_nodes(p, tag, vae_ref, latent_ref, tiled=False):
    """VAEDecode(Tiled) -> TCSTestVAEProbe ``probe<tag>`` (saves the images as ``<tag>``)."""
    decoder = {"class_type": "VAEDecodeTiled", "inputs": {**TILED}} if tiled else \
        {"class_type": "VAEDecode", "inputs": {}}
    decoder["inputs"].update({"samples": latent_ref, "vae": vae_ref})
    p[f"dec{tag}"] = decoder
    p[f"probe{tag}"] = {"class_type": "TCSTestVAEProbe", "inputs": {
        "images": [f"dec{tag}", 0], "vae": vae_ref, "label": tag}}


def _prompt(vae_name, kind, size, decodes, compile_settings=None):
    """``decodes``: (tag, compiled?, tiled?) triples, all on one latent of ``size``."""
    channels, frames, *_ = CASES[kind]
    p = {"vae": {"class_type": "VAELoader", "inputs": {"vae_name": vae_name}},
         "latent": {"class_type": "TCSTestRandomLatent", "inputs": {
             "channels": channels, "frames": frames, "height": size[0], "width": size[1], "seed": 7}},
         "settings": {"class_type": "TorchCompileSpeedSettings",
                      "inputs": settings_inputs(**(compile_settings or {"backend": "inductor"}))},
         "cvae": {"class_type": "ApplyTorchCompileVAE", "inputs": {
             "vae": ["vae", 0], "compile_args": ["settings", 0], "compile": "decode"}}}
    for tag, compiled, tiled in decodes:
        _decode_nodes(p, tag, ["cvae" if compiled else "vae", 0], ["latent", 0], tiled)
    return p


def _images(report):
    return safetensors.torch.load_file(report["file"])["images"]


def test_vae_node_listed(comfy_host):
    info = comfy_host.object_info("ApplyTorchCompileVAE")
    assert info["display_name"] == "Apply Torch Compile (VAE)" and info["category"] == "optimization"
    assert info["input_order"]["required"] == ["vae", "compile_args", "compile"]
    req = info["input"]["required"]
    assert req["compile_args"][0] == "WANCOMPILEARGS"
    assert req["compile"][0] == ["decode", "encode", "both"] and req["compile"][1]["default"] == "decode"
    assert info["output"] == ["VAE"] and info["output_name"] == ["vae"]


@pytest.mark.slow
@pytest.mark.parametrize("kind,backend", [("wan", "inductor"), ("image", "aot_eager")])
def test_vae_compile_matches_eager_one_graph_set_for_all_sizes(comfy_host, kind, backend):
    """The WAN VAE through inductor; the image VAE through aot_eager (the graph count at a new
    size is dynamo's decision, the same under both backends; inductor's cold compile of the
    image VAE's 8 graphs would take minutes of CI time)."""
    _, _, size_a, size_b, region = CASES[kind]
    name = _link_vae(comfy_host, kind)
    offset = comfy_host.log_offset()
    settings = {"backend": backend}
    ref = comfy_host.run(_prompt(name, kind, size_a, [(f"{kind}_refA", False, False)]))
    ref_a = _images(comfy_host.probe(ref, f"probe{kind}_refA"))
    ref = comfy_host.run(_prompt(name, kind, size_b, [(f"{kind}_refB", False, False),
                                                     (f"{kind}_refBt", False, True)]))
    ref_b, ref_bt = (_images(comfy_host.probe(ref, f"probe{kind}_{t}")) for t in ("refB", "refBt"))

    first = comfy_host.run(_prompt(name, kind, size_a, [(f"{kind}_cA", True, False)], settings))
    pa = comfy_host.probe(first, f"probe{kind}_cA")
    assert pa["compiled"] and not pa["compiled"]["failed"] and pa["compiled"]["graphs"] >= 1, pa["compiled"]
    assert rel_l2(_images(pa), ref_a) < 1e-3

    second = comfy_host.run(_prompt(name, kind, size_b, [(f"{kind}_cB", True, False),
                                                        (f"{kind}_cBt", True, True),
                                                        (f"{kind}_eB", False, False)], settings))
    pb, pbt, pe = (comfy_host.probe(second, f"probe{kind}_{t}") for t in ("cB", "cBt", "eB"))
    # a second latent size, and tiles of other sizes, reuse the first prompt's graphs
    last = max((pb, pbt, pe), key=lambda r: sum(r["counters"].get("stats", {}).values()))
    assert new_graphs(counters_delta(pa["counters"], last["counters"])) == 0
    assert pbt["compiled"]["graphs"] == pa["compiled"]["graphs"] and pbt["compiled"]["runs"] >= 2
    assert rel_l2(_images(pb), ref_b) < 1e-3
    assert rel_l2(_images(pbt), ref_bt) < 1e-3
    # the original VAE: same module, no compile attached, output bit-identical to before
    assert pe["model_id"] == pb["model_id"] and pe["vae_id"] != pb["vae_id"]
    assert pe["compiled"] is None and pe["instance_methods"] == []
    assert pe["modules_with_compiled_call_impl"] == 0 and pb["modules_with_compiled_call_impl"] == 0
    assert pb["instance_methods"] == ["decode", "decode_tiled"]
    assert (_images(pe) == ref_b).all()
    log = comfy_host.log_text(since=offset)
    assert f"compiled {region}" in log and "eagerly" not in log, log[-3000:]


def test_vae_compile_failure_falls_back_to_eager(comfy_host):
    """A backend that raises: the decode runs eagerly, same output, the log says why."""
    name = _link_vae(comfy_host, "wan")
    offset = comfy_host.log_offset()
    hist = comfy_host.run(_prompt(name, "wan", (4, 4), [("wan_fbE", False, False), ("wan_fbC", True, False)],
                                  {"backend": "tcs_test_raising_backend"}))
    pe, pc = comfy_host.probe(hist, "probewan_fbE"), comfy_host.probe(hist, "probewan_fbC")
    assert pc["compiled"]["failed"] and pc["compiled"]["graphs"] == 0
    assert (_images(pc) == _images(pe)).all()
    assert "this model now runs eagerly" in comfy_host.log_text(since=offset)


def test_wan_vae_encode_and_decode_compiled(comfy_host):
    """compile 'both': VAEEncode and VAEDecode run compiled (aot_eager: real dynamo tracing, no
    C++ build) and match the eager VAE; the encoder's RMS_norms are regions too."""
    name = _link_vae(comfy_host, "wan")
    p = _prompt(name, "wan", (4, 4), [("wan_src", False, False)], {"backend": "aot_eager"})
    p["cvae"]["inputs"]["compile"] = "both"
    for tag, vae in (("encC", "cvae"), ("encE", "vae")):
        p[tag] = {"class_type": "VAEEncode", "inputs": {"pixels": ["decwan_src", 0], "vae": [vae, 0]}}
        p[f"probe{tag}"] = {"class_type": "TCSTestVAEProbe", "inputs": {
            "samples": [tag, 0], "vae": [vae, 0], "label": f"wan_{tag}"}}
    _decode_nodes(p, "wan_bothC", ["cvae", 0], ["encC", 0])
    hist = comfy_host.run(p)
    pc, pe = comfy_host.probe(hist, "probeencC"), comfy_host.probe(hist, "probeencE")
    pd = comfy_host.probe(hist, "probewan_bothC")
    assert pc["instance_methods"] == ["decode", "decode_tiled", "encode", "encode_tiled"]
    assert "RMS_norm x" in pc["compiled"]["regions"] and not pc["compiled"]["failed"]
    assert pd["compiled"]["runs"] >= 2 and pd["compiled"]["graphs"] >= 1
    assert rel_l2(_images(pc), _images(pe)) < 1e-3
    assert pe["compiled"] is None and pe["modules_with_compiled_call_impl"] == 0
