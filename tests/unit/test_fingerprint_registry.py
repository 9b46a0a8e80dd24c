"""compile_core.plan.fingerprint (what makes two compile requests alike) and compile_core.cache.registry."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

from compile_core.plan import fingerprint as fp_mod
from compile_core.plan.fingerprint import fingerprint, structure_digest
from compile_core.plan.regions import plan_regions
from compile_core.cache.registry import ReuseRegistry
from compile_core.plan.settings import CompileSettings, build_compile_args


def _settings(**kw):
    kw.setdefault("mode", "default")
    kw.setdefault("backend", "aot_eager")
    return CompileSettings.from_args(build_compile_args(**kw))


def _fp(model, settings=None):
    settings = settings or _settings()
    return fingerprint(model, plan_regions(model, settings.blocks_only), settings)


def test_same_structure_same_fingerprint_despite_different_weights(wan):
    torch.manual_seed(0)
    a = wan.Model()
    torch.manual_seed(1)
    b = wan.Model()
    assert not torch.equal(a.blocks[0].qkv.weight, b.blocks[0].qkv.weight)
    assert structure_digest(a) == structure_digest(b)
    assert _fp(a) == _fp(b)


def test_weight_changes_in_place_keep_the_fingerprint(wan):
    m = wan.Model()
    before = _fp(m)
    with torch.no_grad():
        m.blocks[0].qkv.weight.add_(1.0)  # e.g. a LoRA merge
    assert _fp(m) == before


def test_where_the_weights_sit_keeps_the_fingerprint(wan):
    """ComfyUI moves weights between CPU and GPU (or splits them in low-VRAM mode) between
    prompts; Apply running again must find the same compiled work. ``meta`` stands in for
    the GPU here."""
    torch.manual_seed(0)
    on_cpu = wan.Model()
    torch.manual_seed(0)
    moved = wan.Model()
    moved.blocks[0].to("meta")  # partly moved
    assert _fp(moved) == _fp(on_cpu)
    moved.to("meta")
    assert _fp(moved) == _fp(on_cpu)


def test_fingerprint_is_stable_and_short(wan):
    m = wan.Model()
    f = _fp(m)
    assert f == _fp(m) and len(f) == 24 and int(f, 16) >= 0


def test_dtype_changes_the_fingerprint(wan):
    m = wan.Model()
    before_digest, before = structure_digest(m), _fp(m)
    m.to(torch.float64)
    assert structure_digest(m) != before_digest
    assert _fp(m) != before


def test_shape_changes_the_fingerprint(wan):
    assert _fp(wan.Model(dim=32)) != _fp(wan.Model(dim=64))
    assert _fp(wan.Model(n_blocks=4)) != _fp(wan.Model(n_blocks=5))


def test_class_changes_the_fingerprint(wan_factory):
    make_wan_classes = wan_factory
    a, b = make_wan_classes("WanModel"), make_wan_classes("WanModel")
    # Same names and shapes in fresh classes of the same qualname: alike (the same checkpoint
    # loaded by a re-imported module).
    assert _fp(a.Model()) == _fp(b.Model())
    c = make_wan_classes("OtherDiT")
    assert structure_digest(c.Model()) != structure_digest(a.Model())


@pytest.mark.parametrize("change", [
    dict(backend="eager"), dict(mode="max-autotune", backend="inductor"), dict(fullgraph=True),
    dict(compile_transformer_blocks_only=False), dict(force_parameter_static_shapes=True),
    dict(mode="speed"), dict(shape_policy="static"), dict(shape_policy="dynamic"),
])
def test_settings_that_change_the_artifact_change_the_fingerprint(wan, change):
    m = wan.Model()
    assert _fp(m, _settings(**change)) != _fp(m)


@pytest.mark.parametrize("change", [
    dict(reuse_if_similar=False), dict(warmup_runs=3), dict(dynamo_cache_size_limit=9),
    dict(dynamo_recompile_limit=5), dict(ptx_cache_dir="somewhere"),
    dict(dynamic=True),  # only WanVideoWrapper reads it; the pack's compile follows shape_policy
])
def test_settings_that_do_not_change_the_artifact_keep_it(wan, change):
    m = wan.Model()
    assert _fp(m, _settings(**change)) == _fp(m)


def test_torch_version_is_part_of_the_fingerprint(wan, monkeypatch):
    m = wan.Model()
    before = _fp(m)
    monkeypatch.setattr(fp_mod.torch, "__version__", "0.0.0+other")
    assert _fp(m) != before
    monkeypatch.undo()
    assert _fp(m) == before


def test_structure_cache_does_not_keep_modules_alive(wan):
    m = wan.Model()
    structure_digest(m)
    _fp(m)
    assert m in fp_mod._structure_cache
    ref = weakref.ref(m)
    gc.collect()  # models of earlier tests that are already garbage leave the cache now, not below
    size = len(fp_mod._structure_cache)
    del m
    gc.collect()
    assert ref() is None
    assert len(fp_mod._structure_cache) == size - 1


def test_structure_digest_is_cached_and_revalidated(wan):
    m = wan.Model()
    d = structure_digest(m)
    assert fp_mod._structure_cache[m][1] == d
    m.extra = torch.nn.Linear(2, 2)  # one more child module: the cheap signature changes
    assert structure_digest(m) != d


# -- registry -------------------------------------------------------------------------------------

def test_get_or_create_builds_once_then_reuses():
    reg = ReuseRegistry(max_entries=4)
    built = []

    def factory():
        built.append(1)
        return lambda: "compiled"

    e1, reused1 = reg.get_or_create("a", factory, lazy=True)
    e2, reused2 = reg.get_or_create("a", factory, lazy=True)
    e3, reused3 = reg.get_or_create("a", factory, lazy=True)
    assert (reused1, reused2, reused3) == (False, True, True)
    assert e1 is e2 is e3
    assert built == []  # built at the first use (a background compile builds it on its worker)
    assert e1.fingerprint == "a" and e1.compiled() == "compiled" and e2.compiled() == "compiled"
    assert len(built) == 1
    assert e1.reuses == 2
    assert "a" in reg and len(reg) == 1


def test_an_apply_with_other_recompile_limits_gets_an_entry_of_its_own(wan):
    """The limits stay out of the fingerprint (the persistent cache serves any), but they decide
    how many graphs a compile object makes: a second Apply with a larger budget must not get the
    first one's compile object and its smaller budget."""
    from compile_core.run import engine
    m, reg = wan.Model(), ReuseRegistry()
    small = engine.prepare(m, _settings(dynamo_cache_size_limit=1, dynamo_recompile_limit=1), registry=reg)
    large = engine.prepare(m, _settings(), registry=reg)
    again = engine.prepare(m, _settings(), registry=reg)
    assert small.fingerprint == large.fingerprint
    assert large.entry is not small.entry and not large.reused
    assert again.entry is large.entry and again.reused


