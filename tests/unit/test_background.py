"""Compile in a worker thread while the model runs eagerly, then swap at a call."""
import contextlib
import os
import threading
import time

import pytest
import torch

from compile_core.run import background, engine, pacing
from compile_core.torch_support import compile_threads, guards, openmp, scoped
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


def test_inside_another_compile_the_first_call_compiles_in_the_foreground(wan, wan_inputs, graph_count):
    """Another torch.compile around the model call (core's TorchCompileModel after Apply, told
    by the bridge) would trace the background mode's input capture: the call compiles on this
    thread instead, as without background mode."""
    model = wan.Model(n_blocks=2).eval()
    x, t = wan_inputs()
    cm = engine.prepare(model, _bg())
    cm.inside_other_compile = True
    g0 = graph_count()
    torch.testing.assert_close(run(cm, model, x, t), eager(model, x, t))
    assert cm.background.job is None and cm.entry.runs == 1 and graph_count() - g0 == 1  # compiled here


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


def test_a_model_whose_compile_is_done_runs_it_beside_another_models_compile(wan_factory, wan_inputs, graph_count,
                                                                            counting_backend, pack_log):
    """WAN 2.2's two models: the first one's graphs are built while the second one's compile
    runs; its calls run them (``compile_core.run.beside``), not eagerly until the worker is idle."""
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
        ahead, runs, g = guards.guard_check(), counting_backend.runs, graph_count()
        torch.testing.assert_close(run(ca, a, x, t), eager(a, x, t))
        assert counting_backend.runs == runs + 2 * ahead and graph_count() == g  # a's 2 blocks, compiled
    finally:
        gate.set()
    _wait_done(cb)
    said = [i for i in pack_log.infos() if "while" in i and "compiles in the background (" in i]
    assert len(said) == 1 and ("runs its compiled graphs while" in said[0]) is ahead, said
    torch.testing.assert_close(run(ca, a, x, t), eager(a, x, t))
    assert ca.swapped_at is not None  # swapped once the worker was idle


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


@pytest.mark.skipif(not guards.guard_check(), reason="new inputs compile in the foreground here")
def test_a_new_size_runs_eagerly_and_compiles_on_the_worker(wan, wan_inputs, graph_count, pack_log):
    """Static shapes: a new token count needs a new graph. That call runs its regions eagerly
    (no graph on the calling thread) and queues the compile; the next call swaps it in."""
    model = wan.Model(n_blocks=2).eval()
    cm = engine.prepare(model, _bg(shape_policy="static"))
    small, big = wan_inputs(), wan_inputs(tokens=10)
    run(cm, model, *small)
    _wait_done(cm)
    run(cm, model, *small)  # swapped in
    g0 = graph_count()
    torch.testing.assert_close(run(cm, model, *big), eager(model, *big))
    assert graph_count() == g0 and cm.background.job is not None  # eager here, compile queued
    _wait_done(cm)
    assert graph_count() == g0 + 1  # the worker's graph for the new size
    torch.testing.assert_close(run(cm, model, *big), eager(model, *big))
    assert graph_count() == g0 + 1 and cm.background.job is None and cm.swapped_at == 2
    torch.testing.assert_close(run(cm, model, *small), eager(model, *small))  # both sizes kept
    assert graph_count() == g0 + 1
    infos = "\n".join(pack_log.infos())
    assert "2 region call(s) of" in infos and "it compiles in the background" in infos


@pytest.mark.skipif(not guards.guard_check(), reason="new inputs compile in the foreground here")
def test_a_miss_that_compiles_nothing_turns_the_probe_off(wan, wan_inputs, monkeypatch, pack_log):
    """Told "no graph takes this call" where one does (simulated), the queued compile finds
    nothing to compile: from then on new inputs take the regular path, never eager forever."""
    model = wan.Model(n_blocks=2).eval()
    x, t = wan_inputs()
    cm = engine.prepare(model, _bg())
    run(cm, model, x, t)
    _wait_done(cm)
    run(cm, model, x, t)
    monkeypatch.setattr(guards, "cached_graph_accepts", lambda *a: False)  # the fake
    run(cm, model, x, t)  # "missed": eager, compile queued
    _wait_done(cm)
    torch.testing.assert_close(run(cm, model, x, t), eager(model, x, t))
    assert cm.background.miss_off and cm.background.probe() is None
    assert "compiled nothing new" in "\n".join(pack_log.infos())


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
    thread = "tcs-compile" if compile_threads.after_a_thread_ends() else "tcs-background-compile"
    assert len(held) == 2 and held[0].startswith(thread) and held[1] == "left"  # the compile's thread
    assert cm.entry.graphs == 1


