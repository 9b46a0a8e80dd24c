"""Smoke test of the harness on a real ComfyUI server, without TorchCompileSpeed's own nodes."""
import time

import pytest
import torch

from harness import (PACK_NAME, PromptError, counters_delta, make_tiny_wan, pack_lines, wan_consumer_nodes,
                     wan_t2v_prompt, wan_two_branch_prompt)


def run_latent(host, model, **kw):
    hist = host.run(wan_t2v_prompt(model, apply=False, **kw))
    return host.latent(hist, "save"), host.probe(hist, "probe")


def ref_args_node(drop_keys=""):
    return {"ref": {"class_type": "TCSTestReferenceCompileArgs",
                    "inputs": {"backend": "eager", "mode": "default", "drop_keys": drop_keys}}}


def test_server_has_core_and_test_nodes(comfy_host):
    info = comfy_host.object_info()
    for node in ("KSampler", "UNETLoader", "EmptyHunyuanLatentVideo", "SaveLatent", "TCSTestProbe",
                 "TCSTestZeroConditioning", "TCSTestLatentAfter", "TCSTestWanStyleConsumer"):
        assert node in info, node
    assert comfy_host.object_info("TCSTestProbe")["output_node"] is True
    assert "custom_nodes/tcs_test_nodes" in comfy_host.log_text()


def test_eager_wan_run_is_real_and_deterministic(comfy_host, tiny_wan):
    a, probe = run_latent(comfy_host, tiny_wan, seed=0, prefix="s0")
    assert list(a.shape) == [1, 16, 2, 16, 16]
    assert torch.isfinite(a).all() and 0.1 < a.std().item() < 100

    t0 = time.perf_counter()
    a2, _ = run_latent(comfy_host, tiny_wan, seed=0, prefix="s0b")  # fresh nonce: really re-samples
    eager_s = time.perf_counter() - t0
    print(f"\neager 4-step run after load (HTTP round trip included): {eager_s:.3f}s")
    assert eager_s < 2.0
    assert torch.equal(a, a2)

    b, _ = run_latent(comfy_host, tiny_wan, seed=1, prefix="s1")
    assert (a - b).abs().mean() > 0.1 * a.abs().mean()

    # Same noise seed, other weights: the output must move, so the model does real work.
    other = comfy_host.add_model(make_tiny_wan(num_layers=2, dim=256, seed=1))
    c, _ = run_latent(comfy_host, other, seed=0, prefix="w1")
    assert (a - c).abs().mean() > 0.1 * a.abs().mean()

    assert probe["label"] == "s0" and probe["diffusion_model_type"] == "WanModel"
    assert probe["state_dict_has_orig_mod"] is False and probe["is_optimized_module"] is False
    assert probe["modules_with_compiled_call_impl"] == 0 and probe["apply_model_wrapper_keys"] == []
    assert isinstance(probe["counters"], dict) and isinstance(probe["stats"], dict)


def test_wan_style_consumer_accepts_reference_dict(comfy_host, tiny_wan):
    extra = {**ref_args_node(), **wan_consumer_nodes(("ref", 0))}
    hist = comfy_host.run(wan_t2v_prompt(tiny_wan, apply=False, prefix="consumer", extra_nodes=extra))
    rep = comfy_host.outputs(hist, "consumer")["consumer"][0]
    assert rep["ran"] and rep["finite"] and rep["output_shape"] == [1, 128, 256]
    assert len(rep["keys"]) == 9 and rep["values"]["backend"] == "eager" and rep["values"]["mode"] == "default"


def test_rejected_and_failed_prompts_are_reported(comfy_host, tiny_wan):
    code, body = comfy_host.post_prompt_raw(wan_t2v_prompt("no_such_model.safetensors", apply=False))
    assert code == 400 and body["node_errors"]

    extra = {**ref_args_node("force_parameter_static_shapes"), **wan_consumer_nodes(("ref", 0))}
    with pytest.raises(PromptError, match="KeyError") as err:  # like WanVideoWrapper
        comfy_host.run(wan_t2v_prompt(tiny_wan, apply=False, prefix="bad", extra_nodes=extra))
    assert "force_parameter_static_shapes" in str(err.value)


def test_a_server_that_never_uses_the_pack_pays_nothing_for_it_at_start_up(make_host, tiny_wan):
    """A prompt without any node of the pack, posted the moment the server answers: no hook of
    the pack holds it, no thread of the pack runs, nothing is frozen out of the garbage
    collector's reach, and the pack writes no line to the log."""
    host = make_host()
    hist = host.run(wan_t2v_prompt(tiny_wan, apply=False, prefix="early"), timeout=300)
    process = host.probe(hist, "probe")["process"]
    assert process["gc_frozen"] == 0, process
    assert not [m for m in process["on_prompt_handlers"] if PACK_NAME in m or "prewarm" in m], process
    assert not [t for t in process["threads"] if t.startswith(("tcs-", "torch-compile-speed"))], process
    assert pack_lines(host.log_text()) == [], host.log_text()[-3000:]


def test_two_branch_prompt_with_core_compile(make_host, tiny_wan):
    """The two-branch builder with core TorchCompileModel in place of our nodes ("cudagraphs"
    on CPU is a quick AOT trace that runs eagerly) on a server of this test's own."""
    host = make_host()
    p = wan_two_branch_prompt(tiny_wan)
    del p["settingsA"]
    p["applyA"] = {"class_type": "TorchCompileModel",
                   "inputs": {"model": ["loader", 0], "backend": "cudagraphs"}}
    hist = host.run(p)
    a, b = host.latent(hist, "saveA"), host.latent(hist, "saveB")
    assert torch.allclose(a, b, atol=1e-4)
    pa, pb = host.probe(hist, "probeA"), host.probe(hist, "probeB")
    assert pa["apply_model_wrapper_keys"] == ["torch.compile"] and pb["apply_model_wrapper_keys"] == []
    assert pa["stats"]["unique_graphs"] >= 1
    assert counters_delta(pa["counters"], pb["counters"]) == {}  # B ran after A, compiled nothing