def test_lru_bound_evicts_the_least_recently_used():
    reg = ReuseRegistry(max_entries=2)
    reg.get_or_create("a", object)
    reg.get_or_create("b", object)
    reg.get_or_create("a", object)      # a is now the most recently used
    reg.get_or_create("c", object)      # evicts b
    assert len(reg) == 2
    assert "a" in reg and "c" in reg and "b" not in reg
    reg.get_or_create("d", object)      # evicts a
    assert "a" not in reg and {"c", "d"} == {k for k in "abcd" if k in reg}
    _, reused = reg.get_or_create("b", object)
    assert reused is False


def test_registry_clear():
    reg = ReuseRegistry()
    reg.get_or_create("a", object)
    reg.clear()
    assert len(reg) == 0 and "a" not in reg


def test_factory_failure_leaves_no_entry():
    reg = ReuseRegistry()

    def broken():
        raise RuntimeError("cannot build")

    with pytest.raises(RuntimeError):
        reg.get_or_create("a", broken)
    assert "a" not in reg and len(reg) == 0


def test_registry_does_not_keep_models_alive(wan):
    """Entries hold compiled callables, never a model."""
    from compile_core.run import engine
    reg = ReuseRegistry()
    m = wan.Model()
    cm = engine.prepare(m, _settings(), registry=reg)
    assert cm.fingerprint in reg
    ref = weakref.ref(m)
    del m
    gc.collect()
    assert ref() is None


def test_a_failed_entry_is_rebuilt_by_the_next_request():
    """A compile failure may be transient (out of memory while autotuning): the next Apply of
    that fingerprint gets a fresh entry and compiles again; who holds the failed one keeps it."""
    reg = ReuseRegistry()
    first, _ = reg.get_or_create("a", object)
    first.failed = "out of memory"
    again, reused = reg.get_or_create("a", object)
    assert again is not first and not reused and again.failed == ""
    assert again.compiled is not first.compiled  # a new torch.compile object, not the failed one
    assert first.failed == "out of memory"
    assert reg.get_or_create("a", object) == (again, True) and len(reg) == 1
