"""compile_core.cache.prewarm: what a compile imported and indexed is recorded, filtered and replayed.

Replaying changes ``sys.modules`` for good, so the replay tests run in a child process.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time
import types
from pathlib import Path

import pytest
import torch

from compile_core.run import engine
from compile_core.cache import prewarm
from compile_core.cache.persist import PersistentCache
from compile_core.plan.settings import CompileSettings, build_compile_args

REPO = Path(__file__).resolve().parents[2]


def _child(code: str, env_extra: dict | None = None) -> dict:
    import os
    env = {**os.environ, **(env_extra or {})}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_record_keeps_only_compiler_modules_in_import_order_and_merges(tmp_path):
    prewarm.record(tmp_path, ["torch._inductor.compile_fx", "os", "comfy.ops", "sympy.core",
                              "torch.x;import os", "triton.language"], ["/a.py"],
                   "/c/fp/inductor")
    prewarm.record(tmp_path, ["sympy.core", "mpmath.libmp"], ["/a.py", "/b.py"])
    m = prewarm.read_manifest(tmp_path)
    assert m["modules"] == ["torch._inductor.compile_fx", "sympy.core", "triton.language",
                            "mpmath.libmp"]
    assert m["files"] == ["/a.py", "/b.py"]
    assert m["isa_dir"] == "/c/fp/inductor"  # kept until a later CPU compile records its own


def test_a_tampered_manifest_names_no_other_module(tmp_path):
    (tmp_path / prewarm.MANIFEST).write_text(json.dumps(
        {"modules": ["antigravity", "torch.nn", "../../x", 3], "files": [1, "/ok.py"],
         "fingerprints": ["../../etc", "ab" * 12, "AB" * 12, 7]}))
    m = prewarm.read_manifest(tmp_path)
    assert m == {"modules": ["torch.nn"], "files": ["/ok.py"], "isa_dir": None,
                 "fingerprints": ["ab" * 12]}  # fingerprints become directory names
    (tmp_path / prewarm.MANIFEST).write_text("not json")
    assert prewarm.read_manifest(tmp_path) == {}
    assert prewarm.clean({}) == {} and prewarm.clean(None) == {}  # nothing to replay: no thread


def test_generated_graph_modules_are_not_recorded(tmp_path):
    rec = prewarm.ImportRecorder()
    fake = types.ModuleType("torch._tcs_fake_generated_abc123")  # like a compiled graph's module
    fake.__file__ = str(tmp_path / "abc123.py")
    sys.modules[fake.__name__] = fake
    try:
        assert fake.__name__ not in rec.new()
        assert not prewarm.installed_module(fake.__name__)
        assert prewarm.installed_module("torch.nn.functional")
    finally:
        del sys.modules[fake.__name__]


def test_first_compile_records_the_traced_source_files(tmp_path, wan, wan_inputs):
    cache = PersistentCache(tmp_path / "cache")
    model = wan.Model(n_blocks=2).eval()
    x, t = wan_inputs()
    settings = CompileSettings.from_args(build_compile_args(backend="aot_eager", mode="default",
                                                           background_compile=False))
    compiled = engine.prepare(model, settings, persistent=cache)
    with torch.no_grad():
        compiled.run(model, lambda: model(x, t), torch.device("cpu"))
    assert compiled.entry.graphs >= 1
    m = prewarm.read_manifest(cache.root)
    assert any(f.endswith("tcs_toy_models.py") for f in m["files"]), m
    assert m["fingerprints"] == [compiled.fingerprint]  # what a new fleet worker prefetches


def test_replay_imports_and_indexes_and_skips_what_is_gone(tmp_path):
    functional = str(Path(torch.__file__).parent / "nn" / "functional.py")
    (tmp_path / prewarm.MANIFEST).write_text(json.dumps({
        "modules": ["torch._inductor.compile_fx", "torch._no_such_module", "antigravity"],
        "files": [functional, str(tmp_path / "gone.py")]}))
    got = _child(f"""
        import json, sys
        from compile_core.cache import prewarm
        from torch._dynamo import funcname_cache
        before = "torch._inductor.compile_fx" in sys.modules
        report = prewarm.warm(prewarm.read_manifest({str(tmp_path)!r}))
        print(json.dumps({{"before": before, "after": "torch._inductor.compile_fx" in sys.modules,
                          "antigravity": "antigravity" in sys.modules, "report": report,
                          "indexed": sorted(funcname_cache.cache)}}))
    """)
    assert not got["before"] and got["after"]
    assert not got["antigravity"]
    assert got["report"]["imported"] == 1 and got["report"]["indexed"] == 1
    assert got["indexed"] == [functional]


@pytest.mark.parametrize("where,replayed", [("with", True), ("without", False), (None, False)])
def test_one_warm_up_per_process_warms_the_base_and_replays_a_manifest_if_there_is_one(
        tmp_path, where, replayed):
    """Every server warms torch's compile entry (with dynamo's index of the torch.nn sources, and
    the imports of a first C++ build and sympy simplification) and the pack's feature probes
    (what any first compile pays); one that compiled before also replays its manifest. Off:
    nothing at all."""
    for d in ("with", "without"):
        (tmp_path / d).mkdir()
    (tmp_path / "with" / prewarm.MANIFEST).write_text(json.dumps(
        {"modules": ["torch.utils.show_pickle"], "files": []}))  # a module the base never imports
    root = repr(str(tmp_path / where)) if where else "None"
    code = f"""
        import json, sys
        from compile_core.cache import prewarm
        from compile_core.torch_support import torch_compat
        started = [prewarm.start({root}), prewarm.start({root})]
        prewarm.wait(finish=True)
        import torch.nn.functional
        from torch._dynamo import funcname_cache
        print(json.dumps({{"started": started, "entry": "torch._inductor.compile_fx" in sys.modules,
                          "probed": torch_compat.compile_works.cache_info().currsize == 1,
                          "indexed": torch.nn.functional.__file__ in funcname_cache.cache,
                          "replayed": "torch.utils.show_pickle" in sys.modules,
                          "first_build": {{"torch.utils.cpp_extension", "sympy.physics.units"}} <= set(sys.modules)}}))
    """
    from compile_core.torch_support import compile_threads  # torch 2.11.0: the first compile probes, on its thread
    assert _child(code) == {"started": [True, False], "entry": True,  # once per process
                            "probed": compile_threads.after_a_thread_ends(), "indexed": True,
                            "replayed": replayed, "first_build": True}
    assert _child(code, {prewarm.ENV: "0"}) == {"started": [False, False], "entry": False,
                                                "probed": False, "indexed": False, "replayed": False,
                                                "first_build": False}


def test_start_up_objects_are_frozen_while_quiet_and_what_comes_later_is_still_collected():
    """In a child process (a freeze is for the process's life): with ``quiet`` true the objects
    alive after the warm-up leave the collector's reach, so a full collection walks far fewer;
    a model made later, in a reference cycle, is still collected when it is dropped. With
    ``quiet`` false (a model is loaded) nothing is frozen."""
    code = """
        import gc, json, time, weakref
        import torch
        from compile_core.cache import prewarm

        def full_collection_objects():
            return len(gc.get_objects())
        before = full_collection_objects()
        prewarm.start(None, quiet=lambda: QUIET)
        prewarm.wait(finish=True)
        frozen, after = gc.get_freeze_count(), full_collection_objects()

        class Model(torch.nn.Module):  # a model with a cycle, as a patcher and its wrappers make
            def __init__(self):
                super().__init__()
                self.lin = torch.nn.Linear(4, 4)
                self.me = self
        model = Model()
        gone = weakref.ref(model)
        del model
        gc.collect()
        print(json.dumps({"frozen": frozen, "before": before, "after": after,
                          "model_collected": gone() is None}))
    """
    quiet = _child(code.replace("QUIET", "True"))
    assert quiet["frozen"] > 100_000 and quiet["after"] < quiet["before"] / 5, quiet
    assert quiet["model_collected"]
    loaded = _child(code.replace("QUIET", "False"))
    assert loaded["frozen"] == 0 and loaded["model_collected"], loaded


def test_the_start_up_probes_come_first_and_a_prompt_waits_for_them(monkeypatch, tmp_path):
    """The probes compile on the warm-up thread and nothing may run compiled code beside them
    (a deadlock of dynamo's compile lock and logging's lock; see prewarm). FAKE probes
    (``torch_compat.features`` replaced) that run until the test lets them end: the wait a
    prompt makes (``probes_done``) returns only after them, and the rest of the warm-up (the
    fleet's manifest, torch's compile entry) starts only after them."""
    import threading
    from compile_core.torch_support import compile_threads, torch_compat
    if not compile_threads.after_a_thread_ends():
        pytest.skip(f"torch {torch_compat.torch.__version__} probes with the first compile (test_compile_threads)")
    order, release = [], threading.Event()

    def fake_probes():
        order.append("probes")
        release.wait(30)
        order.append("probes over")
    monkeypatch.setattr(torch_compat, "features", fake_probes)
    for name, value in (("_thread", None), ("_probed", threading.Event()), ("_stop", threading.Event())):
        monkeypatch.setattr(prewarm, name, value)
    assert prewarm.probes_done(0) is True  # no warm-up: a prompt never waits
    assert prewarm.start(tmp_path, lambda: order.append("fleet manifest") or None)
    assert prewarm.probes_done(0.3) is False and order == ["probes"]  # still probing: it waits
    release.set()
    assert prewarm.probes_done(10) is True
    prewarm.wait(finish=True)
    assert order == ["probes", "probes over", "fleet manifest"]


def test_a_new_fleet_worker_warms_from_the_shared_manifest_and_keeps_it(tmp_path):
    got = _child(f"""
        import json, sys
        from compile_core.cache import prewarm
        shared = lambda: {{"modules": ["torch._inductor.compile_fx", "antigravity"], "files": []}}
        started = prewarm.start({str(tmp_path)!r}, shared)
        prewarm.wait(finish=True)
        print(json.dumps({{"started": started, "imported": "torch._inductor.compile_fx" in sys.modules,
                          "antigravity": "antigravity" in sys.modules,
                          "kept": prewarm.read_manifest({str(tmp_path)!r})}}))
    """)
    assert got["started"] and got["imported"] and not got["antigravity"]
    assert got["kept"]["modules"] == ["torch._inductor.compile_fx"]  # the next restart needs no store


def test_cpu_isa_probe_runs_in_the_recorded_dir_only_when_it_exists(tmp_path):
    root = tmp_path / "cache"
    isa_dir = root / "fp1" / "inductor"
    code = """
        import json, os
        from torch._inductor.cpu_vec_isa import valid_vec_isa_list
        from compile_core.cache import prewarm
        before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        used = prewarm.warm_cpu_isa(%r)
        print(json.dumps({"used": used, "cached": valid_vec_isa_list.cache_info().currsize,
                          "env_restored": os.environ.get("TORCHINDUCTOR_CACHE_DIR") == before}))
    """
    assert _child(code % str(isa_dir)) == {"used": False, "cached": 0, "env_restored": True}
    isa_dir.mkdir(parents=True)
    got = _child(code % str(isa_dir), {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "default")})
    assert got == {"used": True, "cached": 1, "env_restored": True}
    assert any(isa_dir.rglob("*.so")), "the probe builds went to the recorded dir"
    # a damaged probe .so there (a crash while saving, a full disk) is never probed against
    next(isa_dir.rglob("*.so")).write_bytes(b"\x7fELF garbage")
    assert _child(code % str(isa_dir)) == {"used": False, "cached": 0, "env_restored": True}
    assert not (tmp_path / "default").exists() or not any((tmp_path / "default").rglob("*.so"))


def test_parallel_isa_probe_gives_torchs_own_answer(tmp_path):
    """Same ISA list and build flags as torch's sequential probe (each in a fresh process and
    an empty inductor cache dir, so both really build and load their probes)."""
    code = """
        import json, sys
        from torch._inductor import cpu_vec_isa
        from compile_core.torch_support import cpu_isa
        settled = cpu_isa.probe() if sys.argv[-1] == "parallel" else None
        isas = cpu_vec_isa.valid_vec_isa_list()
        print(json.dumps({"settled": settled, "isa": [str(i) for i in isas],
                          "flags": [i.build_arch_flags() for i in isas],
                          "picked": str(cpu_vec_isa.pick_vec_isa())}))
    """
    import os
    got = {}
    for mode in ("sequential", "parallel"):
        out = subprocess.run([sys.executable, "-c", textwrap.dedent(code), mode], cwd=REPO,
                             env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / mode)},
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        got[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    if got["parallel"]["settled"] is False:
        assert sys.platform != "linux" or os.uname().machine != "x86_64"
    assert {k: v for k, v in got["parallel"].items() if k != "settled"} == \
           {k: v for k, v in got["sequential"].items() if k != "settled"}


def test_with_a_step_runner_the_isa_probe_checks_one_isa_at_a_time_through_it():
    """FAKE ISAs (each stands for torch's check of one ISA: a C++ build and a child process
    that loads it), in a child process whose torch has probed nothing yet."""
    if sys.platform != "linux" or __import__("platform").machine() != "x86_64":
        pytest.skip("torch's ISA probe is a plain list here (nothing to settle)")
    got = _child("""
        import json, threading
        from torch._inductor import cpu_vec_isa as v
        from compile_core.torch_support import cpu_isa
        events = []

        class FakeIsa:
            def __init__(self, name):
                self.name = name
            def __str__(self):
                return self.name
            def __bool__(self):
                events.append(["check", self.name, threading.current_thread() is threading.main_thread()])
                return True
        v.supported_vec_isa_list = [FakeIsa("avx512"), FakeIsa("avx2"), FakeIsa("neon")]
        v.x86_isa_checker = lambda: ["avx512", "avx2"]
        settled = cpu_isa.probe(lambda check: [events.append(["pause"]), check()])
        print(json.dumps({"settled": settled, "events": events[:4]}))
    """)
    assert got == {"settled": True, "events": [["pause"], ["check", "avx512", True],
                                               ["pause"], ["check", "avx2", True]]}


def test_a_compile_that_starts_stops_the_warm_up_early(tmp_path):
    functional = str(Path(torch.__file__).parent / "nn" / "functional.py")
    got = _child(f"""
        import json, sys
        from compile_core.cache import prewarm
        prewarm._stop.set()  # what wait() does when a compile starts
        report = prewarm.warm({{"modules": ["torch._inductor.compile_fx"], "files": [{functional!r}]}})
        print(json.dumps({{"report": report, "imported": "torch._inductor.compile_fx" in sys.modules}}))
    """)
    assert got["report"]["imported"] == 0 and got["report"]["indexed"] == 0
    assert not got["imported"]


MALFORMED = {"null_modules": '{"modules": null}', "number_files": '{"files": 5}',
             "bool_fingerprints": '{"fingerprints": true}',
             "string_modules": '{"modules": "torch.nn", "isa_dir": 7}', "a_list": "[1, 2]",
             "too_deep": "[" * 100000 + "]" * 100000, "not_utf8": "\xff\xfe not utf-8"}


@pytest.mark.parametrize("content", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_manifest_is_ignored_with_one_warning(tmp_path, monkeypatch, pack_log, content):
    """The manifest is read in the server's start-up handler: whatever is in it, ComfyUI starts."""
    from compile_core.report import log
    monkeypatch.setattr(log, "_said", set())
    (tmp_path / prewarm.MANIFEST).write_bytes(content.encode("latin-1"))
    assert prewarm.clean(prewarm.read_manifest(tmp_path)) == prewarm.read_manifest(tmp_path)
    monkeypatch.setattr(prewarm, "_thread", None)
    assert prewarm.start(tmp_path) is True  # the base warm-up only, and no exception
    prewarm.wait(finish=True)
    warnings = pack_log.warnings()
    assert len(warnings) == 1 and prewarm.MANIFEST in warnings[0], warnings
    # the next compile records a well-formed manifest over it: nothing else is lost
    prewarm.record(tmp_path, ["torch.nn"], ["/a.py"])
    assert prewarm.read_manifest(tmp_path)["modules"] == ["torch.nn"]
    assert len(pack_log.warnings()) == 1