def test_gil_turns_are_short_while_a_job_runs_and_put_back_after():
    import sys
    before = sys.getswitchinterval()
    seen = []
    background.submit(lambda: seen.append(sys.getswitchinterval()), "interval")
    assert background.wait_idle(10)
    assert seen == [pytest.approx(background.SWITCH_INTERVAL)]
    assert sys.getswitchinterval() == before


def test_gil_turns_changed_by_someone_else_meanwhile_are_left_alone():
    import sys
    before = sys.getswitchinterval()
    try:
        with background.short_gil_turns():
            sys.setswitchinterval(0.002)  # another component's choice
        assert sys.getswitchinterval() == pytest.approx(0.002)
    finally:
        sys.setswitchinterval(before)


# --------------------------------------------------------------------------- held on the CPU


@pytest.fixture
def host_state(monkeypatch):
    """The host's idle test, as the ComfyUI bridge installs it: busy until the test says."""
    state = {"idle": False}
    monkeypatch.setattr(pacing, "_IDLE_CHECK", [lambda: state["idle"]])
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
        time.sleep(3 * pacing.POLL)
        assert not background.WORKER.running() and not cm.background.job.started.is_set()
        assert graph_count() == g0 and cm.background.job.eager_calls == 3 and cm.compiling_in_background
        assert status_payload(cm)["state"] == "background-after-run"
    time.sleep(3 * pacing.POLL)
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
    assert "compile runs while the server is idle and pauses while prompts run" in infos
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


def _spy_on_team_release(monkeypatch) -> list:
    """The threads that gave their OpenMP team back (the real release runs: test_openmp)."""
    released, real = [], openmp.release_thread_team
    monkeypatch.setattr(openmp, "release_thread_team", lambda: released.append(threading.get_ident()) or real())
    return released


def test_a_cpu_compile_pauses_while_a_prompt_runs_and_goes_on_when_idle(host_state, pack_log, monkeypatch):
    """A yielding job pauses at its next pause point once the server is busy (the sampling
    thread gets the interpreter lock and the cores), and goes on when it is idle again. At its
    pause points its thread gives its OpenMP team back: an idle team slows a prompt's parallel ops."""
    host_state["idle"] = True
    progress, stop, job_thread = [0], threading.Event(), []
    graph = torch.fx.symbolic_trace(lambda x: (x + 1).relu() * 2)
    released = _spy_on_team_release(monkeypatch)

    def compile_like():  # torch.fx interpreting node after node, as a compile's Python phases
        job_thread.append(threading.get_ident())
        torch.ones(2 ** 20).mul(2)  # a parallel op on real tensors (a graph's first run)
        while not stop.is_set():
            progress[0] += 1
            torch.fx.Interpreter(graph).run(torch.ones(2))
    job = background.submit(compile_like, "a model", yields=True)
    deadline = time.monotonic() + 120  # (a first job imports the pause points' torch modules)
    while not progress[0] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert progress[0], "the job never reached its loop"
    host_state["idle"] = False
    deadline = time.monotonic() + 5
    while not job.paused and time.monotonic() < deadline:
        time.sleep(0.01)
    assert job.paused and not background.WORKER.running()
    at_pause = progress[0]
    time.sleep(0.5)
    assert progress[0] - at_pause <= 1  # no progress while paused
    host_state["idle"] = True
    time.sleep(0.3)
    assert progress[0] > at_pause + 10 and not job.paused
    stop.set()
    assert job.done.wait(10) and job.error is None and job.pauses == 1 and job.paused_s > 0.4
    infos = [m for m in pack_log.infos() if "the background compile of a model pauses" in m]
    assert len(infos) == 1
    assert released and set(released) == set(job_thread), (released, job_thread)  # by the job's thread only


