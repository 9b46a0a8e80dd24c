"""On a real ComfyUI server (each host the suite runs it on): the nodes as users see them,
compile that really compiles, matches eager and is reused, a shared model that stays eager, and
the WANCOMPILEARGS contract as WanVideoWrapper consumes it."""
import re

import pytest
import torch

from harness import (NODE_DEFAULTS, SETTINGS_DEFAULTS, PromptError, counters_delta, new_graphs, rel_l2,
                     wan_consumer_nodes, wan_t2v_prompt, wan_two_branch_prompt)

ORIGINAL_REQUIRED = ["backend", "fullgraph", "mode", "dynamic", "dynamo_cache_size_limit",
                     "compile_transformer_blocks_only", "reuse_if_similar", "experimental_ptx",
                     "ptx_fast_math", "warmup_runs"]
ORIGINAL_OPTIONAL = ["ptx_cache_dir", "dynamo_recompile_limit"]
NEW_OPTIONAL = ["force_parameter_static_shapes", "allow_unmerged_lora_compile", "shape_policy",
                "declared_shapes", "background_compile"]
FAST = {"backend": "aot_eager"}  # real dynamo tracing, no C++ build: for logic checks


@pytest.fixture(scope="module")
def eager_ref(comfy_host, tiny_wan):
    hist = comfy_host.run(wan_t2v_prompt(tiny_wan, apply=False, prefix="eager_ref"))
    return comfy_host.latent(hist)


def test_nodes_listed_with_original_input_order(comfy_host):
    s = comfy_host.object_info("TorchCompileSpeedSettings")
    assert s["display_name"] == "Torch Compile Speed Settings" and s["category"] == "optimization"
    assert s["input_order"]["required"] == ORIGINAL_REQUIRED
    assert s["input_order"]["optional"] == ORIGINAL_OPTIONAL + NEW_OPTIONAL
    assert s["output"] == ["WANCOMPILEARGS"] and s["output_name"] == ["torch_compile_args"]
    req = s["input"]["required"]
    assert req["backend"][0][:2] == ["inductor", "cudagraphs"] and "aot_eager" in req["backend"][0]
    assert req["mode"][0] == ["default", "max-autotune", "max-autotune-no-cudagraphs",
                              "reduce-overhead", "speed"] and req["mode"][1]["default"] == "speed"
    defaults = {k: v[1].get("default") for k, v in {**req, **s["input"]["optional"]}.items()}
    assert defaults == {"backend": "inductor", "fullgraph": False, "mode": "speed", "dynamic": False,
                        "dynamo_cache_size_limit": 64, "compile_transformer_blocks_only": True,
                        "reuse_if_similar": True, "experimental_ptx": False, "ptx_fast_math": True,
                        "warmup_runs": 1, "ptx_cache_dir": "", "dynamo_recompile_limit": 128,
                        "force_parameter_static_shapes": False, "allow_unmerged_lora_compile": False,
                        "shape_policy": "auto", "declared_shapes": "", "background_compile": True}
    assert {**SETTINGS_DEFAULTS, **NODE_DEFAULTS} == defaults  # what the tests call the node's defaults
    assert all(v[1].get("tooltip") for v in {**req, **s["input"]["optional"]}.values())

    a = comfy_host.object_info("ApplyTorchCompile")
    assert a["display_name"] == "Apply Torch Compile" and a["category"] == "optimization"
    assert a["input_order"]["required"] == ["model", "compile_args"]
    assert a["input"]["required"]["compile_args"][0] == "WANCOMPILEARGS"
    assert a["output"] == ["MODEL"] and a["output_name"] == ["model"]


@pytest.mark.slow
def test_inductor_regional_compile_matches_eager_then_never_retraces(comfy_host, tiny_wan, eager_ref):
    offset = comfy_host.log_offset()
    settings = {"backend": "inductor", "mode": "default"}
    probes, latents = [], []
    base = comfy_host.run(wan_t2v_prompt(tiny_wan, apply=False, prefix="before"))
    probes.append(comfy_host.probe(base))
    for i in range(3):
        hist = comfy_host.run(wan_t2v_prompt(tiny_wan, compile_settings=settings, prefix=f"ind{i}"))
        probes.append(comfy_host.probe(hist))
        latents.append(comfy_host.latent(hist))
    first, second, third = (counters_delta(probes[i]["counters"], probes[i + 1]["counters"])
                            for i in range(3))
    assert new_graphs(first) >= 1, f"run 1 traced nothing: {first}"
    assert new_graphs(second) == 0 and second.get("stats", {}).get("calls_captured", 0) == 0, second
    assert new_graphs(third) == 0 and third.get("stats", {}).get("calls_captured", 0) == 0, third
    for lat in latents:
        assert rel_l2(lat, eager_ref) < 1e-3
    log = comfy_host.log_text(since=offset)
    assert "[TorchCompileSpeed] compiled WanAttentionBlock x2" in log
    assert "recompiled" not in log
    # between runs the compiled clone carries no artefacts either (only inside apply_model)
    assert probes[-1]["modules_with_compiled_call_impl"] == 0
    assert probes[-1]["state_dict_has_orig_mod"] is False
    assert probes[-1]["apply_model_wrapper_keys"] == ["torch_compile_speed"]


