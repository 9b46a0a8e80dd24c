"""On a real ComfyUI server: compile stays correct with what real workflows do to models.

- LoRA (``LoraLoaderModelOnly``) before or after the Apply node: every strength gives the eager
  output for that strength, and changing it recompiles nothing.
- Two models in one workflow (the WAN 2.2 high-noise/low-noise pattern): each matches its own
  eager output, and the second run compiles nothing.
- Offloading: ComfyUI's lowvram partial loading (forced on CPU by the TEST-ONLY
  ``TCSTestForceLowVram`` node) gives the eager output.
- ``ModelSave`` of a compiled model writes the same keys and tensors as the eager model.
"""
import pytest
import safetensors.torch
import torch

from harness import (ComfyHost, counters_delta, make_tiny_wan, make_tiny_wan_lora, new_graphs,
                     rel_l2, wan_t2v_prompt)

FAST = {"backend": "aot_eager"}


@pytest.fixture(scope="module")
def host(tmp_path_factory, tiny_wan_path):
    """One server for the module: tiny WANs with seeds 0 and 1, and a LoRA for them."""
    other = make_tiny_wan(num_layers=2, dim=256, seed=1)
    h = ComfyHost(tmp_path_factory.mktemp("models") / "server", models=[tiny_wan_path, other])
    h.wan0, h.wan1 = tiny_wan_path.name, other.name
    h.lora = h.add_lora(make_tiny_wan_lora(num_layers=2, dim=256))
    with h:
        h.eager0 = h.latent(h.run(wan_t2v_prompt(h.wan0, apply=False, prefix="e0")))
        yield h


def model_prompt(h, *, compile_settings=None, lora=None, where="before", lowvram_mb=None,
                 prefix="out", model=None):
    """UNETLoader -> [TCSTestForceLowVram] -> [LoRA] -> [Apply] -> [LoRA] -> KSampler -> ...

    ``lora`` is the strength (None: no LoRA node); ``where`` puts it before or after the Apply
    node; ``compile_settings`` None means an eager workflow."""
    p = wan_t2v_prompt(model or h.wan0, compile_settings=compile_settings or FAST,
                       apply=compile_settings is not None, prefix=prefix)
    src = ["loader", 0]
    if lowvram_mb:
        p["lowvram"] = {"class_type": "TCSTestForceLowVram", "inputs": {"model": src, "budget_mb": lowvram_mb}}
        src = ["lowvram", 0]

    def lora_node(model_ref):
        p["lora"] = {"class_type": "LoraLoaderModelOnly", "inputs": {
            "model": model_ref, "lora_name": h.lora, "strength_model": lora}}
        return ["lora", 0]

    if compile_settings is None:
        out = lora_node(src) if lora is not None else src
    elif lora is not None and where == "before":
        p["apply"]["inputs"]["model"] = lora_node(src)
        out = ["apply", 0]
    else:
        p["apply"]["inputs"]["model"] = src
        out = lora_node(["apply", 0]) if lora is not None else ["apply", 0]
    p["sampler"]["inputs"]["model"] = out
    p["probe"]["inputs"]["model"] = out
    return p


# --------------------------------------------------------------------------- LoRA

STRENGTHS = [1.0, 0.5, -0.7]


def _lora_sweep(h, where, settings, strengths=STRENGTHS):
    """Per strength: (rel L2 compiled vs eager, rel L2 eager vs no-LoRA, new graphs since the
    previous compiled run)."""
    rows, prev = [], None
    for s in strengths:
        eager = h.latent(h.run(model_prompt(h, lora=s, prefix=f"le{s}")))
        hist = h.run(model_prompt(h, compile_settings=settings, lora=s, where=where, prefix=f"lc{s}"))
        probe = h.probe(hist)
        assert "torch_compile_speed" in probe["apply_model_wrapper_keys"]  # the sampled model is compiled
        new = new_graphs(counters_delta(prev["counters"], probe["counters"])) if prev else None
        rows.append((rel_l2(h.latent(hist), eager), rel_l2(eager, h.eager0), new))
        prev = probe
    return rows


