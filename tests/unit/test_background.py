"""Compile in a worker thread while the model runs eagerly, then swap at a call."""
import contextlib
import os
import threading
import time

import pytest
import torch

from compile_core.run import background, engine
from compile_core.torch_support import scoped
from compile_core.report.status import status_payload
from tcs_engine_helpers import CPU, eager, run, settings


def _bg(**kw):
    return settings(background_compile=True, **kw)


def _wait_done(cm):
    assert background.wait_idle(timeout=300)
    assert cm.background.job is None or cm.background.job.done.is_set()


def test_first_call_runs_eagerly_then_compiled_regions_swap_in(wan, wan_inputs, graph_count, pack_log):
    model = wan.Model(n_blocks=3).eval()
    x, t = wan_inputs()
    ref = eager(model, x, t)
    cm = engine.prepare(model, _bg())
    g0 = graph_count()
    torch.testing.assert_close(run(cm, model, x, t), ref)  # eager, inputs captured
    assert cm.compiling_in_background or cm.background.job.done.is_set()
    _wait_done(cm)
    assert graph_count() - g0 == 1  # the worker compiled one graph for the 3 blocks
    g1 = graph_count()
    torch.testing.assert_close(run(cm, model, x, t), ref)  # swapped in here
    assert cm.swapped_at == 2 and cm.changed
    assert graph_count() == g1  # the main thread reused the worker's graph: no recompile
    assert cm.entry.graphs == 1 and cm.entry.runs == 2
    infos = "\n".join(pack_log.infos())
    assert "in the background: 1 graph(s)" in infos
    assert "swapped in at model call 2 (1 call(s) ran eagerly meanwhile)" in infos
    assert not pack_log.warnings()
    torch.testing.assert_close(run(cm, model, *wan_inputs(tokens=10)), eager(model, *wan_inputs(tokens=10)))


def test_inference_mode_is_kept_for_the_worker(wan, wan_inputs, graph_count):
    model = wan.Model(n_blocks=2).eval()
    x, t = wan_inputs()
    ref = eager(model, x, t)
    cm = engine.prepare(model, _bg())
    with torch.inference_mode():
        cm.run(model, lambda: model(x, t), CPU)
        _wait_done(cm)
        g1 = graph_count()
        out = cm.run(model, lambda: model(x, t), CPU)
    torch.testing.assert_close(out, ref)
    assert graph_count() == g1  # guards on the dispatch keys and grad mode held
    assert cm.entry.graphs == 1 and cm.swapped_at == 2


def test_calls_while_the_worker_compiles_run_eagerly(wan, wan_inputs, monkeypatch):
    model = wan.Model(n_blocks=2).eval()
    x, t = wan_inputs()
    ref = eager(model, x, t)
    cm = engine.prepare(model, _bg())
    gate = threading.Event()
    original = cm.background.compile_captured
    monkeypatch.setattr(cm.background, "compile_captured", lambda *a: (gate.wait(60), original(*a)))
    for _ in range(3):
        torch.testing.assert_close(run(cm, model, x, t), ref)
    assert cm.compiling_in_background and cm.background.job.eager_calls == 3
    gate.set()
    _wait_done(cm)
    torch.testing.assert_close(run(cm, model, x, t), ref)
    assert cm.swapped_at == 4


def test_out_of_memory_beside_the_workers_compile_waits_for_it_and_runs_again(wan, wan_inputs, monkeypatch,
                                                                              pack_log):
    """On a GPU the worker's compile runs the regions too (a FAKE out-of-memory here): the
    eager call waits for the compile, then runs again alone; the prompt completes."""
    model = wan.Model(n_blocks=2).eval()
    x, t = wan_inputs()
    cm = engine.prepare(model, _bg())
    gate = threading.Event()
    original = cm.background.compile_captured
    monkeypatch.setattr(cm.background, "compile_captured", lambda *a: (gate.wait(60), original(*a))[1])
    run(cm, model, x, t)  # captured; its compile waits at the gate

    def out_of_memory(fn, device=None):
        raise torch.OutOfMemoryError("FAKE: CUDA out of memory")
    monkeypatch.setattr(background, "eager_beside_worker", out_of_memory)
    threading.Timer(0.5, gate.set).start()
    torch.testing.assert_close(run(cm, model, x, t), eager(model, x, t))
    assert not background.busy() and cm.background.job.done.is_set()  # it waited for the compile
    warnings = pack_log.warnings()
    assert len(warnings) == 1 and "ran out of memory beside a background compile" in warnings[0]


