"""compile_core.torch_support.torch_compat: every feature the pack uses is tried on this torch (2.13 here),
once, lazily, without leaving a trace; and what the pack does when a probe says no.

Tests named ``*_simulated_*`` monkeypatch a probe's answer to stand for an older torch."""
from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch._dynamo.config as dynamo_config

from compile_core.run import compiled_call, engine
from compile_core.torch_support import inductor_names, scoped
from compile_core.cache import precompiled
from compile_core.plan import knobs, preflight, shapes
from compile_core.torch_support import aot, probing, scoped, torch_compat as tc, weight_fetch
from compile_core.plan.settings import CompileSettings, build_compile_args

from tcs_engine_helpers import eager, run, settings

REPO_ROOT = Path(__file__).resolve().parents[2]
PROBES = [tc.compile_works, tc.isolate_recompiles, tc.recompile_limit_kwarg, tc.recompile_limit_knob,
          tc.guard_filter_fn, aot.aot_compile_knobs, aot.load_compiled_function,
          tc.backed_size_oblivious_safe, aot.cache_artifacts,
          weight_fetch.opaque_weight_fetch]


# ----------------------------------------------------------------- this torch

_ALL = {"compile": True, "isolate_recompiles": True, "recompile_limit_kwarg": True,
        "recompile_limit_knob": "recompile_limit", "guard_filter_fn": True,
        "aot_compile": True, "aot_compile_needs_enable_aot_compile": False,
        "load_compiled_function": True, "backed_size_oblivious_safe": True,
        "cache_artifacts": True, "opaque_weight_fetch": True}
_OLD = {**_ALL, "isolate_recompiles": False, "recompile_limit_kwarg": False, "opaque_weight_fetch": False,
        "aot_compile_needs_enable_aot_compile": True, "load_compiled_function": False,
        "backed_size_oblivious_safe": False}
# What the probes answered, per torch they were run on (docs/how-it-works.md: torch versions).
MEASURED = {(2, 8): {**_OLD, "aot_compile": False, "aot_compile_needs_enable_aot_compile": False},
            (2, 9): _OLD, (2, 13): _ALL, (2, 14): _ALL, (2, 15): _ALL,
            (2, 11): {**_ALL, "isolate_recompiles": False, "recompile_limit_kwarg": False,
                      "aot_compile_needs_enable_aot_compile": True, "opaque_weight_fetch": False}}


def test_this_torch_is_supported():
    assert tc.MIN_VERSION <= probing.version() <= tc.NEWEST_TESTED
    assert tc.unsupported() == ""


def test_probe_results_are_those_measured_for_this_torch():
    expected = MEASURED.get(probing.version())
    if expected is None:
        pytest.skip(f"no probe results recorded for torch {torch.__version__}")
    assert tc.features() == expected


def test_auto_fx_knobs_follow_the_backed_size_oblivious_probe():
    expected = {"use_duck_shape": False}
    if tc.backed_size_oblivious_safe():
        expected["backed_size_oblivious"] = True
    assert tc.auto_fx_knobs() == expected
    assert shapes.fx_knobs("auto") == expected
    assert shapes.fx_knobs("static") == {} and shapes.fx_knobs("dynamic") == {}


@pytest.mark.parametrize("probe", PROBES, ids=lambda p: p.__name__)
def test_a_probe_leaves_no_trace(probe, graph_count):
    """Run uncached: no graph counted, no compilation record, no config or env change (the
    autouse fixture checks those)."""
    from torch._dynamo.utils import get_compilation_metrics
    g0, records = graph_count(), len(get_compilation_metrics())
    probe.__wrapped__()
    assert graph_count() == g0
    assert len(get_compilation_metrics()) == records


def test_probes_are_cached_per_process():
    first = tc.isolate_recompiles()
    hits = tc.isolate_recompiles.cache_info().hits
    assert tc.isolate_recompiles() is first
    assert tc.isolate_recompiles.cache_info().hits == hits + 1