@pytest.mark.parametrize("where", ["before", "after"])
def test_lora_strength_changes_match_eager_and_recompile_nothing(host, where):
    rows = _lora_sweep(host, where, FAST)
    for (err, effect, new), s in zip(rows, STRENGTHS):
        assert err < 1e-3, (s, rows)
        assert effect > 1e-2, f"the LoRA at strength {s} changed nothing: {rows}"
    assert [new for _, _, new in rows[1:]] == [0] * (len(STRENGTHS) - 1), rows
    assert rows[0][1] > rows[1][1]  # strength 1.0 changes more than 0.5


@pytest.mark.slow
def test_lora_with_inductor_matches_eager_without_recompiling(host):
    """Inductor takes weights as graph inputs (freezing stays off), so a merged LoRA is used."""
    rows = _lora_sweep(host, "before", {"backend": "inductor", "mode": "default"}, strengths=[1.0, 0.5])
    assert all(err < 1e-3 and effect > 1e-2 for err, effect, _ in rows), rows
    assert rows[1][2] == 0, rows


# --------------------------------------------------------------------------- two models

def two_model_prompt(h, compiled, reuse=True, prefix="tm"):
    """Two checkpoints (WAN 2.2 high/low-noise pattern): a sampler per model, and a chain where
    model A denoises steps 0-2 and model B steps 2-4 (KSamplerAdvanced)."""
    p = wan_t2v_prompt(h.wan0, apply=False, prefix=f"{prefix}A")
    p["loaderB"] = {"class_type": "UNETLoader", "inputs": {"unet_name": h.wan1, "weight_dtype": "default"}}
    models = {"A": ["loader", 0], "B": ["loaderB", 0]}
    if compiled:
        p["settings"] = {"class_type": "TorchCompileSpeedSettings",
                         "inputs": {**_settings_inputs(), "reuse_if_similar": reuse}}
        for tag, src in list(models.items()):
            p[f"apply{tag}"] = {"class_type": "ApplyTorchCompile",
                                "inputs": {"model": src, "compile_args": ["settings", 0]}}
            models[tag] = [f"apply{tag}", 0]
    p["sampler"]["inputs"]["model"] = models["A"]
    p["probe"]["inputs"]["model"] = models["A"]
    p["samplerB"] = dict(p["sampler"], inputs={**p["sampler"]["inputs"], "model": models["B"]})
    p["saveB"] = {"class_type": "SaveLatent", "inputs": {"samples": ["samplerB", 0], "filename_prefix": f"{prefix}B"}}
    common = {"noise_seed": 0, "steps": 4, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple",
              "positive": ["cond", 0], "negative": ["cond", 0]}
    p["high"] = {"class_type": "KSamplerAdvanced", "inputs": {
        **common, "model": models["A"], "add_noise": "enable", "latent_image": ["latent", 0],
        "start_at_step": 0, "end_at_step": 2, "return_with_leftover_noise": "enable"}}
    p["low"] = {"class_type": "KSamplerAdvanced", "inputs": {
        **common, "model": models["B"], "add_noise": "disable", "latent_image": ["high", 0],
        "start_at_step": 2, "end_at_step": 10000, "return_with_leftover_noise": "disable"}}
    p["saveC"] = {"class_type": "SaveLatent", "inputs": {"samples": ["low", 0], "filename_prefix": f"{prefix}C"}}
    p["probeC"] = {"class_type": "TCSTestProbe", "inputs": {"samples": ["low", 0], "label": "C",
                                                           "model": models["B"]}}
    return p


def _settings_inputs():
    from harness import settings_inputs
    return settings_inputs(**FAST)


def _outputs(h, hist):
    return {k: h.latent(hist, f"save{k}") for k in ("", "B", "C")}