def test_a_missing_manifest_is_not_reported(tmp_path, pack_log):
    assert prewarm.read_manifest(tmp_path) == {} and pack_log.warnings() == []


def test_a_compile_stops_a_running_warm_up_thread_and_waits_for_it(tmp_path):
    """The real background thread, started as the server starts it: ``wait()`` (what every
    first compile calls) stops it at its next file and returns only once it has ended, so its
    imports never race the compile; the log says how far it got."""
    files = sorted(str(p) for p in (Path(torch.__file__).parent / "_dynamo").rglob("*.py"))
    (tmp_path / "prewarm.json").write_text(json.dumps({"modules": ["torch._inductor.compile_fx"],
                                                       "files": files}))
    got = _child(f"""
        import json, logging
        lines = []
        handler = logging.Handler()
        handler.emit = lambda record: lines.append(record.getMessage())
        logging.getLogger("TorchCompileSpeed").addHandler(handler)
        logging.getLogger("TorchCompileSpeed").setLevel(logging.INFO)
        from compile_core.cache import prewarm
        started = prewarm.start({str(tmp_path)!r})
        alive = prewarm._thread.is_alive()
        prewarm.wait()
        print(json.dumps({{"started": started, "alive_before": alive,
                           "alive_after": prewarm._thread.is_alive(), "log": lines}}))
    """)
    assert got["started"] and got["alive_before"], got  # it was running when the compile came
    assert not got["alive_after"]
    done = [ln for ln in got["log"] if "warmed torch's compiler stack" in ln]
    assert len(done) == 1, got["log"]
    indexed = int(done[0].split(" modules, ")[1].split(" source files")[0])
    assert indexed < len(files), (indexed, len(files))  # stopped early, not run to the end