def test_raw_branch_of_same_model_stays_eager(comfy_host, tiny_wan, eager_ref):
    hist = comfy_host.run(wan_two_branch_prompt(tiny_wan, compile_settings=FAST))
    pa, pb = comfy_host.probe(hist, "probeA"), comfy_host.probe(hist, "probeB")
    # samplerB ran after samplerA (TCSTestLatentAfter) and traced nothing at all
    assert counters_delta(pa["counters"], pb["counters"]) == {}
    assert pb["modules_with_compiled_call_impl"] == 0 and pb["state_dict_has_orig_mod"] is False
    assert "torch_compile_speed" not in pb["apply_model_wrapper_keys"]
    assert pb["is_optimized_module"] is False
    assert torch.equal(comfy_host.latent(hist, "saveB"), eager_ref)
    assert rel_l2(comfy_host.latent(hist, "saveA"), eager_ref) < 1e-3


def test_original_pack_api_workflow_runs(comfy_host, tiny_wan, eager_ref):
    """Only the original pack's 12 inputs, with its values (mode 'speed' on a fast backend)."""
    prompt = wan_t2v_prompt(tiny_wan, compile_settings=FAST, prefix="orig")
    for k in NEW_OPTIONAL:
        del prompt["settings"]["inputs"][k]
    assert sorted(prompt["settings"]["inputs"]) == sorted(ORIGINAL_REQUIRED + ORIGINAL_OPTIONAL)
    hist = comfy_host.run(prompt)
    assert rel_l2(comfy_host.latent(hist), eager_ref) < 1e-3


def test_a_prompt_with_the_removed_whole_graph_input_still_runs(comfy_host, tiny_wan, eager_ref):
    """Prompts saved by earlier versions give the settings node a ``whole_graph`` input, which it
    no longer has: ComfyUI drops an input the node does not declare, and the prompt runs."""
    prompt = wan_t2v_prompt(tiny_wan, compile_settings=FAST, prefix="retired")
    prompt["settings"]["inputs"]["whole_graph"] = True
    hist = comfy_host.run(prompt)
    assert rel_l2(comfy_host.latent(hist), eager_ref) < 1e-3


@pytest.mark.parametrize("mode", ["default", "speed"])
def test_settings_dict_passes_wanvideowrapper_style_consumer(comfy_host, tiny_wan, mode):
    extra = wan_consumer_nodes(("settings", 0))
    prompt = wan_t2v_prompt(tiny_wan, compile_settings={"backend": "inductor", "mode": mode},
                            prefix=f"consumer_{mode}", extra_nodes=extra)
    rep = comfy_host.outputs(comfy_host.run(prompt), "consumer")["consumer"][0]
    assert rep["ran"] and rep["finite"]
    assert set(rep["keys"]) >= {
        "backend", "fullgraph", "mode", "dynamic", "dynamo_cache_size_limit", "dynamo_recompile_limit",
        "compile_transformer_blocks_only", "force_parameter_static_shapes", "allow_unmerged_lora_compile"}
    v = rep["values"]
    if mode == "speed":
        assert (v["backend"], v["mode"], v["dynamic"]) == ("inductor", "max-autotune-no-cudagraphs", True)
    else:
        assert (v["mode"], v["dynamic"]) == ("default", False)


def test_reuse_when_same_checkpoint_loaded_again(comfy_host, tiny_wan_path, eager_ref, tmp_path):
    settings = {**FAST, "mode": "max-autotune-no-cudagraphs"}  # an entry no other test builds
    comfy_host.run(wan_t2v_prompt(tiny_wan_path.name, compile_settings=settings, prefix="reuse0"))
    copy = tmp_path / "same_weights_other_name.safetensors"
    copy.symlink_to(tiny_wan_path)
    other = comfy_host.add_model(copy)
    offset = comfy_host.log_offset()
    before = comfy_host.run(wan_t2v_prompt(tiny_wan_path.name, apply=False, prefix="reuse_b"))
    hist = comfy_host.run(wan_t2v_prompt(other, compile_settings=settings, prefix="reuse1"))
    assert new_graphs(counters_delta(comfy_host.probe(before)["counters"],
                                 comfy_host.probe(hist)["counters"])) == 0
    assert "reusing compiled WanAttentionBlock x2" in comfy_host.log_text(since=offset)
    assert rel_l2(comfy_host.latent(hist), eager_ref) < 1e-3