def test_a_failing_background_compile_warns_once_and_eager_goes_on(wan, wan_inputs, raising_backend,
                                                                   pack_log):
    model = wan.Model(n_blocks=2).eval()
    x, t = wan_inputs()
    ref = eager(model, x, t)
    cm = engine.prepare(model, _bg(backend=raising_backend.name))
    torch.testing.assert_close(run(cm, model, x, t), ref)
    _wait_done(cm)
    for _ in range(3):
        torch.testing.assert_close(run(cm, model, x, t), ref)
    assert cm.entry.failed and "boom" in cm.entry.failed
    warnings = pack_log.warnings()
    assert len(warnings) == 1 and "failed in the background" in warnings[0], warnings
    assert raising_backend.calls == 1


def test_an_out_of_memory_in_the_background_compile_retries_at_the_next_run(wan, wan_inputs, monkeypatch,
                                                                         graph_count, pack_log):
    """Only a compile failure ends compiling for a model: a (FAKE) out-of-memory raised by the
    worker's compile leaves the model eager for now, says so once, and the next sampling run
    compiles it again; the badge never says eager fallback."""
    model = wan.Model(n_blocks=2).eval()
    x, t = wan_inputs()
    ref = eager(model, x, t)
    cm = engine.prepare(model, _bg())
    original, raised = cm.background.compile_captured, []

    def out_of_memory_once(*a):
        if not raised:
            raised.append(True)
            raise torch.OutOfMemoryError("FAKE: CUDA out of memory")
        return original(*a)
    monkeypatch.setattr(cm.background, "compile_captured", out_of_memory_once)
    with cm.sampling_run():
        torch.testing.assert_close(run(cm, model, x, t), ref)  # captured, queued
        _wait_done(cm)
        torch.testing.assert_close(run(cm, model, x, t), ref)  # the job stopped: eager
        torch.testing.assert_close(run(cm, model, x, t), ref)
    assert not cm.entry.failed and cm.entry.graphs == 0
    assert status_payload(cm)["state"] != "failed"
    warnings = pack_log.warnings()
    assert len(warnings) == 1 and "OutOfMemoryError" in warnings[0] and "compiles again" in warnings[0]
    g0 = graph_count()
    with cm.sampling_run():
        torch.testing.assert_close(run(cm, model, x, t), ref)  # captured again, queued
        _wait_done(cm)
        torch.testing.assert_close(run(cm, model, x, t), ref)  # swapped in
    assert cm.entry.graphs == 1 and graph_count() - g0 == 1 and not cm.entry.failed
    assert len(pack_log.warnings()) == 1


def test_two_models_queue_on_the_one_worker(wan_factory, wan_inputs):
    a_cls, b_cls = wan_factory("WanA"), wan_factory("WanB")
    a, b = a_cls.Model(n_blocks=2).eval(), b_cls.Model(n_blocks=2, dim=48).eval()
    x, t = wan_inputs()
    xb, tb = wan_inputs()
    ca, cb = engine.prepare(a, _bg()), engine.prepare(b, _bg())
    ref_a, ref_b = eager(a, x, t), eager(b, xb, tb)
    torch.testing.assert_close(run(ca, a, x, t), ref_a)
    torch.testing.assert_close(run(cb, b, xb, tb), ref_b)
    _wait_done(ca)
    _wait_done(cb)
    torch.testing.assert_close(run(ca, a, x, t), ref_a)
    torch.testing.assert_close(run(cb, b, xb, tb), ref_b)
    assert ca.entry.graphs >= 1 and cb.entry.graphs >= 1
    assert ca.swapped_at == 2 and cb.swapped_at == 2