def _burn_cpu(seconds: float) -> None:
    """A stretch without pause points (as a C++ call of the compiler's) that uses this thread's CPU."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_a_yielding_job_records_how_long_it_ran_beside_prompts(host_state):
    """What a yielding job ran while the server was busy is recorded (an upper bound of what
    it took from prompts, said in the finished compile's log line): up to the pause where it
    paused, and up to the next idle check where it could not pause before the prompt ended."""
    host_state["idle"] = True

    def job_fn():
        pacing.pause_point()  # idle: on it goes
        host_state["idle"] = False  # a prompt comes while the job is inside a long stretch
        _burn_cpu(0.3)
        pacing.pause_point()  # pauses until the test says idle
        with pacing.unpaused():  # a stretch it cannot pause inside, and the prompt ends meanwhile
            host_state["idle"] = False
            _burn_cpu(0.2)
            pacing.pause_point()
            host_state["idle"] = True
        pacing.pause_point()
    job = background.submit(job_fn, "a model", yields=True)
    deadline = time.monotonic() + 120  # (a first job imports the pause points' torch modules)
    while not job.paused and time.monotonic() < deadline:
        time.sleep(0.01)
    assert job.paused
    time.sleep(0.3)
    host_state["idle"] = True
    assert job.done.wait(10) and job.error is None and job.pauses == 1
    beside = job.beside
    assert beside.stretches == 2 and 0.5 <= beside.cpu_s < 1.0, vars(beside)
    assert 0.3 <= beside.longest < 0.5, vars(beside)
    assert beside.text() == (f"; beside prompts it used {beside.cpu_s:.2f} s of CPU in 2 stretch(es), "
                             f"at most {1000 * beside.longest:.0f} ms in one")


def test_a_yielding_jobs_record_sees_prompts_that_began_and_ended_between_two_checks(host_state,
                                                                                     monkeypatch):
    """A prompt can begin and end between two of the job's checks (the job waiting for its
    compilers, or in a stretch without a pause point): every check finds the server idle, but
    its count of started prompts moved, and that stretch is recorded; so is a last stretch
    that a prompt met after the job's last check."""
    host_state["idle"] = True
    started = [0]
    monkeypatch.setattr(pacing, "_STARTED", [lambda: started[0]])

    def job_fn():
        pacing.pause_point()
        started[0] += 1  # a prompt starts and ends inside this stretch
        _burn_cpu(0.3)
        pacing.pause_point()  # idle again: no pause, but the stretch ran beside that prompt
        _burn_cpu(0.1)
        pacing.pause_point()  # idle, no prompt since: not recorded
        _burn_cpu(0.05)
        started[0] += 1  # a prompt starts after the last check, as the job ends
    job = background.submit(job_fn, "a model", yields=True)
    assert job.done.wait(120) and job.error is None and job.pauses == 0
    beside = job.beside
    assert beside.stretches == 2 and 0.35 <= beside.cpu_s < 0.45, vars(beside)
    assert 0.3 <= beside.longest < 0.4, vars(beside)


def test_a_yielding_job_that_never_met_a_busy_server_ran_beside_no_prompt(host_state):
    host_state["idle"] = True
    job = background.submit(lambda: [_burn_cpu(0.1), pacing.pause_point()], "a model", yields=True)
    assert job.done.wait(120) and job.error is None
    assert job.pauses == 0 and job.beside.stretches == 0 and job.beside.text() == ""


def test_a_yielding_jobs_own_pause_point_waits_while_the_server_is_busy(host_state):
    """``pacing.pause_point``, between steps a compile cannot pause inside (each waits for a
    child process): in a yielding job it pauses there while the server is busy, and goes on
    when it is idle; anywhere else it returns at once."""
    assert not pacing.in_yielding_job()
    start = time.monotonic()
    pacing.pause_point()
    assert time.monotonic() - start < 0.05
    host_state["idle"], go, seen = True, threading.Event(), []

    def job_fn():
        seen.append(pacing.in_yielding_job())
        go.wait(10)
        pacing.pause_point()
        seen.append("past")
    job = background.submit(job_fn, "a model", yields=True)
    deadline = time.monotonic() + 120  # (a first job imports the pause points' torch modules)
    while not seen and time.monotonic() < deadline:
        time.sleep(0.01)
    host_state["idle"] = False
    go.set()
    deadline = time.monotonic() + 5
    while not job.paused and time.monotonic() < deadline:
        time.sleep(0.01)
    assert job.paused and seen == [True]
    time.sleep(0.3)
    assert seen == [True]  # still paused
    host_state["idle"] = True
    assert job.done.wait(10) and job.error is None and seen == [True, "past"] and job.pauses == 1
    assert not pacing.in_yielding_job()


