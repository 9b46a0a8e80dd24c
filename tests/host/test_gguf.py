"""A GGUF model (city96's ComfyUI-GGUF pack, UnetLoaderGGUF, Q8_0 weights) compiled with the
settings node's defaults: its WanAttentionBlock regions compile, with output equal to eager,
and are saved (compile_core/cache/precompiled.py), so a restarted server (HOME, TMPDIR and torch's
own inductor dir emptied) loads them without a dynamo trace.

ComfyUI-GGUF keeps a weight's quantization in instance attributes of its ``GGMLTensor``
(``tensor_type``, ``tensor_shape``, and a LoRA in ``patches``); torch rebuilds the guards'
example tensors without them, and the pack puts them back (``saved_guards``). The loader
node's ``dequant_dtype`` / ``patch_dtype`` live on ComfyUI-GGUF's op class and are checked
by the pack. A LoRA on the GGUF weights (``patches``) gets a saved variant of its own, equal
to eager before and after the restart."""

import pytest

from gguf_models import gguf_qtypes, make_tiny_wan_gguf
from harness import (HOST_VERSION, NODE_DEFAULTS, REPO_ROOT, ComfyHost, fallback_lines, make_tiny_wan_lora,
                     pack_lines, rel_l2, wan_t2v_prompt)

GGUF_PACK = REPO_ROOT / ".host" / "ComfyUI-GGUF"
SETTINGS = NODE_DEFAULTS  # the settings node left as it is


def gguf_prompt(name, **kw):
    """wan_t2v_prompt with UnetLoaderGGUF as its loader."""
    loader = {"loader": {"class_type": "UnetLoaderGGUF", "inputs": {"unet_name": name}}}
    return wan_t2v_prompt(name, extra_nodes=loader, **kw)


def gguf_host(base):
    host = ComfyHost(base)
    ComfyHost._link(GGUF_PACK, host.base_dir / "custom_nodes" / "ComfyUI-GGUF")
    return host


@pytest.fixture(scope="module")
def tiny_wan_gguf():
    if not (GGUF_PACK / "nodes.py").is_file():
        pytest.skip(f"ComfyUI-GGUF is not unpacked at {GGUF_PACK}")
    pytest.importorskip("gguf")
    path = make_tiny_wan_gguf()
    assert set(gguf_qtypes(path)) == {"Q8_0", "F16", "F32"}, gguf_qtypes(path)
    return path


def require_gguf_loader(host):
    """Skip (with the reason from the log) where ComfyUI-GGUF does not load on this host."""
    try:
        host.object_info("UnetLoaderGGUF")
    except (KeyError, Exception):
        reason = [ln for ln in host.log_text().splitlines()
                  if "GGUF" in ln or "IMPORT FAILED" in ln or "Error" in ln][-5:]
        pytest.skip(f"ComfyUI-GGUF's UnetLoaderGGUF is not registered on ComfyUI {HOST_VERSION}: "
                    + " | ".join(reason))


def with_lora(prompt, lora_name, strength=1.0):
    """The prompt with LoraLoaderModelOnly after the GGUF loader (before ApplyTorchCompile)."""
    prompt["lora"] = {"class_type": "LoraLoaderModelOnly", "inputs": {
        "model": ["loader", 0], "lora_name": lora_name, "strength_model": strength}}
    for node in ("apply", "sampler", "probe"):
        if node in prompt and prompt[node]["inputs"]["model"] == ["loader", 0]:
            prompt[node]["inputs"]["model"] = ["lora", 0]
    return prompt


def restarted_host(base, tmp_path, restart, model, lora):
    """A server on ``base`` whose process starts with HOME, TMPDIR and torch's default inductor
    dir empty: only the pack's persistent cache carries anything over."""
    host = gguf_host(base)
    host.add_model(model)
    host.lora = host.add_lora(lora)
    for var in ("TORCHINDUCTOR_CACHE_DIR", "HOME", "TMPDIR"):
        host.env[var] = str(tmp_path / f"{var.lower()}_{restart}")
        (tmp_path / f"{var.lower()}_{restart}").mkdir()
    return host


def compiled_vs_eager(host, name, lora=None):
    """(rel L2 of compiled vs eager, the compiled runs' log, the eager latent)."""
    tag = "l" if lora else ""

    def with_maybe_lora(p):
        return with_lora(p, lora) if lora else p
    eager = host.latent(host.run(with_maybe_lora(gguf_prompt(name, apply=False, prefix=f"e{tag}"))))
    hist, log = host.run_compiled(lambda: with_maybe_lora(gguf_prompt(name, compile_settings=SETTINGS,
                                                                      prefix=f"c{tag}")))
    assert not pack_lines(log, "torch.compile failed") and not fallback_lines(log), log
    return rel_l2(host.latent(hist), eager), log, eager


@pytest.mark.slow
def test_gguf_model_loads_its_saved_regions_after_a_restart(tmp_path, tiny_wan_gguf):
    base = tmp_path / "server"
    name = tiny_wan_gguf.name
    lora = make_tiny_wan_lora(num_layers=2, dim=256)
    logs = []
    for restart in range(2):
        with restarted_host(base, tmp_path, restart, tiny_wan_gguf, lora) as host:
            require_gguf_loader(host)
            err, log, eager = compiled_vs_eager(host, name)
            assert "gguf qtypes" in host.log_text(), host.log_tail()  # ComfyUI-GGUF's loader ran
            assert err < 1e-3, (restart, err, log[-4000:])
            # a LoRA on the GGUF weights (in their ``patches``): compiled equals eager
            lora_err, lora_log, lora_eager = compiled_vs_eager(host, name, host.lora)
            assert lora_err < 1e-3, (restart, lora_err, lora_log[-4000:])
            assert rel_l2(lora_eager, eager) > 1e-3  # the LoRA changes the output
            logs.append((log, lora_log))

    (first, first_lora), (second, second_lora) = logs
    # the first server traced the block and saved it; so it did for the LoRA, as a variant
    saved = pack_lines(first, "saved region WanAttentionBlock-", "a restart loads it")
    assert len(saved) == 1, first
    assert pack_lines(first_lora, "saved region WanAttentionBlock-", "a restart loads it"), first_lora
    assert not pack_lines(first + first_lora, "not saved"), first + first_lora
    assert len(list(base.glob("user/torch_compile_speed/cache/*/inductor/tcs_saved_regions/*.bin"))) == 2
    # the restarted server loaded both without a dynamo trace
    assert "saved region(s), no trace" in second, second
    for log in (second, second_lora):
        assert pack_lines(log, "saved region WanAttentionBlock-", "loaded from", "(no trace)"), log
        assert not pack_lines(log, "AOT compile of") and not pack_lines(log, "tracing another"), log