@pytest.mark.parametrize("reuse", [True, False], ids=["reuse", "no-reuse"])
def test_two_models_each_match_their_own_eager_output(host, reuse):
    h = host
    eager_hist = h.run(two_model_prompt(h, compiled=False, prefix=f"tme{reuse}"))
    eager = _outputs(h, eager_hist)
    assert rel_l2(eager["B"], eager[""]) > 1e-2  # the two checkpoints really differ
    probes = [h.probe(eager_hist, "probeC")]
    for i in range(2):
        hist = h.run(two_model_prompt(h, compiled=True, reuse=reuse, prefix=f"tmc{reuse}{i}"))
        for k, ref in eager.items():
            assert rel_l2(h.latent(hist, f"save{k}"), ref) < 1e-5, (i, k or "A")
        for node in ("probe", "probeC"):
            assert h.probe(hist, node)["apply_model_wrapper_keys"] == ["torch_compile_speed"]
        probes.append(h.probe(hist, "probeC"))
    second = counters_delta(probes[1]["counters"], probes[2]["counters"])
    assert new_graphs(second) == 0 and second.get("stats", {}).get("calls_captured", 0) == 0, second
    if not reuse:  # each model compiled its own graphs on the first run
        assert new_graphs(counters_delta(probes[0]["counters"], probes[1]["counters"])) >= 2


# --------------------------------------------------------------------------- offload

@pytest.mark.parametrize("lora", [None, 1.0], ids=["plain", "lora"])
def test_lowvram_partial_loading_matches_eager(host, lora):
    """Modules left offloaded run through comfy.ops' cast path (``comfy_cast_weights``), and with
    a LoRA through ``weight_function`` patches applied at every forward."""
    h = host
    offset = h.log_offset()
    eager = h.latent(h.run(model_prompt(h, lora=lora, lowvram_mb=3.0, prefix="ove")))
    hist = h.run(model_prompt(h, compile_settings=FAST, lora=lora, where="after", lowvram_mb=3.0,
                              prefix="ovc"))
    log = h.log_text(since=offset)
    assert "loaded partially" in log, log  # the lowvram path really ran
    if lora is not None:
        assert any("lowvram patches: " in ln and not ln.endswith("lowvram patches: 0")
                   for ln in log.splitlines() if "loaded partially" in ln), log
        assert rel_l2(eager, h.eager0) > 1e-2
    assert rel_l2(h.latent(hist), eager) < 1e-3
    assert "torch_compile_speed" in h.probe(hist)["apply_model_wrapper_keys"]
    assert "torch.compile failed" not in log


# --------------------------------------------------------------------------- ModelSave

def test_model_save_of_a_compiled_model_writes_the_eager_checkpoint(host):
    h = host
    h.run(model_prompt(h, compile_settings=FAST, prefix="ms_run"))  # the compiled clone has run
    p = model_prompt(h, compile_settings=FAST, prefix="ms_run2")
    p["save_compiled"] = {"class_type": "ModelSave", "inputs": {
        "model": ["apply", 0], "filename_prefix": "diffusion_models/tcs_compiled"}}
    p["save_eager"] = {"class_type": "ModelSave", "inputs": {
        "model": ["loader", 0], "filename_prefix": "diffusion_models/tcs_eager"}}
    h.run(p)
    out = h.base_dir / "output" / "diffusion_models"
    compiled_files = sorted(out.glob("tcs_compiled_*.safetensors"))
    eager_files = sorted(out.glob("tcs_eager_*.safetensors"))
    assert compiled_files and eager_files
    compiled = safetensors.torch.load_file(str(compiled_files[-1]))
    eager = safetensors.torch.load_file(str(eager_files[-1]))
    assert sorted(compiled) == sorted(eager)
    assert not any("_orig_mod" in k or "_compiled" in k for k in compiled)
    assert any(k.startswith("model.diffusion_model.blocks.0.") for k in compiled), sorted(compiled)[:5]
    for k, v in eager.items():
        assert compiled[k].dtype == v.dtype and torch.equal(compiled[k], v), k
    # the source checkpoint's weights are what was saved
    source = safetensors.torch.load_file(str(h.base_dir / "models" / "diffusion_models" / h.wan0))
    for k, v in source.items():
        assert torch.equal(compiled[f"model.diffusion_model.{k}"], v), k
