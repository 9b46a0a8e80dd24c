"""compile_core.cache.precompiled: a region traced once is loaded by the next process without a
dynamo trace, and only ever runs where the code it was traced from is unchanged.

The cross-process tests run real inductor compiles of a small module-level block
(``tcs_precompiled_model``) in child processes that share one persistent cache root.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch
from torch import nn

import tcs_precompiled_model as tiny
from compile_core.run import engine
from compile_core.cache import guard_names, precompiled, saved_guards, saved_region
from compile_core.torch_support import guard_pickling
from compile_core.torch_support import aot, torch_compat
from compile_core.cache.persist import PersistentCache
from compile_core.plan.settings import CompileSettings, build_compile_args

# Saved regions need torch's AOT save/load round trip (torch 2.13+ here; off on 2.8/2.9, see
# compile_core/torch_support/aot.py and the torch table in docs/how-it-works.md): without it this
# path never runs.
pytestmark = pytest.mark.skipif(not aot.load_compiled_function(),
                                reason="this torch cannot save and load a compiled function")

ROOT = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent("""
    import json, logging, sys
    logging.basicConfig(level=logging.INFO)
    sys.path[:0] = [{models!r}, {root!r}, {tests!r}]
    import torch
    from torch._dynamo.utils import counters
    import tcs_precompiled_model as tiny
    from compile_core.run import engine
    from compile_core.cache.persist import PersistentCache
    from compile_core.plan.settings import CompileSettings, build_compile_args
    settings = CompileSettings.from_args(build_compile_args(backend="inductor", mode={mode!r}, background_compile=False))
    model = tiny.build()
    for block in model.blocks[:{grad_blocks}]:  # what a LoRA patch leaves: requires_grad differs
        block.qkv.weight.requires_grad_(True)
    out = {{"rel": []}}
    with torch.no_grad():
        cm = engine.prepare(model, settings, persistent=PersistentCache({cache!r}))
        opts = {{"optimized_attention_override": getattr(tiny, {override!r})}} if {override!r} else {{}}
        for batch, tokens in ((1, 6), (1, 10), (1, 17)):  # (batch: see the host shape tests)
            x, t = tiny.inputs(batch, tokens)
            ref = model(x, t, opts)
            got = cm.run(model, lambda: model(x, t, opts), x.device)
            out["rel"].append(float((got - ref).norm() / ref.norm()))
    fast = cm.entry.precompiled
    out.update(loaded=fast.loaded, captured=fast.captured, traced=counters["stats"]["unique_graphs"],
               hits=cm.entry.cache_hits, misses=cm.entry.cache_misses, regular=sorted(fast.regular))
    print("RESULT " + json.dumps(out))
""")


def _child(cache: Path, mode: str = "speed", grad_blocks: int = 0, override: str = "",
           models: Path | None = None) -> dict:
    """One process on ``cache``; ``models``: a folder whose copy of ``tcs_precompiled_model``
    it imports instead of the tests' own."""
    code = CHILD.format(root=str(ROOT), tests=str(ROOT / "tests" / "unit"), cache=str(cache), mode=mode,
                        grad_blocks=grad_blocks, override=override, models=str(models or ROOT / "tests" / "unit"))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return {**json.loads(line[len("RESULT "):]), "log": proc.stderr}


def _saved(cache: Path) -> list[Path]:
    return sorted(cache.glob(f"*/inductor/{precompiled.DIRNAME}/*.bin"))


@pytest.mark.slow
def test_a_region_saved_before_its_blocks_code_changed_is_traced_afresh(tmp_path):
    """What a ComfyUI update does to a model file between two server runs on one cache: the
    saved region must not run the old code (it gave 0.35 rel L2 from eager when it did)."""
    models = tmp_path / "models"
    models.mkdir()
    source = Path(tiny.__file__).read_text()
    changed = source.replace("return x + self.ffn(x)", "return x + 2 * self.ffn(x)")
    assert changed != source
    (models / "tcs_precompiled_model.py").write_text(source)
    cache = tmp_path / "cache"
    first = _child(cache, models=models)
    assert first["captured"] == 1 and max(first["rel"]) < 1e-5, first
    (models / "tcs_precompiled_model.py").write_text(changed)
    second = _child(cache, models=models)
    # (rel: against the changed code's eager output, in the same process)
    assert second["loaded"] == 0 and second["captured"] == 1 and max(second["rel"]) < 1e-5, second
    said = [ln for ln in second["log"].splitlines() if "the model's code changed since it was traced" in ln]
    assert len(said) == 1 and "tcs_precompiled_model lines" in said[0], second["log"]
    third = _child(cache, models=models)  # the changed code's own region loads from now on
    assert third["loaded"] == 1 and third["traced"] == 0 and max(third["rel"]) < 1e-5, third


def test_a_saved_regions_bin_and_json_are_bound_by_digest(tmp_path):
    """A .bin from another save beside a .json (two writers, a partial copy) is not loaded."""
    model = tiny.build()
    x, t = tiny.inputs(1, 6)
    block = model.blocks[0]
    e = model.time(t[:, None])[:, None, :]
    h = model.embed(x)
    with torch.no_grad():
        region = saved_region.capture(block, (h, e), {"transformer_options": {}}, {"backend": "inductor"})
    saved_region.save(region, tmp_path, "a")
    assert saved_region.load(tmp_path, "a")[0] is not None
    data = (tmp_path / "a.bin").read_bytes()
    (tmp_path / "a.bin").write_bytes(data + b"\0")
    back, why = saved_region.load(tmp_path, "a")
    assert back is None and "not the one its .json was written for" in why


