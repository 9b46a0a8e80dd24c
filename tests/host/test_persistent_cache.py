"""Persistent warm start on a real ComfyUI server: a restarted server (new process,
same base directory) loads the compiled graphs from the per-fingerprint cache, after warming
torch's compiler stack in the background from the manifest the first server recorded."""

import pytest

from harness import NODE_DEFAULTS, ComfyHost, pack_lines, rel_l2, wan_t2v_prompt

SETTINGS = NODE_DEFAULTS  # the settings node left as it is


@pytest.mark.slow
def test_restarted_server_hits_persistent_cache(tmp_path, tiny_wan_path):
    base = tmp_path / "server"
    cache_root = base / "user" / "torch_compile_speed" / "cache"
    logs, startup_logs = [], []
    for restart in range(2):
        host = ComfyHost(base, models=[tiny_wan_path])
        # a fresh process with torch's default inductor dir emptied: only our cache can help
        host.env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / f"default_inductor_{restart}")
        with host:
            eager = host.latent(host.run(wan_t2v_prompt(tiny_wan_path.name, apply=False, prefix="e")))
            hist, log = host.run_compiled(lambda: wan_t2v_prompt(tiny_wan_path.name, compile_settings=SETTINGS,
                                                                 prefix="c"))
            logs.append(log)
            startup_logs.append(host.log_text())
            assert rel_l2(host.latent(hist), eager) < 1e-3
    # nothing of the pack ran at either start: the restarted server's first compile found the cache
    assert not pack_lines(startup_logs[1].split("Requested to load")[0]), startup_logs[1][-3000:]
    entries = [p for p in cache_root.iterdir() if p.is_dir() and not p.name.startswith(".")]
    assert len(entries) == 1 and (entries[0] / "meta.json").is_file()
    assert "persistent cache miss" in logs[0]
    assert "persistent cache hit" in logs[1], logs[1]
    # the first server saved the traced block (compile_core/cache/precompiled.py); the restarted one
    # loaded it and ran no dynamo trace
    assert "saved region WanAttentionBlock-" in logs[0] and "a restart loads it" in logs[0], logs[0]
    assert "loaded from" in logs[1] and "saved region(s), no trace" in logs[1], logs[1]
    assert list(entries[0].glob("inductor/tcs_saved_regions/WanAttentionBlock-*.bin"))
