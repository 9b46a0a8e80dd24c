"""Dynamic VRAM (ComfyUI 0.33+) on a real ComfyUI server: Apply Torch Compile compiles a
non-dynamic clone, as core's TorchCompileModel does (``clone(disable_dynamic=True)``), and the
dynamic input model stays as it was.

ComfyUI uses ``ModelPatcherDynamic`` only on a GPU: on ``--cpu``, ``ModelPatcherDynamic.__new__``
returns a plain ModelPatcher. The TEST-ONLY ``TCSTestDynamicVramLoader`` node builds a real
``ModelPatcherDynamic`` on CPU anyway (ComfyUI's own class and ``__init__``, with the loader's
``cached_patcher_init``), so these tests run the real 0.33 clone path, ComfyUI's reload of the
model without dynamic VRAM included, and sample with the compiled clone. What comfy-aimdo does
at sampling time on a GPU (weights streamed through the vbar) is not run here.

Note: on a CPU load device a plain ``clone()`` of a dynamic patcher is also a ModelPatcher
(``__new__`` reroutes it), so the tests tell the two clone paths apart by the model: the
non-dynamic clone has a model of its own (reloaded from the file); a plain clone shares it.

On ComfyUI without dynamic VRAM (0.3.75) the dynamic tests skip; the plain-model test runs.
"""
import pytest

from harness import (COMFY_DIR, HOST_VERSION, ComfyHost, counters_delta, fallback_lines, new_graphs,
                     pack_lines, rel_l2, settings_inputs, wan_t2v_prompt)

HAS_DYNAMIC_VRAM = "class ModelPatcherDynamic" in (COMFY_DIR / "comfy" / "model_patcher.py").read_text()
needs_dynamic_vram = pytest.mark.skipif(
    not HAS_DYNAMIC_VRAM, reason=f"ComfyUI {HOST_VERSION} has no dynamic VRAM (ModelPatcherDynamic)")

# real dynamo tracing, no C++ build; an entry of its own, so this module's run really compiles
# on the shared server whatever ran before (reuse would compile nothing new)
FAST = {"backend": "aot_eager", "reuse_if_similar": False}
TURNED_OFF = "dynamic VRAM turned off for the compiled"
STAYS_ON = "dynamic VRAM stays on for the compiled"


@pytest.fixture
def host(comfy_host):
    """The session's server. The dynamic loader loads comfy-aimdo's library into it, which changes
    nothing else there (``comfy.memory_management.aimdo_enabled`` stays False)."""
    return comfy_host


def dynamic_loader(unet_name, reloadable=True, gpu_dtypes=False):
    return {"class_type": "TCSTestDynamicVramLoader",
            "inputs": {"unet_name": unet_name, "reloadable": reloadable, "gpu_dtypes": gpu_dtypes}}


def info_node(model_ref, label, after=None):
    inputs = {"model": list(model_ref), "label": label}
    if after is not None:
        inputs["after"] = list(after)
    return {"class_type": "TCSTestPatcherInfo", "inputs": inputs}


def apply_only_prompt(loader, settings):
    """loader -> Settings -> ApplyTorchCompile -> TCSTestPatcherInfo (no sampling)."""
    return {"loader": loader,
            "settings": {"class_type": "TorchCompileSpeedSettings", "inputs": settings_inputs(**settings)},
            "apply": {"class_type": "ApplyTorchCompile", "inputs": {
                "model": ["loader", 0], "compile_args": ["settings", 0]}},
            "info_in": info_node(("loader", 0), "input"),
            "info_out": info_node(("apply", 0), "compiled")}


def info(host, hist, node_id):
    return host.outputs(hist, node_id)["info"][0]


