"""A transient compile failure is retried by the next Apply, and persistent-cache I/O
errors (read-only folder, full disk, a file in use, a second ComfyUI evicting the same entry)
never fail a sampling run: the cache is just not used or not saved, with one warning."""
from __future__ import annotations

import pytest
import torch

from compile_core.run import compile_pass, engine
from compile_core.report import log
from compile_core.cache import persist
from compile_core.cache.persist import PersistentCache

from tcs_engine_helpers import CPU, eager, run, settings


def _fail(exc):
    def raiser(*_a, **_k):
        raise exc
    return raiser


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(log, "_said", set())


def test_a_new_apply_retries_a_failed_compile_once(wan, wan_inputs, raising_backend, pack_log):
    model = wan.Model(n_blocks=2).eval()
    x, t = wan_inputs()
    ref = eager(model, x, t)
    cm = engine.prepare(model, settings(backend=raising_backend.name))
    for _ in range(3):  # within one applied model the fallback stays: no retry per step
        torch.testing.assert_close(run(cm, model, x, t), ref)
    assert cm.entry.failed and raising_backend.calls == 1
    again = engine.prepare(model, settings(backend=raising_backend.name))  # Apply runs again
    assert not again.reused and again.entry.failed == ""
    for _ in range(3):
        torch.testing.assert_close(run(again, model, x, t), ref)
    assert raising_backend.calls == 2 and again.entry.failed
    assert len(pack_log.warnings()) == 2  # one per Apply


def test_an_unwritable_cache_folder_does_not_fail_the_run(wan, wan_inputs, tmp_path, monkeypatch,
                                                          pack_log):
    model = wan.Model(n_blocks=2).eval()
    x, t = wan_inputs()
    ref = eager(model, x, t)
    monkeypatch.setattr(persist.Path, "mkdir", _fail(PermissionError(13, "Permission denied")))
    cm = engine.prepare(model, settings(), persistent=PersistentCache(tmp_path / "ro", max_bytes=2 ** 30))
    for _ in range(2):
        torch.testing.assert_close(run(cm, model, x, t), ref)
    assert cm.entry.failed == "" and cm.entry.graphs >= 1
    warnings = pack_log.warnings()
    assert len(warnings) == 1 and "Permission denied" in warnings[0], warnings


def test_saving_after_a_compile_survives_a_failing_disk(wan, tmp_path, monkeypatch, pack_log):
    """What runs after a successful (inductor) compile: meta.json, touch, eviction."""
    cache = PersistentCache(tmp_path, max_bytes=0)
    cm = engine.prepare(wan.Model(n_blocks=2), settings(backend="inductor"), persistent=cache)
    cache.inductor_dir(cm.fingerprint).mkdir(parents=True)  # made by the compile's env()
    (tmp_path / "other").mkdir()  # an entry a second ComfyUI evicts at the same moment
    monkeypatch.setattr(persist.os, "replace", _fail(PermissionError(13, "sharing violation")))
    monkeypatch.setattr(persist.Path, "stat", _fail(FileNotFoundError(2, "No such file")))
    compile_pass.note_cache(cm.state, compile_pass.cache_counts(cm.state), CPU)  # does not raise
    assert not cache.is_complete(cm.fingerprint)
    warnings = pack_log.warnings()
    assert len(warnings) == 1 and "sharing violation" in warnings[0], warnings