def test_a_compile_does_not_wait_forever_for_a_warm_up_that_hangs(monkeypatch, pack_log):
    """A warm-up whose import hangs (FAKE: a thread that ignores the stop) holds a compile for
    ``WAIT_LIMIT`` at most, and says so once."""
    hang = threading.Event()
    stuck = threading.Thread(target=hang.wait, args=(30,), daemon=True)
    stuck.start()
    monkeypatch.setattr(prewarm, "_thread", stuck)
    monkeypatch.setattr(prewarm, "_stop", threading.Event())
    monkeypatch.setattr(prewarm, "WAIT_LIMIT", 0.2)
    try:
        start = time.monotonic()
        prewarm.wait()
        assert time.monotonic() - start < 5 and stuck.is_alive()
        prewarm.wait()
        warnings = pack_log.warnings()
        assert len(warnings) == 1 and "did not stop within" in warnings[0]
    finally:
        hang.set()


def test_the_warm_up_sets_up_inductors_graph_passes_for_the_device_before_any_prompt(tmp_path):
    """Inductor's one-time set-up of its graph passes (0.2-0.5 s of tracing with no pause point
    for a background compile, and a swapped ``nn.Module.__call__``) runs on the warm-up
    thread for the device ``start`` names, before a waiting prompt may go on; the first
    compile on that device then finds it done."""
    from compile_core.torch_support import compile_threads, torch_compat
    if not compile_threads.after_a_thread_ends():
        pytest.skip(f"torch {torch_compat.torch.__version__} probes with the first compile (test_compile_threads)")
    code = """
        import json, torch
        from compile_core.cache import prewarm
        from compile_core.torch_support import hooks
        from torch._inductor.fx_passes import joint_graph, post_grad
        warmed, original = [], hooks.warm_inductor_passes
        hooks.warm_inductor_passes = lambda d: warmed.append([str(d), prewarm._probed.is_set()]) or original(d)
        misses = lambda: [joint_graph.lazy_init.cache_info().misses, post_grad.lazy_init.cache_info().misses]
        fresh = misses()
        prewarm.start(None, device=torch.device("cpu"))
        prewarm.wait(finish=True)
        after_warm_up = misses()
        torch._inductor.config.fx_graph_cache = False
        torch.compile(lambda x: (x @ x).softmax(-1) + 1)(torch.randn(8, 8))
        print(json.dumps({"warmed": warmed, "misses": [fresh, after_warm_up, misses()]}))
    """
    out = _child(code, {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path)})
    assert out == {"warmed": [["cpu", False]], "misses": [[0, 0], [1, 1], [1, 1]]}