def test_a_region_loads_back_without_building_its_kernels_again(tmp_path, monkeypatch):
    """The load right after a capture (``Precompiled._save_checked``), a restart's and a fleet
    worker's look up the kernels the capture built: none is built again (a capture with
    inductor's precompiled C++ header and a load without it built every kernel twice)."""
    inductor = tmp_path / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(inductor))
    torch.manual_seed(0)
    block = tiny.Block(dim=40).eval().requires_grad_(False)  # (a size no other test compiles)
    h, emb = torch.randn(1, 6, 40), torch.randn(1, 1, 40)
    with torch.no_grad():
        region = saved_region.capture(block, (h, emb), {"transformer_options": {}}, {"backend": "inductor"})
        built = sorted(inductor.rglob("*.so"))
        saved_region.save(region, tmp_path / "saved", "a")
        back, why = saved_region.load(tmp_path / "saved", "a")
        assert back is not None and not why, why
        assert back.accepts(block, (h, emb), {"transformer_options": {}})
        torch.testing.assert_close(back.fn.fn(block, h, emb, transformer_options={}), block(h, emb, {}))
    assert built and sorted(inductor.rglob("*.so")) == built


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["speed"])  # the settings node's default
def test_a_second_process_loads_the_region_without_tracing(tmp_path, mode):
    cache = tmp_path / "cache"
    first = _child(cache, mode)
    assert first["captured"] == 1 and first["loaded"] == 0 and first["traced"] == 1, first
    assert first["misses"] >= 1 and not first["regular"]
    assert len(_saved(cache)) == 1
    second = _child(cache, mode)
    # no dynamo trace at all in the second process, for every size, and the same output
    assert second["loaded"] == 1 and second["captured"] == 0 and second["traced"] == 0, second
    assert second["hits"] == 1 and second["misses"] == 0
    assert "loaded from" in second["log"]
    for run in (first, second):
        assert max(run["rel"]) < 1e-5, run["rel"]

    # a damaged file is ignored (with the reason logged); the region is traced and saved again
    _saved(cache)[0].write_bytes(b"not torch's bytes")
    third = _child(cache, mode)
    assert third["captured"] == 1 and third["loaded"] == 0 and max(third["rel"]) < 1e-5, third
    assert "its .bin is not the one its .json was written for" in third["log"]
    assert _child(cache, mode)["loaded"] == 1  # and the fresh copy loads


@pytest.mark.slow
def test_weights_whose_requires_grad_differs_get_their_own_saved_variant(tmp_path):
    """ComfyUI loads parameters with requires_grad=True, and a LoRA leaves the weights it patched
    at False; torch's saved guards pin it. Workflows that alternate (LoRA, no LoRA) across
    restarts get a saved variant for each state, and both later load without a trace."""
    cache = tmp_path / "cache"
    no_lora, lora = _child(cache, grad_blocks=3), _child(cache, grad_blocks=0)
    assert no_lora["captured"] == 1 and lora["captured"] == 1 and lora["loaded"] == 0, lora
    assert "tracing another" in lora["log"]
    assert len(_saved(cache)) == 2
    for grad_blocks in (3, 0):
        again = _child(cache, grad_blocks=grad_blocks)
        assert again["loaded"] == 1 and again["captured"] == 0 and again["traced"] == 0, again
        assert max(again["rel"]) < 1e-5


def _settings():
    return CompileSettings.from_args(build_compile_args(backend="inductor", mode="default", background_compile=False))


@pytest.mark.slow
def test_a_patched_global_sends_the_region_to_the_regular_path(tmp_path, monkeypatch, pack_log):
    model = tiny.build()
    x, t = tiny.inputs(1, 6)
    with torch.no_grad():
        cm = engine.prepare(model, _settings(), persistent=PersistentCache(tmp_path))
        cm.run(model, lambda: model(x, t), x.device)
        assert cm.entry.precompiled.captured == 1
        # a node patches a function the block calls: the traced function must not run on
        monkeypatch.setattr(tiny, "gate", lambda v: torch.tanh(v) * 3)
        ref = model(x, t)
        got = cm.run(model, lambda: model(x, t), x.device)
    assert torch.allclose(got, ref, rtol=1e-4, atol=1e-5)
    assert cm.entry.precompiled.regular, "the region should have left the fast path"
    assert any("was replaced since it was traced" in m for m in pack_log.infos()), pack_log.infos()


@pytest.mark.slow
def test_an_attention_override_that_changes_is_never_run_stale(tmp_path, pack_log):
    """A patch node's ``optimized_attention_override`` in ``transformer_options``: torch cannot
    save the guard on its code, so ``LocalChecks`` replaces it. The output follows every change,
    as eager does (set before the first capture, then changed), and the fast path serves it: one
    saved variant per override, none run for another."""
    model = tiny.build()
    x, t = tiny.inputs(1, 6)
    runs = [tiny.halved, tiny.negated, None, tiny.halved]
    with torch.no_grad():
        cm = engine.prepare(model, _settings(), persistent=PersistentCache(tmp_path))
        for override in runs:
            opts = {"optimized_attention_override": override} if override else {}
            ref = model(x, t, opts)
            got = cm.run(model, lambda: model(x, t, opts), x.device)
            rel = float((got - ref).norm() / ref.norm())
            assert rel < 1e-5, (override, rel)
    fast = cm.entry.precompiled
    assert not cm.entry.failed and not fast.regular, pack_log.infos()
    assert fast.captured == 3  # halved, negated, none; the second halved run reused its variant


