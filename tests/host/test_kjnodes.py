"""KJNodes (the real pack, ``.host/ComfyUI-KJNodes``) in the same ComfyUI server and graph as this
pack, as users combine them:

- KJ's TorchCompileModelAdvanced before Apply Torch Compile: Apply replaces KJ's wrapper, says
  so naming KJ's node (not core's), and the compile kwargs KJ left in ``model_options`` leave
  with it (other packs read them as "this model is compiled").
- KJ's node after Apply: KJ's compile runs the model and the pack steps aside, said once, with
  no failure; the same Apply alone in the next workflow compiles (a KJ compile that traced the
  pack's runtime used to fail it for good, and the model then ran eagerly until a restart).
- KJ's process-wide ``torch._dynamo.disable`` of comfy.ops' weight casts (what its dynamic-VRAM
  compile does): reported once by Apply, with what it costs.
- KJ's TorchCompileVAE: the decoder it compiled is not compiled a second time inside, one line.

Every output matches eager within 1e-3.
"""
import pytest

from harness import REPO_ROOT, ComfyHost, fallback_lines, pack_lines, rel_l2, settings_inputs, wan_t2v_prompt

KJ_PACK = REPO_ROOT / ".host" / "ComfyUI-KJNodes"
FAST = {"backend": "aot_eager", "background_compile": False}
KJ = "KJNodes' TorchCompileModelAdvanced"


def kj_compile(model_ref, backend="cudagraphs"):
    """KJ's node as a user sets it; "cudagraphs" on the CPU runs dynamo's trace (where KJ's
    compile met the pack's runtime) without minutes of inductor compile."""
    return {"class_type": "TorchCompileModelAdvanced", "inputs": {
        "model": list(model_ref), "backend": backend, "fullgraph": False, "mode": "default",
        "dynamic": "false", "compile_transformer_blocks_only": True, "dynamo_cache_size_limit": 64,
        "debug_compile_keys": False}}


@pytest.fixture(scope="module")
def kj_host(tmp_path_factory, tiny_wan_path):
    if not (KJ_PACK / "__init__.py").is_file():
        pytest.skip(f"KJNodes is not unpacked at {KJ_PACK} (scripts/bootstrap.sh)")
    host = ComfyHost(tmp_path_factory.mktemp("kj_host"), models=[tiny_wan_path])
    ComfyHost._link(KJ_PACK, host.base_dir / "custom_nodes" / "ComfyUI-KJNodes")
    with host:
        try:
            host.object_info("TorchCompileModelAdvanced")
        except Exception:  # noqa: BLE001 - the log says why
            pytest.fail("KJNodes did not load:\n" + host.log_tail())
        yield host


@pytest.fixture(scope="module")
def eager_ref(kj_host, tiny_wan):
    return kj_host.latent(kj_host.run(wan_t2v_prompt(tiny_wan, apply=False, prefix="kj_eager")))


def test_kj_compile_before_apply_is_replaced_naming_kjs_node(kj_host, tiny_wan, eager_ref):
    offset = kj_host.log_offset()
    p = wan_t2v_prompt(tiny_wan, compile_settings=FAST, prefix="kj_then_ours")
    p["kj"] = kj_compile(["loader", 0])
    p["apply"]["inputs"]["model"] = ["kj", 0]
    hist = kj_host.run(p)
    log = kj_host.log_text(since=offset)
    replaced = pack_lines(log, f"replaced {KJ} wrapper")
    assert len(replaced) == 1 and f"Remove {KJ} from" in replaced[0], log
    assert not pack_lines(log, "core's TorchCompileModel"), log
    probe = kj_host.probe(hist)
    assert probe["apply_model_wrapper_keys"] == ["torch_compile_speed"], probe
    assert "torch_compile_kwargs" not in probe["model_options_keys"], probe
    assert probe["pack_status"]["graphs"] >= 1 and not probe["pack_status"]["fallback_reason"], probe
    assert rel_l2(kj_host.latent(hist), eager_ref) < 1e-3