def test_a_model_whose_compile_is_done_runs_eagerly_beside_another_models_compile(wan_factory, wan_inputs,
                                                                                  graph_count, counting_backend,
                                                                                  pack_log):
    """WAN 2.2's two models: while the second one's compile runs, the first one's calls run
    eagerly (nothing on the sampling thread waits for that compile or compiles), said once;
    once the worker is idle its compiled graphs take over."""
    a = wan_factory("WanA").Model(n_blocks=2).eval()
    b = wan_factory("WanB").Model(n_blocks=2, dim=48).eval()
    x, t = wan_inputs()
    ca, cb = engine.prepare(a, _bg(backend=counting_backend.name)), engine.prepare(b, _bg())
    gate = threading.Event()
    original = cb.background.compile_captured
    cb.background.compile_captured = lambda *args: (gate.wait(60), original(*args))[1]
    try:
        run(ca, a, x, t)  # a: eager, its compile queued
        run(cb, b, x, t)  # b: eager, its compile queued after a's (held at the gate)
        assert ca.background.job.done.wait(60) and not ca.entry.failed and background.busy()
        runs, g = counting_backend.runs, graph_count()
        for _ in range(2):
            torch.testing.assert_close(run(ca, a, x, t), eager(a, x, t))
        assert counting_backend.runs == runs and graph_count() == g  # eager: no graph ran or compiled
        assert ca.swapped_at is None and background.busy()
    finally:
        gate.set()
    _wait_done(cb)
    said = [i for i in pack_log.infos() if "runs eagerly while" in i and "compiles in the background (" in i]
    assert len(said) == 1 and "nothing waits for that compile" in said[0], said
    torch.testing.assert_close(run(ca, a, x, t), eager(a, x, t))
    assert ca.swapped_at is not None and counting_backend.runs == runs + 2  # swapped in: a's 2 blocks, compiled


def test_foreground_finishes_a_pending_compile_first(wan, wan_inputs, graph_count):
    model = wan.Model(n_blocks=2).eval()
    x, t = wan_inputs()
    cm = engine.prepare(model, _bg())
    run(cm, model, x, t)
    with cm.foreground():
        assert not background.busy() and cm.background.job is None
        g = graph_count()
        torch.testing.assert_close(run(cm, model, x, t), eager(model, x, t))
        assert graph_count() == g


def test_snapshot_keeps_dispatch_keys():
    normal = torch.randn(3)
    with torch.inference_mode():
        inf = torch.randn(3)
        assert not background._snapshot(normal).is_inference()
    assert background._snapshot(inf).is_inference()
    d = {"a": 1}
    assert background._snapshot(d) == d and background._snapshot(d) is not d


def test_a_job_error_is_kept_and_the_worker_goes_on():
    job = background.submit(lambda: 1 / 0, "x")
    assert job.done.wait(30) and isinstance(job.error, ZeroDivisionError)
    ok = background.submit(lambda: None, "y")
    assert ok.done.wait(30) and ok.error is None
    assert background.wait_idle(30) and not background.busy()


@pytest.mark.parametrize("mode,kept", [("max-autotune-no-cudagraphs", False), ("max-autotune", False),
                                       ("default", True)])
def test_cuda_background_compile_uses_mode_default(mode, kept):
    s = settings(background_compile=True, backend="inductor", mode=mode)
    got = background.settings_for(s, torch.device("cuda"))
    assert (got is s) == kept
    assert got.mode == "default"
    assert background.settings_for(s, CPU) is s