@pytest.mark.skipif("isolate_recompiles" not in inspect.signature(torch.compile).parameters,
                    reason="torch.compile has no isolate_recompiles parameter on this torch")
def test_isolate_probe_tells_isolated_from_shared_budgets():
    """The probe's mechanism on this torch: without isolation the second compile of the same
    code is a recompile past a limit of 1 (no graph); with it, both compile."""
    def second_compile_graphs(isolate):
        fn, x = probing._fresh(probing._sin2), torch.randn(3)
        a, b = probing._Counter(), probing._Counter()
        with probing._traceless(), dynamo_config.patch(recompile_limit=1):
            torch.compile(fn, backend=a, isolate_recompiles=isolate)(x)
            torch.compile(fn, backend=b, isolate_recompiles=isolate)(x)
        return a.graphs, b.graphs
    assert second_compile_graphs(False) == (1, 0)
    assert second_compile_graphs(True) == (1, 1)


def test_wan_modulation_probe_compiles_one_graph_for_two_token_counts():
    """What ``backed_size_oblivious_safe`` checks, run here with its counter visible (torch 2.8
    and 2.9 fail it with "Attempting to broadcast a dimension of length s..")."""
    if not tc.backed_size_oblivious_safe():
        # scoped: torch 2.9 sets TORCHINDUCTOR_CACHE_DIR while reporting the error
        with scoped.scoped_state(), pytest.raises(torch._dynamo.exc.TorchRuntimeError, match="broadcast"):
            _wan_modulation_graphs()
        return
    assert _wan_modulation_graphs() == 1


def _wan_modulation_graphs() -> int:
    import torch.fx.experimental._config as fx_config
    c = probing._Counter()
    compiled = torch.compile(probing._fresh(tc._wan_modulation), backend=c)
    mod = torch.randn(1, 6, 8)
    with probing._traceless(), fx_config.patch(use_duck_shape=False, backed_size_oblivious=True):
        for tokens in (4, 6):
            x, e = torch.randn(1, tokens, 8), torch.randn(1, 1, 6, 8)
            for t in (x, e):
                torch._dynamo.maybe_mark_dynamic(t, 0)
                torch._dynamo.maybe_mark_dynamic(t, 1)
            torch.testing.assert_close(compiled(x, e, mod), tc._wan_modulation(x, e, mod))
    return c.graphs