def test_a_yielding_compile_probes_the_cpu_isas_one_at_a_time_after_pause_points(host_state, monkeypatch):
    """Torch's CPU ISA probe (a child process per ISA, at normal priority) runs one ISA at a
    time after a pause point in a CPU model's background compile, and side by side elsewhere
    (the real probe: test_prewarm)."""
    import types
    from compile_core.run import compile_pass
    from compile_core.torch_support import cpu_isa
    calls = []
    monkeypatch.setattr(cpu_isa, "probe",
                        lambda each=None: calls.append((each, pacing.in_yielding_job())) or True)
    state = types.SimpleNamespace(settings=types.SimpleNamespace(backend="inductor"))
    first = types.SimpleNamespace(first_compile=True)
    host_state["idle"] = True
    job = background.submit(lambda: compile_pass.probe_isa(state, first, CPU), "a model", yields=True)
    assert job.done.wait(10) and job.error is None
    compile_pass.probe_isa(state, first, CPU)  # a foreground compile
    assert calls == [(pacing.lowered_step, True), (None, False)]


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="the idle scheduling class is Linux's")
def test_a_yielding_jobs_lowered_step_starts_its_child_processes_at_the_lowest_priority(host_state):
    """A step that waits for child processes (torch's CPU ISA check) runs after a pause point
    in a helper thread in the idle scheduling class, which its children inherit from the start;
    the job's own thread keeps its priority (it holds the interpreter lock the prompt needs)."""
    import contextvars
    import subprocess
    import sys
    var = contextvars.ContextVar("tcs_test_var", default="unset")
    host_state["idle"], seen = True, {}

    def step():
        seen["helper"] = (threading.get_ident(), os.sched_getscheduler(0), var.get())
        seen["owned"] = threading.get_native_id() in seen["owners"]  # its compilers are the job's
        child = subprocess.run([sys.executable, "-c", "import os; print(os.sched_getscheduler(0))"],
                               capture_output=True, text=True, check=True)
        return int(child.stdout)

    def job_fn():
        var.set("the job's")
        seen["job"], seen["owners"] = threading.get_ident(), pacing._in_job.compilers.owners
        seen["job_native"] = threading.get_native_id()
        host_state["idle"] = False  # a prompt: the step waits at its pause point until idle
        seen["child"] = pacing.lowered_step(step)
        seen["owners_after"] = set(seen["owners"])
        seen["job_policy"] = os.sched_getscheduler(0)
        with pytest.raises(ZeroDivisionError):
            pacing.lowered_step(lambda: 1 / 0)
    job = background.submit(job_fn, "a model", yields=True)
    deadline = time.monotonic() + 120
    while not job.paused and time.monotonic() < deadline:
        time.sleep(0.01)
    assert job.paused and "helper" not in seen
    host_state["idle"] = True
    assert job.done.wait(60) and job.error is None, job.error
    helper, policy, value = seen["helper"]
    assert helper != seen["job"] and policy == os.SCHED_IDLE and value == "the job's"
    assert seen["child"] == os.SCHED_IDLE and seen["job_policy"] == os.SCHED_OTHER
    assert seen["owned"] and seen["owners_after"] == {seen["job_native"]}, seen
    assert job.pauses == 1


def test_a_yielding_compile_pauses_before_it_enters_dynamo_for_a_region(wan, wan_inputs, host_state, monkeypatch):
    """Dynamo's entry runs a while before its first pause point: a prompt that began during the
    compile's last set-up step (the CPU ISA probe) had steps stalled 0.2-0.6 s. A yielding job
    pauses before it enters dynamo for a region while the server is busy, and goes on when idle."""
    from torch._dynamo.utils import counters
    from compile_core.run import compile_pass
    model = wan.Model(n_blocks=2).eval()
    x, t = wan_inputs()
    ref = eager(model, x, t)
    real_probe = compile_pass.probe_isa

    def probe_then_a_prompt(*args):
        real_probe(*args)
        host_state["idle"] = False  # a prompt came during the probe
    monkeypatch.setattr(compile_pass, "probe_isa", probe_then_a_prompt)
    host_state["idle"] = True
    cm = engine.prepare(model, _bg())
    frames = counters["frames"]["total"]
    with cm.sampling_run():
        torch.testing.assert_close(run(cm, model, x, t), ref)
    job = cm.background.job
    deadline = time.monotonic() + 120
    while not job.paused and not job.done.is_set() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert job.paused and counters["frames"]["total"] == frames  # paused before dynamo's entry
    time.sleep(3 * pacing.POLL)
    assert job.paused and counters["frames"]["total"] == frames
    host_state["idle"] = True
    assert job.done.wait(300) and job.error is None and background.wait_idle(300)
    assert counters["frames"]["total"] > frames and cm.entry.graphs == 1
    with cm.sampling_run():
        torch.testing.assert_close(run(cm, model, x, t), ref)
    assert cm.swapped_at == 2