def test_reuse_off_compiles_afresh(comfy_host, tiny_wan, eager_ref):
    """warmup_runs is not part of the reuse key but re-executes the Apply node: with reuse on
    the second apply finds the compiled work, with reuse off it compiles again."""
    per_apply = {}
    for reuse in (True, False):
        probes = []
        for warmup in (0, 1, 2):
            settings = {**FAST, "reuse_if_similar": reuse, "warmup_runs": warmup}
            hist = comfy_host.run(wan_t2v_prompt(tiny_wan, compile_settings=settings,
                                                 prefix=f"reuse{reuse}{warmup}"))
            probes.append(comfy_host.probe(hist))
            assert rel_l2(comfy_host.latent(hist), eager_ref) < 1e-3
        per_apply[reuse] = [new_graphs(counters_delta(a["counters"], b["counters"]))
                             for a, b in zip(probes, probes[1:])]
    assert per_apply[True] == [0, 0]
    assert all(n >= 1 for n in per_apply[False]), per_apply


def test_whole_model_compile(comfy_host, tiny_wan, eager_ref):
    offset = comfy_host.log_offset()
    hist = comfy_host.run(wan_t2v_prompt(
        tiny_wan, compile_settings={**FAST, "compile_transformer_blocks_only": False}, prefix="whole"))
    assert rel_l2(comfy_host.latent(hist), eager_ref) < 1e-3
    assert "whole model (WanModel)" in comfy_host.log_text(since=offset)


def test_experimental_ptx_on_cpu_is_skipped_with_one_line(comfy_host, tiny_wan, eager_ref):
    settings = {**FAST, "experimental_ptx": True, "ptx_cache_dir": "ptx_test", "warmup_runs": 2}
    offset = comfy_host.log_offset()
    for i in range(2):
        hist = comfy_host.run(wan_t2v_prompt(tiny_wan, compile_settings=settings, prefix=f"ptx{i}"))
        assert rel_l2(comfy_host.latent(hist), eager_ref) < 1e-3
    log = comfy_host.log_text(since=offset)
    assert log.count("experimental_ptx skipped") <= 1  # once per server process
    assert "warmed Triton" not in log
    assert not (comfy_host.base_dir / "user" / "ptx_test").exists()


def test_ptx_cache_dir_escaping_user_dir_is_refused(comfy_host, tiny_wan):
    settings = {**FAST, "experimental_ptx": True, "ptx_cache_dir": "../../../etc/tcs"}
    with pytest.raises(PromptError, match="ptx_cache_dir"):
        comfy_host.run(wan_t2v_prompt(tiny_wan, compile_settings=settings, prefix="escape"))
    assert not (comfy_host.base_dir.parent.parent / "etc" / "tcs").exists()
    comfy_host.run(wan_t2v_prompt(tiny_wan, apply=False, prefix="still_serving"))


@pytest.mark.slow
def test_node_defaults_mode_speed_compile_without_fallback(comfy_host, tiny_wan, eager_ref):
    """The Settings node's defaults (mode 'speed': inductor, compiled in mode default by Apply,
    dynamic) must really compile, not fall back to eager."""
    offset = comfy_host.log_offset()
    hist = comfy_host.run(wan_t2v_prompt(tiny_wan, compile_settings={"mode": "speed"}, prefix="speed"))
    log = comfy_host.log_text(since=offset)
    assert "eagerly" not in log and "stays eager" not in log, log
    # Only a real compile prints these: graphs compiled in this run, or an entry found in this
    # server that compiled graphs earlier (an earlier test may have built the same entry).
    # "will compile" alone (then a silent fallback) or a failed entry does not pass.
    compiled = re.search(r"\] (compiled WanAttentionBlock x2: ([1-9]\d*) graph\(s\)|reusing compiled "
                         r"WanAttentionBlock x2 \(([1-9]\d*) graph\(s\) compiled earlier\))", log)
    assert compiled, log
    assert rel_l2(comfy_host.latent(hist), eager_ref) < 1e-3