def test_probes_do_not_run_at_import_of_the_pack():
    code = ("import compile_core.run.engine, compile_core.plan.preflight, compile_core.torch_support.scoped, "
            "compile_core.plan.shapes, compile_core.cache.precompiled, compile_core.diagnose.graph_breaks\n"
            "from compile_core.torch_support import aot, torch_compat as tc\n"
            "print(sum(p.cache_info().currsize for p in (tc.unsupported, tc.compile_works, "
            "tc.isolate_recompiles, tc.backed_size_oblivious_safe, aot.load_compiled_function)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0"


def test_preflight_torch_features_delegate_to_the_probes():
    feats = preflight.torch_features()
    assert feats["isolate_recompiles"] is tc.isolate_recompiles()
    assert feats["backed_size_oblivious_safe"] is tc.backed_size_oblivious_safe()
    assert feats["load_compiled_function"] is aot.load_compiled_function()


@pytest.mark.skipif("enable_aot_compile" not in dynamo_config.get_config_copy(),
                    reason="this torch has no enable_aot_compile knob (2.8)")
def test_aot_capture_applies_the_knobs_this_torch_needs(monkeypatch):
    monkeypatch.setattr(aot, "aot_compile_knobs", lambda: {"enable_aot_compile": True})
    before = dynamo_config.enable_aot_compile
    with aot.aot_capture():
        assert dynamo_config.enable_aot_compile is True
    assert dynamo_config.enable_aot_compile == before


# ------------------------------------------------- older torch, simulated by the probe result

def test_unsupported_below_2_8_simulated(monkeypatch):
    monkeypatch.setattr(probing, "version", lambda: (2, 7))
    why = tc.unsupported.__wrapped__()
    assert "older than 2.8" in why and "eager" in why


def test_model_stays_eager_with_one_warning_when_torch_unsupported_simulated(
        monkeypatch, wan, wan_inputs, graph_count, pack_log):
    monkeypatch.setattr(tc, "unsupported", lambda: "torch 2.7 is older than 2.8; stays eager")
    monkeypatch.setattr("compile_core.report.log._said", set())
    model = wan.Model(n_blocks=2).eval()
    x, t = wan_inputs()
    cm = engine.prepare(model, settings())
    assert cm.entry.failed and not cm.reused
    g0 = graph_count()
    torch.testing.assert_close(run(cm, model, x, t), eager(model, x, t))
    assert graph_count() == g0
    assert any("stays eager (torch 2.7" in m for m in pack_log.infos())
    assert not any("reusing compiled" in m for m in pack_log.infos())


def test_without_backed_size_oblivious_simulated_wan_still_serves_new_sizes(
        monkeypatch, wan, wan_inputs, graph_count):
    """torch 2.8/2.9: the knob is left off; a new token count still adds no graph, and a batch
    of 1 first costs at most one recompile at the first batch of 2."""
    monkeypatch.setattr(tc, "backed_size_oblivious_safe", lambda: False)
    assert shapes.fx_knobs("auto") == {"use_duck_shape": False}
    model = wan.Model(n_blocks=3).eval()
    cm = engine.prepare(model, settings(shape_policy="auto", dynamic=False))
    g0 = graph_count()
    for batch, tokens in [(1, 6), (1, 10), (2, 10), (3, 14), (1, 5)]:
        x, t = wan_inputs(batch=batch, tokens=tokens)
        torch.testing.assert_close(run(cm, model, x, t), eager(model, x, t))
        if (batch, tokens) == (1, 10):
            assert graph_count() - g0 == 1  # a second token count: no new graph
    assert 1 <= graph_count() - g0 <= 2  # the batch of 2 may recompile once, never more


def test_without_isolate_recompiles_simulated_the_log_says_budgets_are_shared(monkeypatch, pack_log):
    monkeypatch.setattr(tc, "isolate_recompiles", lambda: False)
    monkeypatch.setattr("compile_core.report.log._said", set())
    seen = {}
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.update(kw) or fn)
    compiled_call.make_compiled_call(settings())
    assert "isolate_recompiles" not in seen
    assert seen.get("recompile_limit") == (64 if tc.recompile_limit_kwarg() else None)
    assert any("shares dynamo's cache and one recompile budget" in m for m in pack_log.all_infos())


def test_without_saved_regions_simulated_the_log_says_why_once(monkeypatch, pack_log, wan, tmp_path):
    from compile_core.cache.persist import PersistentCache
    monkeypatch.setattr(aot, "load_compiled_function", lambda: False)
    monkeypatch.setattr("compile_core.report.log._said", set())
    model = wan.Model(n_blocks=2).eval()
    cm = engine.prepare(model, settings(backend="inductor"), persistent=PersistentCache(tmp_path))
    assert cm.state.precompiled() is None and cm.state.precompiled() is None
    notes = [m for m in pack_log.all_infos() if "cannot save and load a compiled function" in m]
    assert len(notes) == 1 and "persistent FX-graph cache" in notes[0], pack_log.all_infos()


def test_without_recompile_limit_kwarg_simulated_the_config_knob_carries_the_limit(monkeypatch):
    monkeypatch.setattr(tc, "recompile_limit_kwarg", lambda: False)
    monkeypatch.setattr(tc, "recompile_limit_knob", lambda: "cache_size_limit")
    seen = {}
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.update(kw) or fn)
    s = settings(dynamo_cache_size_limit=5)
    compiled_call.make_compiled_call(s)
    assert "recompile_limit" not in seen
    dynamo = knobs.knobs_for(s, on_cuda=False)["dynamo"]
    assert dynamo["cache_size_limit"] == 5 and "recompile_limit" not in dynamo