@pytest.mark.slow
def test_a_trace_after_the_first_compile_still_runs_in_the_run_scope(tmp_path, monkeypatch):
    """After the first compile the engine leaves the run's scope to the saved regions: a
    variant traced later (here for a new attention override) still gets the run's knobs and
    its cache folder, as the first one did, and the output follows eager."""
    import torch._dynamo.config as dynamo_config
    seen, real = [], saved_region.capture

    def recording(*args, **kwargs):
        seen.append((os.environ.get("TORCHINDUCTOR_CACHE_DIR", ""),
                     getattr(dynamo_config, torch_compat.recompile_limit_knob())))
        return real(*args, **kwargs)
    monkeypatch.setattr(saved_region, "capture", recording)
    model, settings = tiny.build(), _settings()
    x, t = tiny.inputs(1, 6)
    outside = getattr(dynamo_config, torch_compat.recompile_limit_knob())
    with torch.no_grad():
        cm = engine.prepare(model, settings, persistent=PersistentCache(tmp_path))
        for override in (None, None, tiny.halved):
            opts = {"optimized_attention_override": override} if override else {}
            ref = model(x, t, opts)
            got = cm.run(model, lambda: model(x, t, opts), x.device)
            assert float((got - ref).norm() / ref.norm()) < 1e-5, override
    assert cm.entry.precompiled.captured == 2 and len(seen) == 2
    assert settings.cache_size_limit != outside
    for folder, limit in seen:
        assert folder.startswith(str(tmp_path)) and limit == settings.cache_size_limit, seen
    assert getattr(dynamo_config, torch_compat.recompile_limit_knob()) == outside


@pytest.mark.slow
def test_an_override_is_checked_after_a_restart_too(tmp_path):
    """A restarted process loads the variant saved for the same override without a trace, and
    traces a new one for another override, whose output follows it."""
    cache = tmp_path / "cache"
    first = _child(cache, override="halved")
    assert first["captured"] == 1 and max(first["rel"]) < 1e-5, first
    same = _child(cache, override="halved")
    assert same["loaded"] == 1 and same["traced"] == 0 and max(same["rel"]) < 1e-5, same
    other = _child(cache, override="negated")
    assert other["loaded"] == 0 and other["captured"] == 1 and max(other["rel"]) < 1e-5, other


def _closure(scale):
    def f(attn, q, k, v):
        return attn(q, k, v) * scale
    return f


def test_local_checks_compare_code_not_identity():
    """The replacement for dynamo's code guard: the same function passes, a new closure over
    the same code passes (its cell contents have guards of their own), another function, a
    non-function or a missing key fails; names from a file are parsed, never evaluated."""
    opts = {"transformer_options": {"optimized_attention_override": _closure(0.5)}}
    name = "kwargs['transformer_options']['optimized_attention_override']"
    checks = saved_guards.LocalChecks.capture([name], None, (), opts)
    assert checks.accepts(None, (), opts)
    fresh = saved_guards.LocalChecks(checks.names, checks.described)  # as loaded from a file
    assert fresh.accepts(None, (), {"transformer_options": {"optimized_attention_override": _closure(2.0)}})
    for value in (tiny.halved, lambda attn, q, k, v: attn(q, k, v), 1.0):
        assert not fresh.accepts(None, (), {"transformer_options": {"optimized_attention_override": value}})
    assert not fresh.accepts(None, (), {"transformer_options": {}})
    assert not saved_guards.LocalChecks(["kwargs['a'](1)"], ["x"]).accepts(None, (), {"a": 1})


def test_guards_torch_cannot_save_on_locals_are_never_dropped_silently():
    """The guard filter's decisions, on dynamo's own entry type: globals are replaced by our
    checks, a function's code guard on the call's arguments by ``LocalChecks``, type guards on
    nested classes by the region key, and any other unsaveable local guard is reported as
    unchecked (that region then never takes the fast path)."""
    from torch._dynamo.types import GuardFilterEntry

    class Nested:
        pass

    def entry(name, kind, value=None, is_global=False):
        return GuardFilterEntry(name=name, has_value=value is not None, value=value, guard_type=kind,
                                derived_guard_types=(), is_global=is_global, orig_guard=None)

    dropped, local_fns, unchecked = set(), set(), set()
    keep = saved_guards.keep_guard(dropped, local_fns, unchecked)
    override = "kwargs['transformer_options']['optimized_attention_override']"
    entries = [entry("G['torch'].sigmoid", "FUNCTION_MATCH", torch.sigmoid, True),
               entry("self", "TYPE_MATCH", Nested()),
               entry("type(self).__mro__", "ID_MATCH", (object,)),
               entry(override, "CLOSURE_MATCH", tiny.halved),
               entry("kwargs['transformer_options']['hook']", "ID_MATCH", object()),
               entry("args[0]", "TENSOR_MATCH", torch.zeros(1))]
    assert keep(entries) == [False, False, False, False, False, True]
    assert dropped == {"G['torch'].sigmoid"} and local_fns == {override}
    assert unchecked == {"kwargs['transformer_options']['hook'] (ID_MATCH)"}


def test_region_key_follows_every_submodule_class():
    a, b = tiny.Block(), tiny.Block()
    assert precompiled.region_key(a) == precompiled.region_key(b)

    class OtherLinear(nn.Linear):
        pass

    b.proj = OtherLinear(32, 32)
    assert precompiled.region_key(a) != precompiled.region_key(b)
    assert precompiled.region_key(a).startswith("Block-")


def test_region_keys_are_kept_for_the_same_modules_only_when_asked(tmp_path, monkeypatch):
    walked = []
    monkeypatch.setattr(precompiled, "region_key",
                        lambda m, key=precompiled.region_key: walked.append(m) or key(m))
    fast, model, cpu = precompiled.Precompiled(tmp_path, {}), tiny.build(), torch.device("cpu")
    blocks = list(model.blocks)
    fast.begin_run(blocks, cpu)
    fast.begin_run(blocks, cpu, keep_keys=True)
    assert len(walked) == 3
    fast.begin_run(blocks[:2], cpu, keep_keys=True)  # other modules: keyed again
    fast.begin_run(blocks, cpu, keep_keys=True)
    assert len(walked) == 3 + 2 + 3
    fast.begin_run(blocks, cpu)  # not asked: walked again
    assert len(walked) == 11
    assert set(fast._keys) == {id(b) for b in blocks}


