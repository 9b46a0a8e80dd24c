"""The fleet on real ComfyUI servers: two workers, each with its own base directory and empty
local caches; worker 1 compiles and publishes, worker 2 warm-starts from the shared store."""
import sys
from pathlib import Path

import pytest

from harness import NODE_DEFAULTS, ComfyHost, rel_l2, wan_t2v_prompt

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from redis_server import RedisServer, free_port  # noqa: E402

INDUCTOR = NODE_DEFAULTS  # the settings node left as it is (mode speed, inductor)


def worker_run(tmp_path, name, model, store, settings=INDUCTOR):
    """A fresh worker: own base dir, own empty inductor dir, the shared store from the operator env."""
    host = ComfyHost(tmp_path / name, models=[model],
                     env={"TORCH_COMPILE_SPEED_SHARED_CACHE": store,
                          "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / f"{name}_inductor"),
                          "TORCH_COMPILE_SPEED_SHARED_TIMEOUT_S": "1"},
                     new_container=True)  # empty TMPDIR and HOME: nothing of worker 1's machine
    with host:
        eager = host.latent(host.run(wan_t2v_prompt(model.name, apply=False, prefix="e")))
        hist, log = host.run_compiled(lambda: wan_t2v_prompt(model.name, compile_settings=settings, prefix="c"))
        assert rel_l2(host.latent(hist), eager) < 1e-3
        worker_run.full_log = host.log_text()
        return log


@pytest.mark.slow
def test_second_worker_warm_starts_from_redis(tmp_path, tiny_wan_path):
    redis = RedisServer(tmp_path)
    try:
        log1 = worker_run(tmp_path, "worker1", tiny_wan_path, redis.url)
        assert "shared cache miss" in log1 and "published" in log1, log1
        keys = sorted(k.decode() for k in redis.client.keys("tcs:compile:*"))
        assert len(keys) == 1, keys  # the one compiled entry
        log2 = worker_run(tmp_path, "worker2", tiny_wan_path, redis.url)
        # worker 2's first compile fetched worker 1's entry into its own persistent cache
        assert "shared cache hit" in worker_run.full_log and "persistent cache hit" in log2, log2
        assert "published" not in log2  # nothing new was built
        # the archive carried worker 1's saved regions: worker 2 ran no dynamo trace at all
        assert "a restart loads it" in log1 and "saved region(s), no trace" in log2, log2
    finally:
        redis.stop()


@pytest.mark.slow
def test_second_worker_warm_starts_from_shared_directory(tmp_path, tiny_wan_path):
    shared = tmp_path / "network_volume"
    log1 = worker_run(tmp_path, "worker1", tiny_wan_path, str(shared))
    assert "published" in log1 and len(list(shared.glob("*.tcs"))) == 1  # the compiled entry
    log2 = worker_run(tmp_path, "worker2", tiny_wan_path, str(shared))
    assert "shared cache hit" in worker_run.full_log and "persistent cache hit" in log2, log2
    assert "saved region(s), no trace" in log2, log2
    # loading built kernels builds no precompiled C++ header (it cost 5 s of a 5.4 s load)
    assert not list((tmp_path / "worker2").rglob("*.h.gch")), sorted((tmp_path / "worker2").rglob("*.gch"))


def test_redis_down_costs_one_warning_and_compiles_locally(tmp_path, tiny_wan_path):
    down = f"redis://127.0.0.1:{free_port()}/0"
    log = worker_run(tmp_path, "lonely", tiny_wan_path, down, settings={"backend": "aot_eager"})
    assert log.count("not used") == 1 and "ConnectionError" in log, log
    assert "compiled WanAttentionBlock x2" in log, log  # locally, after one bounded try