def test_kj_compile_after_apply_runs_and_apply_alone_still_compiles_next(kj_host, tiny_wan, eager_ref):
    offset = kj_host.log_offset()
    p = wan_t2v_prompt(tiny_wan, compile_settings=FAST, prefix="ours_then_kj")
    p["kj"] = kj_compile(["apply", 0])
    p["sampler"]["inputs"]["model"] = ["kj", 0]
    p["probe"]["inputs"]["model"] = ["kj", 0]
    hist = kj_host.run(p)
    log = kj_host.log_text(since=offset)
    aside = pack_lines(log, "also carries another torch.compile wrapper")
    assert len(aside) == 1 and KJ in aside[0] and "steps aside" in aside[0], log
    assert not fallback_lines(log) and "forbidden callable" not in log, log
    assert rel_l2(kj_host.latent(hist), eager_ref) < 1e-3
    assert not kj_host.probe(hist)["pack_status"]["fallback_reason"]

    # the next workflow: the same Apply, no KJ node: the pack compiles its regions
    offset = kj_host.log_offset()
    alone = kj_host.run(wan_t2v_prompt(tiny_wan, compile_settings=FAST, prefix="ours_alone"))
    status = kj_host.probe(alone)["pack_status"]
    assert status["graphs"] >= 1 and status["runs"] >= 1 and not status["fallback_reason"], status
    log = kj_host.log_text(since=offset)
    assert not fallback_lines(log), log
    assert rel_l2(kj_host.latent(alone), eager_ref) < 1e-3


def _vae_prompt(vae_name, kj_first, tag):
    from test_vae_compile import CASES, _decode_nodes
    channels, frames, size, *_ = CASES["image"]
    p = {"vae": {"class_type": "VAELoader", "inputs": {"vae_name": vae_name}},
         "latent": {"class_type": "TCSTestRandomLatent", "inputs": {
             "channels": channels, "frames": frames, "height": size[0], "width": size[1], "seed": 7}}}
    vae_ref = ["vae", 0]
    if kj_first:
        p["kjvae"] = {"class_type": "TorchCompileVAE", "inputs": {
            "vae": ["vae", 0], "backend": "cudagraphs", "fullgraph": False, "mode": "default",
            "compile_encoder": False, "compile_decoder": True}}
        p["settings"] = {"class_type": "TorchCompileSpeedSettings",
                         "inputs": settings_inputs(backend="aot_eager")}
        p["cvae"] = {"class_type": "ApplyTorchCompileVAE", "inputs": {
            "vae": ["kjvae", 0], "compile_args": ["settings", 0], "compile": "decode"}}
        vae_ref = ["cvae", 0]
    _decode_nodes(p, tag, vae_ref, ["latent", 0])
    return p


def test_kjs_compiled_vae_decoder_is_not_compiled_again_inside(kj_host):
    from test_vae_compile import _images, _link_vae
    name = _link_vae(kj_host, "image")
    ref = _images(kj_host.probe(kj_host.run(_vae_prompt(name, False, "kjv_ref")), "probekjv_ref"))
    offset = kj_host.log_offset()
    report = kj_host.probe(kj_host.run(_vae_prompt(name, True, "kjv_c")), "probekjv_c")
    log = kj_host.log_text(since=offset)
    said = pack_lines(log, "already compiled by another node's torch.compile")
    assert len(said) == 1 and "decoder" in said[0] and "KJNodes' TorchCompileVAE" in said[0], log
    assert report["compiled"] is None and report["modules_with_compiled_call_impl"] == 0, report
    assert not pack_lines(log, "compiled ResnetBlock"), log
    assert rel_l2(_images(report), ref) < 1e-3


def test_kjs_disabled_weight_casts_are_reported_once(make_host, tiny_wan):
    """A server of its own: KJ's patch lasts for the process."""
    if not (KJ_PACK / "__init__.py").is_file():
        pytest.skip(f"KJNodes is not unpacked at {KJ_PACK} (scripts/bootstrap.sh)")
    host = make_host(start=False)
    ComfyHost._link(KJ_PACK, host.base_dir / "custom_nodes" / "ComfyUI-KJNodes")
    host.start()
    eager = host.latent(host.run(wan_t2v_prompt(tiny_wan, apply=False, prefix="dc_eager")))
    offset = host.log_offset()
    first = host.run(wan_t2v_prompt(tiny_wan, compile_settings=FAST, prefix="dc_before"))
    assert not pack_lines(host.log_text(since=offset), "torch._dynamo.disable")
    patched = host.run({"latent": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {
        "width": 64, "height": 64, "length": 1, "batch_size": 1}},
        "kjpatch": {"class_type": "TCSTestKJDisableWeightCasts", "inputs": {"samples": ["latent", 0]}}})
    assert "cast_bias_weight" in host.outputs(patched, "kjpatch")["disabled"]
    for i in range(2):
        hist = host.run(wan_t2v_prompt(tiny_wan, compile_settings={**FAST, "mode": "max-autotune-no-cudagraphs"}
                                       if i else FAST, prefix=f"dc_after{i}"))
        assert rel_l2(host.latent(hist), eager) < 1e-3
    said = pack_lines(host.log_text(since=offset), "marked torch._dynamo.disable")
    assert len(said) == 1, said
    assert "cast_bias_weight" in said[0] and "KJNodes' TorchCompileModelAdvanced" in said[0]
    assert "N+1 graphs instead of one" in said[0]
    assert rel_l2(host.latent(first), eager) < 1e-3