def test_saved_regions_off_when_aot_compile_does_not_work_simulated(monkeypatch):
    s = CompileSettings.from_args(build_compile_args(backend="inductor", mode="default", background_compile=False))
    monkeypatch.setattr(aot, "load_compiled_function", lambda: True)
    assert precompiled.supported(s, regional=True) is tc.guard_filter_fn() is True
    monkeypatch.setattr(aot, "load_compiled_function", lambda: False)
    assert precompiled.supported(s, regional=True) is False


def test_reuse_off_compiles_afresh_without_isolate_recompiles_simulated(
        monkeypatch, wan, wan_inputs, graph_count):
    """torch 2.8-2.10: an equal backend would reuse the first compile's graphs; the compile of a
    reuse_if_similar-off Apply gets a backend equal only to itself, so it really compiles."""
    monkeypatch.setattr(tc, "isolate_recompiles", lambda: False)
    x, t = wan_inputs()
    a = wan.Model(n_blocks=3).eval()
    cm_a = engine.prepare(a, settings())
    run(cm_a, a, x, t)
    b = wan.Model(n_blocks=3).eval()
    cm_b = engine.prepare(b, settings(reuse_if_similar=False))
    g0 = graph_count()
    torch.testing.assert_close(run(cm_b, b, x, t), eager(b, x, t))
    assert graph_count() - g0 == 1
    g1 = graph_count()
    run(cm_a, a, x, t)
    run(cm_b, b, x, t)
    assert graph_count() == g1  # each compile keeps using its own graphs


def test_own_backend_only_for_reuse_off_without_isolation_simulated(monkeypatch):
    monkeypatch.setattr(tc, "isolate_recompiles", lambda: False)
    seen = {}
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.update(kw) or fn)
    with scoped.scoped_state():  # torch 2.8's inductor sets TORCHINDUCTOR_CACHE_DIR when it loads
        _own_backend_only_for_reuse_off(seen)


def _own_backend_only_for_reuse_off(seen):
    compiled_call.make_compiled_call(settings(backend="inductor", mode="max-autotune-no-cudagraphs"))
    assert seen["backend"] == "inductor" and seen["mode"] == "max-autotune-no-cudagraphs"
    seen.clear()
    compiled_call.make_compiled_call(settings(backend="inductor", mode="max-autotune-no-cudagraphs",
                                       reuse_if_similar=False))
    own = seen["backend"]
    assert isinstance(own, inductor_names.OwnBackend) and "mode" not in seen
    assert own.inner.config.get("max_autotune") is True  # the mode lives in the inner backend
    assert own != inductor_names.OwnBackend("inductor", "max-autotune-no-cudagraphs", seen["dynamic"])


def test_a_probe_on_another_thread_keeps_a_concurrent_compiles_counts():
    """The start-up warm-up probes on a thread of its own while a prompt may compile (core's
    TorchCompileModel): the probe puts dynamo's counters back afterwards, and a graph compiled
    meanwhile on another thread must still be counted (the probe holds dynamo's compile lock,
    so that compile waits for it)."""
    import threading
    import time
    from torch._dynamo.utils import counters
    inside = threading.Event()

    def slow_probe():
        inside.set()
        time.sleep(0.5)  # the main thread's compile starts meanwhile
        return True

    before = counters["stats"]["unique_graphs"]
    t = threading.Thread(target=probing._probe, args=(slow_probe,))
    t.start()
    assert inside.wait(30)

    def fresh(x):
        return x.cos() + 3

    torch.compile(fresh, backend="eager")(torch.randn(4))
    t.join()
    assert counters["stats"]["unique_graphs"] == before + 1