class CountingRegion:
    """FAKE loaded saved region: accepts every call, counts its guard checks, returns ``x``."""
    def __init__(self):
        self.fn, self.checks = self, 0

    def guard_check(self, *args, **kwargs) -> bool:
        self.checks += 1
        return True

    def __call__(self, module, *args, **kwargs):
        return args[0]


def test_the_direct_guard_check_answers_as_torchs_guard_check(tmp_path):
    """A captured region's guards, checked without binding the call to its signature
    (``saved_guards.guard_checker``), accept and reject exactly the calls torch's own
    ``guard_check`` does; the region uses the direct check once it accepted a call."""
    block = tiny.build().blocks[0]
    x, emb = torch.randn(1, 6, 32), torch.randn(1, 1, 32)
    with torch.no_grad():  # (grad mode is guarded too)
        region = saved_region.capture(block, (x, emb), {"transformer_options": {}}, _settings().compile_kwargs())
        _same_answers(region, block, x, emb)
    with torch.enable_grad():
        _same_answers(region, block, x, emb, grad=True)


def _same_answers(region, block, x, emb, grad=False):
    direct = saved_guards.guard_checker(region.fn)
    assert direct is not None  # this torch: a region compiled from nn.Module._call_impl
    calls = [((x, emb), {"transformer_options": {}}),                      # the traced call
             ((torch.randn(1, 11, 32), emb), {"transformer_options": {}}),  # another token count
             ((x.double(), emb), {"transformer_options": {}}),              # another dtype
             ((torch.randn(1, 6, 16), emb), {"transformer_options": {}}),   # another width
             ((x, emb), {"transformer_options": {"hook": 1}})]              # another dict
    answers = [region.fn.guard_check(block, *a, **k) for a, k in calls]
    assert [direct(block, a, k) for a, k in calls] == answers
    if grad:  # grad mode on: torch's guards reject every call, and so does the direct check
        assert answers == [False] * len(calls)
        return
    assert answers[0] is True and False in answers
    assert region.guards is None and not region.accepts(block, *calls[2])
    assert region.guards is None  # (decided on an accepted call only)
    assert region.accepts(block, *calls[0]) and region.guards is not None
    assert region.guards != region._guard_check  # the direct check took over
    assert [region.accepts(block, a, k) for a, k in calls] == answers


def test_a_direct_guard_check_that_disagrees_is_not_used(monkeypatch, pack_log):
    """FAKE direct check that rejects what torch's ``guard_check`` accepts (a torch whose
    guards read more than the call): the region keeps ``guard_check``, and says so once."""
    monkeypatch.setattr(saved_region, "guard_checker", lambda fn: lambda m, a, k: False)
    fake = CountingRegion()
    region = saved_region._Region(fake, saved_guards.GlobalChecks.capture([], {}), saved_guards.LocalChecks([], []))
    block, args = tiny.build().blocks[0], (torch.randn(1, 6, 32),)
    assert region.accepts(block, args, {}) and region.accepts(block, args, {})
    assert region.guards == region._guard_check and fake.checks == 2
    assert any("rejected a call guard_check accepts" in m for m in pack_log.infos())


class CountingScope:
    """The run's scope as the saved regions see it (``begin_run(scope=)``): counts entries."""
    def __init__(self):
        self.entered = 0

    @contextlib.contextmanager
    def __call__(self):
        self.entered += 1
        yield


def test_the_saved_regions_enter_the_run_scope_only_where_it_is_needed(tmp_path):
    """Loading, a region's first call and the regular path run in the run's scope (its knobs
    and cache folders); a later call a saved region takes enters no scope at all."""
    fast, blocks, fake = precompiled.Precompiled(tmp_path, {}), list(tiny.build().blocks), CountingRegion()
    scope = CountingScope()
    fast.begin_run(blocks, torch.device("cpu"), scope=scope)
    args, kwargs = (torch.randn(2, 4, 32),), {}
    key = fast._keys[id(blocks[0])]
    assert fast._find(key, blocks[0], args, kwargs) is None and scope.entered == 1  # looked for saved files
    fast.regions[key] = [saved_region._Region(fake, saved_guards.GlobalChecks.capture([], {}),
                                             saved_guards.LocalChecks([], []))]

    def regular(module, *a, **k):
        assert scope.entered == entered_before + 1, "the regular path runs inside the scope"
        return "regular"
    assert fast.call(blocks[0], args, kwargs, lambda: None, regular) is args[0] and scope.entered == 2
    for _ in range(3):
        assert fast.call(blocks[1], args, kwargs, lambda: None, regular) is args[0]
    assert scope.entered == 2  # (blocks share the key: the region ran once already)
    fast.regular.add(key)  # e.g. its code changed: the regular path takes the region
    entered_before = scope.entered
    assert fast.call(blocks[0], args, kwargs, lambda: None, regular) == "regular"
    assert scope.entered == 3
    fast.begin_run(blocks, torch.device("cpu"))  # a caller that entered the scope itself
    fast.call(blocks[0], args, kwargs, lambda: None, lambda *a, **k: None)
    assert scope.entered == 3


class RecordingPrecompiled:
    """FAKE saved-region store: records ``begin_run``'s ``keep_keys``; every call goes the
    regular way."""
    loaded = captured = 0

    def __init__(self):
        self.keep = []

    def begin_run(self, modules, device, keep_keys=False, scope=None):
        self.keep.append(keep_keys)

    def call(self, module, args, kwargs, mark, regular):
        mark()
        return regular(module, *args, **kwargs)