@needs_dynamic_vram
def test_dynamic_model_gets_a_non_dynamic_compiled_clone_that_samples_like_eager(host, tiny_wan):
    eager_hist = host.run(wan_t2v_prompt(tiny_wan, apply=False, prefix="dyn_eager"))
    eager, before = host.latent(eager_hist), host.probe(eager_hist)["counters"]
    offset = host.log_offset()
    p = wan_t2v_prompt(tiny_wan, compile_settings=FAST, prefix="dyn_compiled", extra_nodes={
        "loader": dynamic_loader(tiny_wan),
        # both after sampling, so they see what the run left behind
        "info_in": info_node(("loader", 0), "input", after=("sampler", 0)),
        "info_out": info_node(("apply", 0), "compiled", after=("sampler", 0))})
    hist = host.run(p)
    log = host.log_text(since=offset)
    src, out = info(host, hist, "info_in"), info(host, hist, "info_out")

    # the input: still the real ModelPatcherDynamic, unchanged since the loader made it
    assert (src["class"], src["class_module"], src["is_dynamic"]) == (
        "ModelPatcherDynamic", "comfy.model_patcher", True)
    assert src["digest_at_load"] is not None and src["digest"] == src["digest_at_load"]
    assert src["digest"]["non_dynamic_delegate_model"] == "None"  # no delegate cached on it
    assert src["digest"]["wrappers"].get("apply_model", []) == []
    assert src["digest"]["modules_with_compiled_call_impl"] == 0

    # the compiled clone: a plain ModelPatcher with a model of its own, ComfyUI's reload
    assert (out["class"], out["is_dynamic"]) == ("ModelPatcher", False)
    assert out["model_id"] != src["model_id"] and out["parent_id"] == src["patcher_id"]
    assert out["digest"]["model_dynamic_patchers"] == 0  # the reloaded model never was dynamic
    assert out["digest"]["weights_sum"] == pytest.approx(src["digest"]["weights_sum"], rel=1e-9)
    assert "torch_compile_speed" in out["digest"]["wrappers"]["apply_model"]

    # it compiled, sampled like eager, and the log says why once
    delta = counters_delta(before, host.probe(hist)["counters"])
    assert new_graphs(delta) >= 1, delta
    assert "torch_compile_speed" in host.probe(hist)["apply_model_wrapper_keys"]
    assert rel_l2(host.latent(hist), eager) < 1e-3
    turned_off = pack_lines(log, TURNED_OFF)
    assert len(turned_off) == 1, log
    assert "WAN21" in turned_off[0] and "TorchCompileModel" in turned_off[0]
    assert pack_lines(log, "compiled WanAttentionBlock x2")
    assert not pack_lines(log, STAYS_ON) and not pack_lines(log, "torch.compile failed"), log


@needs_dynamic_vram
def test_a_dynamic_model_loaded_as_on_a_gpu_gets_a_clone_in_the_model_dtype(host, tiny_wan):
    """The loader decides as ComfyUI 0.33 does on an NVIDIA GPU (comfy-aimdo on, float16 weights,
    no manual cast; the tiny checkpoint is float32). ComfyUI's non-dynamic reload leaves the lazily
    loaded Linear weights in the file's float32, which failed the prompt with ``mat1 and mat2 must
    have the same dtype`` on a GPU (core's TorchCompileModel too); the clone gets the model's dtype."""
    eager = host.latent(host.run(wan_t2v_prompt(tiny_wan, apply=False, prefix="gpu_like_eager")))
    offset = host.log_offset()
    hist = host.run(wan_t2v_prompt(tiny_wan, compile_settings=FAST, prefix="gpu_like_compiled", extra_nodes={
        "loader": dynamic_loader(tiny_wan, gpu_dtypes=True),
        "info_out": info_node(("apply", 0), "compiled", after=("sampler", 0))}))
    log = host.log_text(since=offset)
    out = info(host, hist, "info_out")
    assert (out["class"], out["is_dynamic"]) == ("ModelPatcher", False)
    turned_off = pack_lines(log, TURNED_OFF)
    assert len(turned_off) == 1 and "cast to the model's dtype" in turned_off[0], log
    assert not fallback_lines(log) and not pack_lines(log, "torch.compile failed"), log
    assert pack_lines(log, "compiled WanAttentionBlock x2"), log
    assert rel_l2(host.latent(hist), eager) < 1e-2  # float16 against the float32 eager run