def test_an_eager_step_that_lands_in_the_workers_fx_tracer_runs_again_after_it():
    """A real race: a torch.fx symbolic trace on the worker patches nn.Module.__call__ for the
    whole process, so a module call on this thread fails meanwhile; ``eager_beside_worker``
    runs it again as soon as the trace is done (not when the whole job is), with the eager
    result."""
    started, release = threading.Event(), threading.Event()

    def traced(x):
        started.set()
        release.wait(10)
        return x + 1

    background.submit(lambda: torch.fx.symbolic_trace(traced), "fx trace")
    assert started.wait(10)
    lin, x = torch.nn.Linear(2, 2), torch.randn(1, 2)
    with pytest.raises(NameError, match="not installed as a submodule"):
        lin(x)  # what an eager step beside the worker's trace gets without the retry
    after_trace = threading.Event()

    def job_after_the_trace():
        after_trace.wait(10)  # the worker stays busy until the eager step is back
    background.submit(job_after_the_trace, "next job")
    threading.Timer(0.3, release.set).start()
    out = background.eager_beside_worker(lambda: lin(x))
    assert release.is_set() and background.busy()  # after the trace, before the worker is idle
    assert torch.equal(out, torch.nn.functional.linear(x, lin.weight, lin.bias))
    after_trace.set()
    assert background.wait_idle(10)


def test_eager_beside_worker_raises_the_models_own_errors():
    def broken():
        raise ValueError("shape mismatch")
    with pytest.raises(ValueError, match="shape mismatch"):
        background.eager_beside_worker(broken)


def test_a_compile_beside_a_cpu_step_sees_the_steps_thread_count():
    """dynamo guards its graphs on the thread count of the thread that compiled them (torch's
    global state guard): an eager CPU step beside the worker must not change the count a job's
    thread starts with. (A step that took a core from the worker with ``torch.set_num_threads``
    set the process's default for new threads too: a restart's saved region then failed that
    guard, and it was traced again.)"""
    before, n = torch.get_num_threads(), 2  # (two on any machine: one to take)
    torch.set_num_threads(n)
    in_step, seen = threading.Event(), []

    def job():
        assert in_step.wait(60)
        seen.append(torch.get_num_threads())  # this thread's first question: its count is set now

    def step():
        in_step.set()
        deadline = time.monotonic() + 60
        while not seen and time.monotonic() < deadline:
            time.sleep(0.005)
        return torch.get_num_threads()
    try:
        background.submit(job, "a saved region's load")  # (not yielding: it runs beside the step)
        deadline = time.monotonic() + 60
        while not background.WORKER.running() and time.monotonic() < deadline:
            time.sleep(0.005)
        in_the_step = background.eager_beside_worker(step)
        assert background.wait_idle(60) and seen == [n], seen
        assert in_the_step == n and torch.get_num_threads() == n
    finally:
        in_step.set()
        background.wait_idle(60)
        torch.set_num_threads(before)


def test_the_workers_compile_runs_inside_the_callers_worker_context(wan, wan_inputs):
    """What the caller holds around its own calls (the bridge: the LoRA routing) is held by
    the worker for its whole compile, on the worker's thread, while the sampling thread's
    calls come and go."""
    model = wan.Model(n_blocks=2).eval()
    x, t = wan_inputs()
    held = []

    @contextlib.contextmanager
    def routing():
        held.append(threading.current_thread().name)
        try:
            yield
        finally:
            held.append("left")
    cm = engine.prepare(model, _bg())
    cm.run(model, lambda: model(x, t), CPU, routing)
    _wait_done(cm)
    assert len(held) == 2 and held[0] == "tcs-background-compile" and held[1] == "left"  # the compile's thread
    assert cm.entry.graphs == 1


# --------------------------------------------------------------------------- held on the CPU


@pytest.fixture
def host_state(monkeypatch):
    """The host's idle test, as the ComfyUI bridge installs it: busy until the test says."""
    state = {"idle": False}
    monkeypatch.setattr(background, "_IDLE_CHECK", [lambda: state["idle"]])
    return state