def test_a_sampling_run_keys_the_regions_at_its_first_model_call_only():
    """``CompiledModel.sampling_run`` (the bridge's sampling wrapper): ComfyUI replaces modules
    when it loads the model, before a run's first call, so the keys are made then; outside a
    run every call makes them."""
    settings = CompileSettings.from_args(build_compile_args(backend="aot_eager", mode="default",
                                                           background_compile=False))
    model, x = tiny.build(), torch.randn(2, 4, 8)
    cm = engine.prepare(model, settings, engine.ReuseRegistry())
    cm.entry.compiled, cm.entry.graphs = nn.Module._call_impl, 1  # the keying is tested, not a compile
    cm.entry.precompiled = fake = RecordingPrecompiled()
    t = torch.ones(2)
    with torch.no_grad():
        for _ in range(2):
            with cm.sampling_run():
                for _ in range(3):
                    cm.run(model, lambda: model(x, t), x.device)
        cm.run(model, lambda: model(x, t), x.device)
    assert fake.keep == [False, True, True, False, True, True, False]


def test_only_regional_inductor_compiles_without_cuda_graphs_use_it(monkeypatch):
    s = _settings()
    assert precompiled.supported(s, regional=True)
    monkeypatch.setenv(precompiled.OFF_ENV, "0")  # the operator's switch
    assert not precompiled.supported(s, regional=True)
    monkeypatch.delenv(precompiled.OFF_ENV)
    assert not precompiled.supported(s, regional=False)
    for kw in ({"backend": "aot_eager"}, {"mode": "reduce-overhead"}, {"mode": "max-autotune"}):
        args = build_compile_args(**{"backend": "inductor", "mode": "default", "background_compile": False, **kw})
        assert not precompiled.supported(CompileSettings.from_args(args), regional=True), kw


def test_global_checks_notice_a_replaced_function_a_grown_dict_and_a_new_constant(monkeypatch):
    names = ["G['__import_tcs_precompiled_model'].gate", "G['__import_tcs_precompiled_model'].HOOKS",
             "G['__import_tcs_precompiled_model'].LIMIT", "G['torch'].sigmoid"]
    monkeypatch.setattr(tiny, "HOOKS", {}, raising=False)
    monkeypatch.setattr(tiny, "LIMIT", 4, raising=False)
    checks = saved_guards.GlobalChecks.capture(names, {})
    assert checks.changed() == ""
    assert checks.described[0].startswith("function tcs_precompiled_model.gate ")
    assert checks.described[2] == "constant 4" and checks.described[1] == "dict of 0"
    # an equal constant is no change; a new value, a grown dict or a new function is
    monkeypatch.setattr(tiny, "LIMIT", int("4"))
    assert checks.changed() == ""
    tiny.HOOKS["x"] = 1
    assert "HOOKS" in checks.changed() and "size" in checks.changed()
    del tiny.HOOKS["x"]
    monkeypatch.setattr(tiny, "LIMIT", 5)
    assert "LIMIT" in checks.changed()
    monkeypatch.setattr(tiny, "LIMIT", 4)
    monkeypatch.setattr(tiny, "gate", lambda v: v)
    assert "gate was replaced" in checks.changed()
    # what a loading process compares: descriptions, not identities
    fresh = saved_guards.GlobalChecks(names, checks.described)
    assert "gate is now function" in fresh.matches_now({})
    monkeypatch.undo()
    monkeypatch.setattr(tiny, "HOOKS", {}, raising=False)
    monkeypatch.setattr(tiny, "LIMIT", 4, raising=False)
    assert saved_guards.GlobalChecks(names, checks.described).matches_now({}) == ""
    assert "is gone" in saved_guards.GlobalChecks(["G['no_such_name']"], ["x"]).matches_now({})


@pytest.mark.parametrize("name", ["__import__('os').system('true')", "G['x'].a; import os",
                                  "G['x'](1)", "G[x]", "G['x'].__class__ if 1 else 0", "G['x']['a' + 'b']"])
def test_guard_names_from_a_file_are_walked_never_evaluated(name, tmp_path):
    assert guard_names.parse(name) is None
    assert "unexpected guard name" in saved_guards.GlobalChecks([name], ["x"]).matches_now({})


def test_guard_names_dynamo_writes_are_understood():
    assert guard_names.parse("G['__builtins_dict___0']['len']") == (
        "__builtins_dict___0", [("item", "len")])
    assert guard_names.parse("G['torch'].nn.functional") == ("torch", [("attr", "nn"), ("attr", "functional")])
    assert guard_names.parse("G['hooks'][0].fn") == ("hooks", [("item", 0), ("attr", "fn")])
    assert guard_names.resolve(guard_names.parse("G['__builtins_dict___0']['len']"), {}) is len
    assert guard_names.resolve(guard_names.parse("G['torch'].nn.functional"), {}) is torch.nn.functional


def test_another_packs_module_in_a_guard_name_resolves(monkeypatch):
    """Dynamo names a custom node pack's module after its folder, '-' included
    (ComfyUI-GGUF's dequantisation): such a global is checked like any other, not refused."""
    import types
    mod = types.ModuleType("ComfyUI-GGUF.dequant")
    mod.dequantize = lambda t: t
    monkeypatch.setitem(sys.modules, "ComfyUI-GGUF.dequant", mod)
    name = "G['__import_ComfyUI-GGUF_dot_dequant'].dequantize"
    assert guard_names.parse(name) == ("__import_ComfyUI-GGUF_dot_dequant", [("attr", "dequantize")])
    checks = saved_guards.GlobalChecks.capture([name], {})
    assert checks.changed() == "" and checks.described[0].startswith("function ")
    monkeypatch.setattr(mod, "dequantize", lambda t: t * 2)
    assert "was replaced" in checks.changed()