@needs_dynamic_vram
def test_dynamic_model_that_cannot_be_reloaded_keeps_a_plain_clone_and_one_warning(host, tiny_wan):
    offset = host.log_offset()
    hist = host.run(apply_only_prompt(dynamic_loader(tiny_wan, reloadable=False), FAST))
    log = host.log_text(since=offset)
    src, out = info(host, hist, "info_in"), info(host, hist, "info_out")
    assert src["class"] == "ModelPatcherDynamic" and src["digest"] == src["digest_at_load"]
    assert src["digest"]["has_cached_patcher_init"] is False
    # a plain clone(): the same model (on a GPU it is a ModelPatcherDynamic; on CPU ComfyUI's
    # __new__ makes it a ModelPatcher)
    assert out["model_id"] == src["model_id"] and out["parent_id"] == src["patcher_id"]
    assert "torch_compile_speed" in out["digest"]["wrappers"]["apply_model"]
    warnings = pack_lines(log, STAYS_ON)
    assert len(warnings) == 1, log
    assert "cached_patcher_init" in warnings[0] and "--disable-dynamic-vram" in warnings[0]
    assert not pack_lines(log, TURNED_OFF)


def test_plain_model_gets_a_plain_clone_and_no_dynamic_vram_line(host, tiny_wan):
    """Every host: a plain ModelPatcher (what ``--cpu`` and ComfyUI before 0.33 give) is cloned as
    before, sharing its model, and nothing about dynamic VRAM is logged."""
    offset = host.log_offset()
    loader = {"class_type": "UNETLoader", "inputs": {"unet_name": tiny_wan, "weight_dtype": "default"}}
    hist = host.run(apply_only_prompt(loader, FAST))
    src, out = info(host, hist, "info_in"), info(host, hist, "info_out")
    assert src["class"] == out["class"] == "ModelPatcher"
    assert src["is_dynamic"] in (False, None)  # None: this ComfyUI has no is_dynamic (0.3.75)
    assert out["model_id"] == src["model_id"] and out["parent_id"] == src["patcher_id"]
    assert "torch_compile_speed" in out["digest"]["wrappers"]["apply_model"]
    log = host.log_text(since=offset)
    assert not pack_lines(log, "dynamic VRAM"), log


FETCHED = "dynamic VRAM stays on for the compiled"


@pytest.fixture(scope="module")
def fetch_host(tmp_path_factory, tiny_wan_path):
    """A server with ``TORCH_COMPILE_SPEED_DYNAMIC_VRAM_FETCH=1``: compiled clones keep dynamic VRAM."""
    with ComfyHost(tmp_path_factory.mktemp("fetch_host"), models=[tiny_wan_path],
                   env={"TORCH_COMPILE_SPEED_DYNAMIC_VRAM_FETCH": "1"}) as h:
        yield h


@needs_dynamic_vram
def test_with_the_fetch_switch_a_dynamic_model_keeps_its_model_and_samples_like_eager(fetch_host, tiny_wan):
    """The compiled clone is a plain clone of the dynamic patcher (the same model, no reload, no
    second copy in RAM), the log and the badge say which memory path runs, and it samples like
    eager. (On a CPU no layer is streamed through comfy-aimdo, so ``tcs::layer_fetch`` itself is
    covered by tests/unit/test_dynamic_fetch.py and the GPU check.)"""
    host = fetch_host
    eager = host.latent(host.run(wan_t2v_prompt(tiny_wan, apply=False, prefix="fetch_eager")))
    offset = host.log_offset()
    hist, log = host.run_compiled(lambda: wan_t2v_prompt(
        tiny_wan, compile_settings=FAST, prefix="fetch_compiled", extra_nodes={
            "loader": dynamic_loader(tiny_wan),
            "info_in": info_node(("loader", 0), "input", after=("sampler", 0)),
            "info_out": info_node(("apply", 0), "compiled", after=("sampler", 0))}))
    src, out = info(host, hist, "info_in"), info(host, hist, "info_out")
    assert src["class"] == "ModelPatcherDynamic"
    assert out["model_id"] == src["model_id"] and out["parent_id"] == src["patcher_id"]
    assert "torch_compile_speed" in out["digest"]["wrappers"]["apply_model"]
    kept = pack_lines(log, FETCHED)
    assert len(kept) == 1 and "tcs::layer_fetch" in kept[0], log
    assert not pack_lines(log, TURNED_OFF) and not fallback_lines(log), log
    assert pack_lines(log, "compiled WanAttentionBlock x2"), log
    assert host.probe(hist)["pack_status"]["memory"] == "dynamic VRAM, weights fetched in the graph"
    assert rel_l2(host.latent(hist), eager) < 1e-3