def test_a_cpu_models_compile_waits_until_the_server_is_idle(wan, wan_inputs, graph_count,
                                                              host_state, pack_log):
    """On the CPU the compile would take the cores the run's eager steps use: it waits for an
    idle server (no prompt running or queued); the next run swaps the regions in at once."""
    model = wan.Model(n_blocks=3).eval()
    x, t = wan_inputs()
    ref = eager(model, x, t)
    cm = engine.prepare(model, _bg())
    told = []  # what the badge is sent when the compile is done (the bridge's callback)
    cm.on_background_done = lambda: told.append((status_payload(cm)["state"], threading.current_thread()))
    g0 = graph_count()
    with cm.sampling_run():
        for _ in range(3):
            torch.testing.assert_close(run(cm, model, x, t), ref)
        time.sleep(3 * background.POLL_S)
        assert not background.WORKER.running() and not cm.background.job.started.is_set()
        assert graph_count() == g0 and cm.background.job.eager_calls == 3 and cm.compiling_in_background
        assert status_payload(cm)["state"] == "background-after-run"
    time.sleep(3 * background.POLL_S)
    assert not cm.background.job.done.is_set() and graph_count() == g0  # over, but the server is busy
    assert status_payload(cm)["state"] == "background-after-run"
    host_state["idle"] = True
    assert cm.background.job.done.wait(300) and background.wait_idle(300)
    assert graph_count() - g0 == 1
    # no model call comes until the next run: the worker itself says it is compiled now
    assert [state for state, _ in told] == ["cold"] and told[0][1] is not threading.main_thread()
    with cm.sampling_run():
        torch.testing.assert_close(run(cm, model, x, t), ref)
    assert cm.swapped_at == 4 and cm.entry.graphs == 1
    infos = "\n".join(pack_log.infos())
    assert "compile starts once the server is idle" in infos
    assert "compiles in the background once the server is idle" in infos
    assert "swapped in at model call 4 (3 call(s) ran eagerly meanwhile)" in infos


def test_a_failing_done_callback_warns_once_and_the_worker_goes_on(pack_log):
    """``Job.on_done`` (the badge's status) raising: one warning, and the next job still runs."""
    gate = threading.Event()
    jobs = [background.submit(lambda: gate.wait(60), f"job {i}") for i in range(2)]
    for job in jobs:
        job.on_done = lambda: 1 / 0
    gate.set()
    assert background.wait_idle(60) and all(j.done.is_set() and j.error is None for j in jobs)
    warnings = [w for w in pack_log.warnings() if "after the background compile of job" in w]
    assert len(warnings) == 1 and "ZeroDivisionError" in warnings[0], pack_log.warnings()


def test_waiting_for_the_worker_starts_a_compile_that_waits_for_the_server(wan, wan_inputs, host_state):
    """Compile-ahead, the Diagnostics node or a model compiled in the foreground wait for the
    worker: a job that waits for an idle server must start then."""
    model = wan.Model(n_blocks=2).eval()
    x, t = wan_inputs()
    cm = engine.prepare(model, _bg())
    with cm.sampling_run():
        run(cm, model, x, t)
        time.sleep(3 * background.POLL_S)
        assert not cm.background.job.started.is_set()
        assert background.wait_idle(300) and cm.background.job.done.is_set() and cm.background.job.error is None


@pytest.mark.parametrize("device", ["cuda", "mps"])
def test_a_gpu_models_compile_does_not_yield(wan, wan_inputs, host_state, device, monkeypatch):
    """On an accelerator the run barely uses the CPU: the compile starts beside it at once.
    FAKE device: the captured regions are queued as a CUDA/MPS model's would be (the compile
    itself is stopped before it starts, as none of these devices is here)."""
    model = wan.Model(n_blocks=2).eval()
    cm = engine.prepare(model, _bg())
    gate = threading.Event()
    monkeypatch.setattr(cm.background, "compile_captured", lambda *a: gate.wait(60))
    with cm.sampling_run():
        cm.background.queue([], torch.device(device))
        assert not cm.background.job.yields and cm.background.job.started.wait(10)  # at once, though the server is busy
    gate.set()
    assert background.wait_idle(60)