def test_load_refuses_another_torch_or_region_and_never_raises(tmp_path):
    d = tmp_path / precompiled.DIRNAME
    assert saved_region.load(d, "Block-0") == (None, "")  # nothing saved
    d.mkdir()
    (d / "Block-0.bin").write_bytes(b"x")
    (d / "Block-0.json").write_text(json.dumps({"region": "Block-0", "torch": "0.0.1"}))
    region, why = saved_region.load(d, "Block-0")
    assert region is None and "another region or torch" in why
    (d / "Block-0.json").write_text(json.dumps({"region": "Block-0", "torch": torch.__version__}))
    region, why = saved_region.load(d, "Block-0")
    assert region is None and "not the one its .json was written for" in why
    bound = {"region": "Block-0", "torch": torch.__version__, "bin_sha256": hashlib.sha256(b"x").hexdigest()}
    (d / "Block-0.json").write_text(json.dumps(bound))
    region, why = saved_region.load(d, "Block-0")
    assert region is None and "names no sources" in why
    (d / "Block-0.json").write_text(json.dumps({**bound, "sources": []}))
    region, why = saved_region.load(d, "Block-0")
    assert region is None and "torch could not load it" in why
    (d / "Block-0.json").write_text("{not json")
    assert saved_region.load(d, "Block-0") == (None, "")


def test_an_enum_member_on_a_weight_is_checked_by_class_and_name():
    """ComfyUI-GGUF's weights carry ``tensor_type`` (an enum member) that dynamo guards by
    identity; ``LocalChecks`` compares the member (same class and name), across processes too."""
    import enum

    class Quant(enum.IntEnum):
        Q8_0 = 8
        Q4_K = 12

    name = "self._parameters['weight'].tensor_type"
    module = types.SimpleNamespace(_parameters={"weight": types.SimpleNamespace(tensor_type=Quant.Q8_0)})
    checks = saved_guards.LocalChecks.capture([name], module, (), {})
    fresh = saved_guards.LocalChecks(checks.names, checks.described)
    assert checks.accepts(module, (), {}) and fresh.accepts(module, (), {})
    module._parameters["weight"].tensor_type = Quant.Q4_K
    assert not checks.accepts(module, (), {}) and not fresh.accepts(module, (), {})
    module._parameters["weight"].tensor_type = 8  # equal as an int, but not the member
    assert not fresh.accepts(module, (), {})


def test_a_custom_node_module_named_by_its_path_resolves(monkeypatch):
    """ComfyUI 0.33 keys a custom node folder in sys.modules by its path, so dynamo's name for
    its module holds '/', '-', and on Windows ':' and backslashes (escaped in the name)."""
    mod = types.ModuleType("x")
    mod.dequantize = len
    key = "/srv/ComfyUI/custom_nodes/ComfyUI-GGUF.dequant"
    monkeypatch.setitem(sys.modules, key, mod)
    name = "G['__import_/srv/ComfyUI/custom_nodes/ComfyUI-GGUF_dot_dequant'].dequantize"
    assert guard_names.resolve(guard_names.parse(name), {}) is len
    monkeypatch.setitem(sys.modules, "C:\\ComfyUI\\custom_nodes\\ComfyUI-GGUF.dequant", mod)  # fake Windows
    windows = "G['__import_C:\\\\ComfyUI\\\\custom_nodes\\\\ComfyUI-GGUF_dot_dequant'].dequantize"
    assert guard_names.resolve(guard_names.parse(windows), {}) is len


def _unsaved_kinds():
    # torch's own list; empty where torch has none (2.8: the module is skipped there anyway)
    return list(aot.unsaved_guard_kinds())


@pytest.mark.parametrize("kind", _unsaved_kinds())
def test_every_guard_kind_torch_cannot_save_is_replaced_or_refused(kind):
    """The list of guard kinds torch cannot save (torch's own), each on every kind of source:
    on a global it is replaced by ``GlobalChecks``; on the call's arguments, a function's code
    guard (CLOSURE_MATCH, FUNCTION_MATCH) and an enum member's identity (ID_MATCH) are replaced
    by ``LocalChecks``; a type reached through ``type()`` is covered by the region key; anything
    else is refused, so the region never takes the fast path. None is ever kept or dropped
    silently."""
    import enum
    from torch._dynamo.types import GuardFilterEntry

    class Member(enum.Enum):
        A = 1

    def entry(name, value, is_global=False):
        return GuardFilterEntry(name=name, has_value=True, value=value, guard_type=kind,
                                derived_guard_types=(), is_global=is_global, orig_guard=None)

    cases = {"global": entry("G['x'].y", tiny.halved, True), "object": entry("kwargs['o']", object()),
             "function": entry("kwargs['f']", tiny.halved), "member": entry("args[1].t", Member.A),
             "class": entry("type(self).__mro__", (object,))}
    dropped, local_fns, unchecked = set(), set(), set()
    kept = saved_guards.keep_guard(dropped, local_fns, unchecked)(list(cases.values()))
    assert not any(kept)
    assert dropped == {"G['x'].y"}
    replaced = {"kwargs['f']"} if kind in ("CLOSURE_MATCH", "FUNCTION_MATCH") else set()
    replaced |= {"args[1].t"} if kind == "ID_MATCH" else set()
    assert local_fns == replaced
    refused = {"kwargs['o']", "kwargs['f']", "args[1].t"} - replaced
    assert {u.split(" (")[0] for u in unchecked} == refused


@pytest.mark.parametrize("kind", ["TENSOR_MATCH", "EQUALS_MATCH", "TYPE_MATCH", "DICT_CONTAINS",
                                  "LENGTH_CHECK", "DICT_KEYS_MATCH", "HASATTR", "NOT_NONE_MATCH"])
