"""A GGUF model (city96's ComfyUI-GGUF pack, UnetLoaderGGUF, Q8_0 weights) compiled with the
settings node's defaults: its WanAttentionBlock regions compile, before and after a restart,
with output equal to eager.

The saved regions (compile_core/precompiled.py) do not serve GGUF yet. The trace now passes
every guard check (GGUF's module named by its folder's path, its dequantize table's dict-key
guards, the weights' ``tensor_type`` enum), but torch cannot load the saved function back:
rebuilding the guards' example tensors as ComfyUI-GGUF's ``GGMLTensor`` fails
(``'FakeTensor' object has no attribute 'patches'``). The load-back check catches that, so no
unusable file is kept and the log says why, once; the restart takes the regular path (its
FX-graph cache). This test pins that, and fails once GGUF regions start being saved."""
import time

import pytest

from gguf_models import gguf_qtypes, make_tiny_wan_gguf
from harness import (HOST_VERSION, NODE_DEFAULTS, REPO_ROOT, ComfyHost, pack_lines, rel_l2,
                     wan_t2v_prompt)

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


@pytest.mark.slow
def test_gguf_model_compiles_across_a_restart_and_says_why_no_region_is_saved(tmp_path, tiny_wan_gguf):
    base = tmp_path / "server"
    name = tiny_wan_gguf.name
    timings, logs = [], []
    for restart in range(2):
        host = gguf_host(base)
        host.add_model(tiny_wan_gguf)
        # a fresh process with torch's default inductor dir emptied: only the pack's cache helps
        host.env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / f"default_inductor_{restart}")
        with host:
            require_gguf_loader(host)
            t = time.perf_counter()
            eager_hist = host.run(gguf_prompt(name, apply=False, prefix="e"))
            t_eager = time.perf_counter() - t
            assert "gguf qtypes" in host.log_text(), host.log_tail()  # ComfyUI-GGUF's loader ran
            eager = host.latent(eager_hist)
            offset = host.log_offset()
            t = time.perf_counter()
            hist = host.run(gguf_prompt(name, compile_settings=SETTINGS, prefix="c"))
            timings.append((t_eager, time.perf_counter() - t))
            log = host.log_text(since=offset)
            logs.append(log)
            err = rel_l2(host.latent(hist), eager)
            assert err < 1e-3, (restart, err, log[-4000:])
            assert not pack_lines(log, "torch.compile failed"), log
            assert not pack_lines(log, "eagerly"), log

    first, second = logs
    assert pack_lines(first, "compiled", "WanAttentionBlock"), first
    assert pack_lines(second, "WanAttentionBlock") and not pack_lines(second, "runs eagerly"), second
    # the saved region was traced, loaded back, found unusable, and not kept: said once, with why
    why = pack_lines(first, "region WanAttentionBlock-", "not saved")
    assert len(why) == 1 and "torch could not load it" in why[0], first
    assert not list(base.glob("user/torch_compile_speed/cache/*/inductor/tcs_saved_regions/*.bin"))
    print(f"\n{why[0]}\nComfyUI {HOST_VERSION}: eager {timings[0][0]:.1f}s / compiled "
          f"{timings[0][1]:.1f}s; after restart eager {timings[1][0]:.1f}s / compiled {timings[1][1]:.1f}s")