def test_saved_regions_say_whether_every_region_has_a_file(tmp_path, wan):
    from compile_core.cache import precompiled
    model = wan.Model(n_blocks=2).eval()
    fast = precompiled.Precompiled(tmp_path, {})
    blocks = list(model.blocks)
    assert not fast.saved(blocks, CPU)
    (tmp_path / f"{precompiled.region_key(blocks[0])}-cpu.bin").write_bytes(b"x")
    assert fast.saved(blocks, CPU)  # identical blocks share one key
    assert not fast.saved(blocks, torch.device("cuda"))
    assert not fast.saved(blocks + [model.head], CPU)


def test_a_broken_idle_check_starts_the_waiting_compile_with_one_warning(wan, wan_inputs, monkeypatch,
                                                                          pack_log):
    def broken():
        raise RuntimeError("no prompt queue")
    monkeypatch.setattr(background, "_IDLE_CHECK", [broken])
    model = wan.Model(n_blocks=2).eval()
    x, t = wan_inputs()
    cm = engine.prepare(model, _bg())
    with cm.sampling_run():
        run(cm, model, x, t)
    assert cm.background.job.done.wait(300) and cm.background.job.waited_s < 1
    assert len([w for w in pack_log.warnings() if "could not tell whether the server is idle" in w]) == 1


def test_a_gpu_models_jobs_run_on_the_one_worker_thread_which_stays():
    """A job that does not wait for an idle server (a GPU model's) runs on the worker itself."""
    seen = []
    jobs = [background.submit(lambda: seen.append(threading.current_thread()), f"job {i}") for i in range(2)]
    assert background.wait_idle(30) and all(j.done.is_set() for j in jobs)
    assert seen[0] is seen[1] is background.WORKER._thread and seen[0].is_alive()


def test_a_server_that_stays_busy_still_compiles_after_the_idle_wait(host_state, monkeypatch, pack_log):
    """A render server whose queue never empties: the CPU model's compile starts after
    ``IDLE_WAIT_S`` all the same, and says how long it waited."""
    monkeypatch.setattr(background, "IDLE_WAIT_S", 0.3)
    job = background.submit(lambda: "compiled", "a model", yields=True)
    assert job.done.wait(30) and job.result == "compiled" and not host_state["idle"]
    assert 0.3 <= job.waited_s < 5
    assert any("a model compiles in the background once the server is idle (at most 0 s" in i
               for i in pack_log.infos()), pack_log.infos()


def test_a_job_changes_no_process_wide_state_while_it_runs():
    """Nothing of the process changes while a job runs: the interpreter's switch interval, the
    process's CPU priority, and torch's own functions and classes (no pause points patched in)."""
    import sys
    import torch._dynamo.convert_frame as convert_frame
    import torch._dynamo.symbolic_convert as symbolic_convert
    watched = [(symbolic_convert.InstructionTranslatorBase, "step"), (convert_frame, "compile_lock"),
               (torch.nn.Module, "__call__"), (torch.fx.Interpreter, "run_node")]
    watched = [(owner, name) for owner, name in watched if hasattr(owner, name)]
    before = [getattr(owner, name) for owner, name in watched]
    seen = {}

    def look():
        seen["interval"] = sys.getswitchinterval()
        seen["nice"] = os.getpriority(os.PRIO_PROCESS, 0)
        seen["same"] = [getattr(o, n) is b for (o, n), b in zip(watched, before)]
        seen["compiled"] = torch.compile(lambda x: x.cos() + 1, backend="aot_eager")(torch.ones(4)).sum().item()
        seen["after"] = [getattr(o, n) is b for (o, n), b in zip(watched, before)]
    interval, nice = sys.getswitchinterval(), os.getpriority(os.PRIO_PROCESS, 0)
    with scoped.scoped_state():  # torch 2.8's torch.compile() sets TORCHINDUCTOR_CACHE_DIR
        job = background.submit(look, "a job", yields=True)
        assert job.done.wait(120) and job.error is None, job.error
    assert seen["interval"] == interval and seen["nice"] == nice
    assert all(seen["same"]) and all(seen["after"]), seen
    assert seen["compiled"] == pytest.approx(4 * (1 + torch.cos(torch.tensor(1.0)).item()))