def test_guard_kinds_torch_saves_are_kept_on_arguments(kind):
    from torch._dynamo.types import GuardFilterEntry
    g = GuardFilterEntry(name="kwargs['transformer_options']['block_index']", has_value=True, value=3,
                         guard_type=kind, derived_guard_types=(), is_global=False, orig_guard=None)
    dropped, local_fns, unchecked = set(), set(), set()
    assert saved_guards.keep_guard(dropped, local_fns, unchecked)([g]) == [True]
    assert not (dropped or local_fns or unchecked)


def test_dynamos_nth_dict_key_step_is_walked_not_evaluated(monkeypatch):
    """A dict iterated in the traced code (ComfyUI-GGUF's ``dequantize_functions``) gives names
    with dynamo's N-th-key step; only the exact form over the same path is accepted."""
    mod = types.ModuleType("pack.dequant")
    mod.table = {"a": len, "b": abs}
    monkeypatch.setitem(sys.modules, "pack.dequant", mod)
    base = "G['__import_pack_dot_dequant'].table"
    name = f"{base}[list(dict.keys({base}))[1]]"
    assert guard_names.resolve(guard_names.parse(name), {}) is abs
    assert guard_names.resolve(guard_names.parse(f"list(dict.keys({base}))[1]"), {}) == "b"
    assert guard_names.parse(f"list(dict.keys({base}))[1]; x") is None
    for bad in (f"{base}[list(dict.keys(G['os']))[1]]", f"{base}[list(dict.keys({base}))[1]]()",
                f"{base}[list(dict.keys({base}) + [1])[1]]"):
        assert guard_names.parse(bad) is None, bad


# ------------------------------------------------------ GGUF: a tensor subclass's attributes

@pytest.fixture
def quant_class_attr(monkeypatch):
    """Restores QuantLinear.dequant_dtype (a test sets it on the class, as a loader node does)."""
    monkeypatch.setattr(tiny.QuantLinear, "dequant_dtype", None)
    grad = torch.is_grad_enabled()
    yield monkeypatch
    torch.set_grad_enabled(grad)


@pytest.mark.slow
def test_a_quantized_tensor_subclass_region_loads_back_with_all_its_checks(tmp_path, quant_class_attr):
    """A GGUF-like weight (``QuantTensor``: quantization in instance attributes, a LoRA in
    ``patches``) saved and loaded back: torch used to rebuild its guards' example tensor
    without the attributes (``'FakeTensor' object has no attribute 'patches'``). Loaded, it
    runs equal to eager, and every change eager would follow sends the call elsewhere: a LoRA
    patch, another ``tensor_shape`` or ``tensor_type``, another ``dequant_dtype`` on the class."""
    model, x = tiny.build_quant(), torch.randn(3, 32)
    torch.set_grad_enabled(False)  # (torch's saved guards pin grad mode; the fixture restores it)
    region = saved_region.capture(model, (x,), {}, {"backend": "inductor"})
    saved_region.save(region, tmp_path, "q")
    back, why = saved_region.load(tmp_path, "q")
    assert back is not None and why == "", why
    assert back.accepts(model, (x,), {})
    assert torch.allclose(back.fn.fn(model, x), model(x), rtol=1e-4, atol=1e-5)
    w = model[0].weight
    changes = [("patches", [torch.ones(32, 32)]), ("tensor_shape", torch.Size([16, 64])),
               ("tensor_type", tiny.Kind.Q4)]
    for attr, value in changes:
        before = getattr(w, attr)
        setattr(w, attr, value)
        assert not back.accepts(model, (x,), {}), attr
        why = back.rejection(model, (x,), {})  # what the log says when it traces another
        assert (attr if attr != "tensor_type" else "enum member") in why, why
        setattr(w, attr, before)
    assert back.accepts(model, (x,), {})
    quant_class_attr.setattr(tiny.QuantLinear, "dequant_dtype", torch.float64)
    assert not back.accepts(model, (x,), {})


class _Sub(tiny.QuantLinear):
    pass


def test_class_constants_are_checked_as_the_class_resolves_them(quant_class_attr):
    """dynamo's guard on a class constant (``dict(type(x).__mro__[N].__dict__)[k]``, which torch
    cannot rebuild) is replaced by ``LocalChecks`` on the value the class resolves now: the
    loader node setting the same value on the subclass passes, another value fails."""
    module = types.SimpleNamespace(_modules={"0": _Sub(torch.zeros(2, 2))})
    name = "dict(type(self._modules['0']).__mro__[1].__dict__)['dequant_dtype']"
    assert guard_names.parse_local(name) == ("self", [("attr", "_modules"), ("item", "0"),
                                                       ("class_attr", "dequant_dtype")])
    checks = saved_guards.LocalChecks.capture([name], module, (), {})
    fresh = saved_guards.LocalChecks(checks.names, checks.described)
    assert checks.described == ["constant None"] and fresh.accepts(module, (), {})
    quant_class_attr.setattr(_Sub, "dequant_dtype", None, raising=False)
    assert fresh.accepts(module, (), {})
    quant_class_attr.setattr(_Sub, "dequant_dtype", torch.float16)
    assert not fresh.accepts(module, (), {}) and not checks.accepts(module, (), {})
    f16 = saved_guards.LocalChecks.capture([name], module, (), {})
    assert f16.described == ["dtype torch.float16"] and f16.accepts(module, (), {})
    quant_class_attr.setattr(_Sub, "dequant_dtype", torch.bfloat16)
    assert not saved_guards.LocalChecks(f16.names, f16.described).accepts(module, (), {})


@pytest.mark.parametrize("name", [
    "dict(type(self._modules['a']).__dict__)['dequant_dtype']",
    "dict(type(self._modules['a']).__mro__[2].__dict__)['cast'].__defaults__[1]",
    "dict(type(self._modules['a']).__mro__[1].__dict__)['f'].__kwdefaults__['bias']"])