def test_a_paused_compile_goes_on_while_another_thread_needs_dynamo(host_state):
    """A paused compile holds dynamo's process-wide compile lock: a torch.compile on another
    thread (another pack's, in the prompt) must not wait for the server to be idle."""
    host_state["idle"] = True
    begun = threading.Event()

    def slow(x):
        for _ in range(60):
            x = torch.sin(x) * 1.01 + x.cos()
        return x

    def compile_job():
        host_state["idle"] = False  # a prompt starts as the compile begins: it pauses in dynamo
        begun.set()
        torch.compile(slow, backend="eager")(torch.randn(8))
    # (torch 2.8's torch.compile() sets TORCHINDUCTOR_CACHE_DIR: the scope puts it back after)
    with scoped.scoped_state():
        job = background.submit(compile_job, "a model", yields=True)
        assert begun.wait(10)
        time.sleep(0.3)
        out = []
        other = threading.Thread(target=lambda: out.append(torch.compile(torch.cos, backend="eager")(torch.ones(2))))
        other.start()
        other.join(60)
        assert not other.is_alive() and torch.equal(out[0], torch.ones(2).cos())
        assert job.done.wait(60) and job.error is None  # it went on and finished meanwhile


def test_waiting_for_the_worker_starts_a_compile_that_waits_for_the_server(wan, wan_inputs, host_state):
    """Compile-ahead, the Diagnostics node or a model compiled in the foreground wait for the
    worker: a job that waits for an idle server must start then, and not pause."""
    model = wan.Model(n_blocks=2).eval()
    x, t = wan_inputs()
    cm = engine.prepare(model, _bg())
    with cm.sampling_run():
        run(cm, model, x, t)
        time.sleep(3 * pacing.POLL)
        assert not cm.background.job.started.is_set()
        assert background.wait_idle(300) and cm.background.job.done.is_set() and cm.background.job.error is None
        assert cm.background.job.pauses == 0


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
        cm.background.queue([], torch.device(device), "the first input")
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
    monkeypatch.setattr(pacing, "_IDLE_CHECK", [broken])
    model = wan.Model(n_blocks=2).eval()
    x, t = wan_inputs()
    cm = engine.prepare(model, _bg())
    with cm.sampling_run():
        run(cm, model, x, t)
    assert cm.background.job.done.wait(300) and cm.background.job.pauses == 0
    assert len([w for w in pack_log.warnings() if "could not tell whether the server is idle" in w]) == 1


def test_each_job_runs_in_a_thread_that_ends_with_it():
    """A compile runs its graphs once; on the CPU their OpenMP loops give the running thread a
    thread team of its own, which slowed every later model call while the thread lived."""
    if not compile_threads.after_a_thread_ends():
        pytest.skip(f"torch {torch.__version__}: jobs run on the worker itself (test_compile_threads)")
    seen = []
    job = background.submit(lambda: seen.append(threading.current_thread()), "a job")
    assert job.done.wait(30) and background.wait_idle(30)
    (thread,) = seen
    assert thread.name.startswith("tcs-compile") and thread is not background.WORKER._thread
    thread.join(5)
    assert not thread.is_alive()


def test_where_a_compiling_thread_must_not_end_each_job_gives_the_workers_team_back(monkeypatch):
    """Where the thread-safety probe fails (torch 2.11.0, ``compile_threads``) jobs run on the
    worker itself, which never ends: its OpenMP team is given back after each job."""
    monkeypatch.setattr(compile_threads, "after_a_thread_ends", lambda: False)
    released, ran = _spy_on_team_release(monkeypatch), []
    job = background.submit(lambda: ran.append(threading.get_ident()) or torch.ones(2 ** 20).mul(2), "a job")
    assert job.done.wait(30) and background.wait_idle(30) and job.error is None
    assert ran == [background.WORKER._thread.ident] and released == ran, (ran, released)
