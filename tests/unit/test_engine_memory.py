"""Leaks nothing: many compiled models come and go, and none of them stays in memory.

20 toy models in 6 structures (models of one structure share a compiled entry; 6 entries
are more than the reuse registry, bounded to 4 here to keep the test short, holds) are
prepared and run with aot_eager (real dynamo tracing and AOTAutograd), then dropped. Afterwards no model, block
or weight tensor is alive: not in the reuse registry, not in the structure-digest cache,
not in dynamo's code caches or guards. The registry stays within its bound, and entries it
evicted are freed too.
"""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

from compile_core.run import engine
from compile_core.plan import fingerprint
from compile_core.torch_support import aot
from compile_core.cache.registry import REGISTRY
from compile_core.plan.settings import CompileSettings, build_compile_args

CPU = torch.device("cpu")
N_MODELS = 20
N_STRUCTURES = 6
BOUND = 4


def settings(**kw):
    kw.setdefault("backend", "aot_eager")
    kw.setdefault("mode", "default")
    kw.setdefault("background_compile", False)  # (the tests of background mode ask for it)
    return CompileSettings.from_args(build_compile_args(**kw))


def _dims(i: int) -> int:
    """Consecutive models share a structure: 0,0,0,0,1,1,1,2,... (3-4 models each)."""
    return 8 + 4 * (i * N_STRUCTURES // N_MODELS)


def test_twenty_models_compiled_and_dropped_leave_nothing_alive(wan_factory, graph_count,
                                                                 monkeypatch):
    monkeypatch.setattr(REGISTRY, "max_entries", BOUND)
    wan = wan_factory()
    refs, entry_refs, fingerprints = [], [], []
    g0 = graph_count()
    for i in range(N_MODELS):
        torch.manual_seed(i)
        dim = _dims(i)
        model = wan.Model(n_blocks=2, dim=dim, heads=2, in_dim=4).eval()
        x, t = torch.randn(1, 3, 4), torch.rand(1)
        with torch.no_grad():
            ref = model(x, t)
            cm = engine.prepare(model, settings())
            out = cm.run(model, lambda: model(x, t), CPU)
        torch.testing.assert_close(out, ref)
        assert cm.entry.failed == ""
        refs += [weakref.ref(model), weakref.ref(model.blocks[0]), weakref.ref(model.blocks[1].qkv.weight),
                 weakref.ref(out)]
        entry_refs.append(weakref.ref(cm.entry))
        fingerprints.append(cm.fingerprint)
        assert len(REGISTRY) <= REGISTRY.max_entries
        del model, cm, out, ref, x, t
    assert graph_count() > g0  # it really compiled

    distinct = len(set(fingerprints))
    assert distinct == N_STRUCTURES > REGISTRY.max_entries  # reuse and the bound were exercised
    assert len(REGISTRY) == REGISTRY.max_entries

    gc.collect()
    alive = [r() for r in refs if r() is not None]
    assert not alive, (f"{len(alive)} of {len(refs)} models/blocks/tensors still alive, e.g. "
                       f"{type(alive[0]).__name__}: held by "
                       f"{[type(o).__name__ for o in gc.get_referrers(alive[0])][:8]}")
    assert not any(type(m).__name__ == "WanModel" for m in list(fingerprint._structure_cache.keys()))
    # entries the registry evicted are freed with their compiled callables; kept ones are the
    # most recently used fingerprints
    kept = [fp for fp in dict.fromkeys(reversed(fingerprints))][: REGISTRY.max_entries]
    assert all(fp in REGISTRY for fp in kept)
    evicted = {fp for fp in fingerprints if fp not in REGISTRY}
    assert evicted and len(evicted) == distinct - REGISTRY.max_entries
    dead_entries = sum(1 for r in entry_refs if r() is None)
    assert dead_entries >= len(evicted), "evicted registry entries are still referenced somewhere"


def test_dropped_models_free_their_weights_after_a_recompile(wan, graph_count):
    """A second input size recompiles (static policy): still nothing kept alive afterwards."""
    model = wan.Model(n_blocks=2, dim=16, heads=2, in_dim=4).eval()
    cm = engine.prepare(model, settings(shape_policy="static"))
    g0 = graph_count()
    with torch.no_grad():
        for tokens in (3, 5):
            x, t = torch.randn(1, tokens, 4), torch.rand(1)
            torch.testing.assert_close(cm.run(model, lambda: model(x, t), CPU), model(x, t))
    assert graph_count() - g0 >= 2
    refs = [weakref.ref(model), weakref.ref(model.blocks[0].ffn[0].weight)]
    del model, cm
    gc.collect()
    assert [r() for r in refs] == [None, None]


@pytest.mark.slow
@pytest.mark.skipif(not aot.load_compiled_function(),
                    reason="this torch cannot save and load a compiled function: no saved-region path")
def test_models_on_the_saved_region_path_are_freed_too(tmp_path, monkeypatch):
    """The saved-region path (torch's AOT functions, our guard checks, the persistent cache):
    models of two structures, a registry bounded to one entry, every region run on the fast
    path; afterwards no model, block or weight is alive."""
    import tcs_precompiled_model as tiny
    from compile_core.cache.persist import PersistentCache
    monkeypatch.setattr(REGISTRY, "max_entries", 1)
    refs, entry_refs = [], []
    for i, dim in enumerate((32, 32, 48, 48)):
        torch.manual_seed(i)
        model = tiny.WanModel(n_blocks=2, dim=dim).eval().requires_grad_(False)
        x, t = tiny.inputs(1, 6)
        with torch.no_grad():
            ref = model(x, t)
            cm = engine.prepare(model, settings(backend="inductor"), persistent=PersistentCache(tmp_path))
            out = cm.run(model, lambda: model(x, t), CPU)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
        fast = cm.entry.precompiled
        assert fast is not None and fast.captured + fast.loaded == 1 and not fast.regular
        refs += [weakref.ref(model), weakref.ref(model.blocks[0]), weakref.ref(model.blocks[1].qkv.weight)]
        entry_refs.append(weakref.ref(cm.entry))
        del model, cm, out, ref, x, t, fast
    gc.collect()
    alive = [r() for r in refs if r() is not None]
    assert not alive, (f"{len(alive)} of {len(refs)} still alive, e.g. {type(alive[0]).__name__}: held by "
                       f"{[type(o).__name__ for o in gc.get_referrers(alive[0])][:8]}")
    assert entry_refs[0]() is None  # the evicted entry went with its saved-region functions


@pytest.mark.parametrize("swapped", [False, True])
def test_a_model_compiled_in_the_background_is_freed_once_dropped(wan, swapped):
    """The worker's last job (its captured inputs, the compile it ran, its notification) must
    not keep the model alive after it is dropped: a server that switches checkpoints frees the
    old weights. ``swapped``: dropped after its compiled graphs took over, else while the
    finished job still waits to be swapped in."""
    from compile_core.run import background
    model = wan.Model(n_blocks=2).eval()
    x, t = torch.randn(1, 6, 8), torch.rand(1)
    cm = engine.prepare(model, settings(background_compile=True))
    cm.on_background_done = lambda: cm.description  # (the bridge's badge refresh holds the model too)
    with torch.no_grad():
        cm.run(model, lambda: model(x, t), CPU)
        assert background.wait_idle(120)
        if swapped:
            cm.run(model, lambda: model(x, t), CPU)
            assert cm.swapped_at == 2
    refs = [weakref.ref(model), weakref.ref(model.blocks[0].qkv.weight)]
    del model, cm
    gc.collect()
    assert [r() is None for r in refs] == [True, True]


def test_a_waiting_background_compile_of_a_dropped_model_is_dropped(wan, pack_log, monkeypatch):
    """On the CPU a background compile waits until the server is idle; a model ComfyUI lets go
    meanwhile is freed at once, and its job compiles nothing."""
    from compile_core.run import background
    host = {"idle": False}
    monkeypatch.setattr(background, "_IDLE_CHECK", [lambda: host["idle"]])
    model = wan.Model(n_blocks=2).eval()
    x, t = torch.randn(1, 6, 8), torch.rand(1)
    cm = engine.prepare(model, settings(background_compile=True))
    with torch.no_grad(), cm.sampling_run():
        cm.run(model, lambda: model(x, t), CPU)
    job = cm.background.job
    assert job is not None and job.yields and not job.started.is_set()  # waiting for the server
    refs = [weakref.ref(model), weakref.ref(model.blocks[0].qkv.weight), weakref.ref(cm)]
    del model, cm
    gc.collect()
    assert [r() is None for r in refs] == [True, True, True]
    host["idle"] = True
    assert background.wait_idle(60) and job.error is None and job.result == 0
    assert any("dropped: its model is gone" in m for m in pack_log.infos())