def test_class_constant_names_parse(name):
    parsed = guard_names.parse_local(name)
    assert parsed and parsed[0] == "self" and ("class_attr", name.split("['")[2].split("'")[0]) in parsed[1]


@pytest.mark.parametrize("name", [
    "dict(type(__import__('os')).__dict__)['x']", "dict(type(self).__dict__)['x'](1)",
    "dict(type(self._modules['a']).__mro__[1].__dict__)[x]", "dict(type(G['x']).__dict__)['y']",
    "dict(type(self).__mro__[1].__dict__)['x']; import os"])
def test_class_constant_names_from_a_file_are_walked_never_evaluated(name):
    assert guard_names.parse_local(name) is None
    assert not saved_guards.LocalChecks([name], ["constant None"]).accepts(None, (), {})


def test_guards_on_class_constants_are_checked_not_dropped():
    """CONSTANT_MATCH / EQUALS_MATCH reached through ``type()`` used to count as covered by the
    region key; but a loader node changes such a constant (ComfyUI-GGUF's ``dequant_dtype``).
    A constant goes to ``LocalChecks``; anything else there is refused; the class's other
    guards (``DICT_NOT_CONTAINS``, ``ID_MATCH``) stay covered by the region key."""
    from torch._dynamo.types import GuardFilterEntry

    def entry(name, kind, value):
        return GuardFilterEntry(name=name, has_value=True, value=value, guard_type=kind,
                                derived_guard_types=(), is_global=False, orig_guard=None)

    base = "dict(type(self._modules['q']).__mro__[1].__dict__)"
    entries = [entry(f"{base}['dequant_dtype']", "CONSTANT_MATCH", None),
               entry(f"{base}['patch_dtype']", "EQUALS_MATCH", torch.float16),
               entry(f"{base}['table']", "EQUALS_MATCH", [1, 2]),
               entry(base, "DICT_NOT_CONTAINS", {}),
               entry("type(self._modules['q']).__mro__", "ID_MATCH", (object,))]
    dropped, local_fns, unchecked = set(), set(), set()
    assert saved_guards.keep_guard(dropped, local_fns, unchecked)(entries) == [False] * 5
    assert local_fns == {f"{base}['dequant_dtype']", f"{base}['patch_dtype']"} and not dropped
    assert unchecked == {f"{base}['table'] (EQUALS_MATCH)"}


def test_a_tensor_subclass_is_reduced_with_its_attributes():
    """The reduction torch's guard pickler gives a guarded tensor is kept for plain tensors and
    parameters; a subclass with instance attributes gets them back after torch rebuilds it,
    through torch's own ``_set_obj_state`` (no function of the pack is named in the file)."""
    from torch._dynamo.guards import GuardsStatePickler
    from torch._utils import _set_obj_state
    w = tiny.build_quant()[0].weight
    torch_reduction = (GuardsStatePickler._unpickle_tensor, ("args",))
    for plain in (torch.zeros(2), nn.Parameter(torch.zeros(2))):
        assert guard_pickling.reduce_tensor_attributes(plain, torch_reduction) is torch_reduction
    missing = (object, ("tensor guard tree",))  # torch's _Missing: not guarded, not rebuilt
    assert guard_pickling.reduce_tensor_attributes(w, missing) is missing
    fn, (inner, state) = guard_pickling.reduce_tensor_attributes(w, torch_reduction)
    assert fn is _set_obj_state and inner.reduction is torch_reduction
    assert state["tensor_type"] is tiny.Kind.Q8 and state["tensor_shape"] == (32, 32) and state["patches"] == []


QUANT_CHILD = textwrap.dedent("""
    import sys
    sys.path[:0] = [{root!r}, {tests!r}]
    from pathlib import Path
    import torch
    import tcs_precompiled_model as tiny
    from compile_core.cache import saved_region
    torch.set_grad_enabled(False)
    model, x, d = tiny.build_quant(), torch.randn(3, 32), Path({dir!r})
    if {save!r}:
        saved_region.save(saved_region.capture(model, (x,), {{}}, {{"backend": "inductor"}}), d, "q")
    region, why = saved_region.load(d, "q")
    ok = region is not None and region.accepts(model, (x,), {{}})
    print("RESULT", ok, why, ok and bool(torch.allclose(region.fn.fn(model, x), model(x), rtol=1e-4, atol=1e-5)))
""")


@pytest.mark.slow
def test_a_quantized_region_loads_in_another_process(tmp_path):
    """dynamo names a global after the tensor subclass's id in the tracing process
    (``__subclass_QuantTensor_<id>_c<N>``); the saved region records the class, and a new
    process binds it again (GGUF's ``GGMLTensor``)."""
    for save in (True, False):
        code = QUANT_CHILD.format(root=str(ROOT), tests=str(ROOT / "tests" / "unit"), dir=str(tmp_path),
                                  save=save)
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "RESULT True  True" in proc.stdout, (save, proc.stdout[-2000:])
    meta = json.loads((tmp_path / "q.json").read_text())
    assert list(meta["subclasses"].values()) == ["tcs_precompiled_model:QuantTensor"], meta


def test_a_tensor_subclass_global_is_bound_by_module_and_name():
    saved = {"__subclass_QuantTensor_1_c1": "tcs_precompiled_model:QuantTensor"}
    assert guard_names.bind_subclasses(saved) == {"__subclass_QuantTensor_1_c1": tiny.QuantTensor}
    for bad in ("tcs_precompiled_model:QuantLinear", "no_such_module:QuantTensor", "tcs_precompiled_model:x"):
        with pytest.raises(Exception):
            guard_names.bind_subclasses({"__subclass_x_1_c1": bad})
