"""The whole-graph stage (``compile_core.whole_graph``, experimental, issue #16): once a regional
compile has settled, the whole model is compiled as one graph (blocks nested) in the background
and takes the calls its guards accept; every other call runs the regional graphs."""
import contextlib
import threading
import time

import pytest
import torch

from compile_core import background, engine, torch_compat, whole_graph
from tcs_engine_helpers import eager, run, settings


@pytest.fixture
def stage_on(monkeypatch):
    monkeypatch.setenv(whole_graph.ENV, "1")


def _settle_and_wait(cm, model, x, t):
    """Compile the regions, settle, capture the whole model's inputs; wait for its compile."""
    for _ in range(3):
        run(cm, model, x, t)
    assert cm.whole.state == "queued"
    assert cm.whole.job.done.wait(60) and background.wait_idle(60)


def _forward_attrs(model):
    return [m for m in model.modules() if "forward" in m.__dict__]


def _taken_once(wan, wan_inputs, **kw):
    """A 2-block model whose whole graph has compiled and taken one call: (model, x, t, cm)."""
    model = wan.Model(n_blocks=2).eval()
    x, t = wan_inputs()
    cm = engine.prepare(model, settings(**kw))
    _settle_and_wait(cm, model, x, t)
    run(cm, model, x, t)
    assert cm.whole.taken == 1
    return model, x, t, cm


def test_the_whole_graph_takes_over_once_the_regional_compile_settles(stage_on, wan, wan_inputs, graph_count,
                                                                      pack_log):
    model = wan.Model(n_blocks=3).eval()
    x, t = wan_inputs()
    cm = engine.prepare(model, settings())
    _settle_and_wait(cm, model, x, t)
    assert cm.entry.graphs == 1 and cm.whole.cm.entry.graphs == 1  # one regional, one whole graph
    g = graph_count()
    torch.testing.assert_close(run(cm, model, x, t), eager(model, x, t))
    assert cm.whole.state == "ready" and cm.whole.taken == 1 and cm.whole.regional_calls == 0
    assert cm.whole.job is None  # the job, and the inputs it captured, are let go
    assert cm.changed and graph_count() == g  # it ran the worker's graph: nothing compiled here
    torch.testing.assert_close(run(cm, model, x, t), eager(model, x, t))
    assert cm.whole.taken == 2
    assert not _forward_attrs(model)  # the nested forwards were only attached for the calls
    infos = "\n".join(pack_log.infos())
    assert "its regional compile has settled; compiling it as one graph" in infos
    assert "as one graph in the background in" in infos
    assert not pack_log.warnings()


def test_a_call_the_whole_graph_does_not_take_runs_the_regional_graphs(stage_on, wan, wan_inputs, graph_count):
    model = wan.Model(n_blocks=3).eval()
    x, t = wan_inputs()
    cm = engine.prepare(model, settings(shape_policy="static"))
    _settle_and_wait(cm, model, x, t)
    run(cm, model, x, t)
    regional_graphs, g = cm.entry.graphs, graph_count()
    x2, t2 = wan_inputs(tokens=10)
    torch.testing.assert_close(run(cm, model, x2, t2), eager(model, x2, t2))
    assert cm.whole.regional_calls == 1 and cm.whole.taken == 1
    assert cm.whole.cm.entry.graphs == 1  # the whole graph was not compiled for the new size
    assert cm.entry.graphs == regional_graphs + 1 and graph_count() == g + 1  # the regional one was
    torch.testing.assert_close(run(cm, model, x2, t2), eager(model, x2, t2))
    assert cm.whole.regional_calls == 2 and cm.entry.graphs == regional_graphs + 1
    assert not _forward_attrs(model)


def test_a_failing_whole_graph_compile_leaves_the_regional_graphs(stage_on, wan, wan_inputs, monkeypatch, pack_log):
    def broken(forward, reuse):
        raise RuntimeError("no nested regions here")
    monkeypatch.setattr(whole_graph, "_nested", broken)
    model = wan.Model(n_blocks=2).eval()
    x, t = wan_inputs()
    cm = engine.prepare(model, settings())
    _settle_and_wait(cm, model, x, t)
    for _ in range(2):
        torch.testing.assert_close(run(cm, model, x, t), eager(model, x, t))
    assert cm.whole.state == "failed" and cm.whole.taken == 0 and not cm.entry.failed
    warnings = pack_log.warnings()
    assert len(warnings) == 1 and "keeps running its regional graphs" in warnings[0]
    assert "no nested regions here" in warnings[0]
    assert not _forward_attrs(model)


@pytest.mark.parametrize("value, on", [("1", True), ("0", False), ("", False), ("sometimes", False)])
def test_the_stage_is_on_only_when_asked(monkeypatch, wan, value, on, pack_log):
    monkeypatch.setenv(whole_graph.ENV, value)
    assert (engine.prepare(wan.Model(n_blocks=2), settings()).whole is not None) is on
    assert any(whole_graph.ENV in w for w in pack_log.warnings()) is (value == "sometimes")
    assert engine.prepare(wan.Model(n_blocks=2), settings(compile_transformer_blocks_only=False)).whole is None


@pytest.mark.parametrize("node, env, how", [(True, "", "timed"), (True, "0", ""), (False, "1", "forced"),
                                             (True, "1", "forced"), (True, "now-and-then", "timed")])
def test_the_settings_node_turns_it_on_and_the_operators_variable_overrides_it(monkeypatch, wan, node, env, how,
                                                                               pack_log):
    """The node's option gets a timed stage (``stage_trial``); the operator's "1" a stage kept
    without the trial."""
    monkeypatch.setenv(whole_graph.ENV, env)
    stage = engine.prepare(wan.Model(n_blocks=2), settings(whole_graph=node)).whole
    assert (stage is not None) is bool(how)
    assert stage is None or (stage.trial is not None) is (how == "timed")
    # (a bad value is warned once per value and process: other tests use others)
    assert any(whole_graph.ENV in w for w in pack_log.warnings()) is (env == "now-and-then")


@contextlib.contextmanager
def _whole_compile_held(monkeypatch, model, x, t, persistent=None, release=None, **kw):
    """The stage's compile started and held on the worker inside the block (or until
    ``release`` is set): ``cm``."""
    started, release = threading.Event(), release or threading.Event()
    compile_captured = engine.CompiledModel._compile_captured

    def slow(self, *args, **kwargs):
        if not self.plan.regional:  # the whole graph's compile: hold it while the test calls
            started.set()
            assert release.wait(60)
        return compile_captured(self, *args, **kwargs)
    monkeypatch.setattr(engine.CompiledModel, "_compile_captured", slow)
    cm = engine.prepare(model, settings(**kw), persistent=persistent)
    for _ in range(3):
        run(cm, model, x, t)
    assert started.wait(60) and background.optional_running()
    try:
        yield cm
    finally:  # (also when the block fails: the next test must find the worker idle)
        release.set()
        done = cm.whole.job.done.wait(60) and background.wait_idle(60)
    assert done


def test_calls_while_it_compiles_run_the_regional_graphs_beside_it_without_waiting(
        stage_on, wan, wan_inputs, graph_count, counting_backend, monkeypatch, pack_log):
    """No compile and no scope on the sampling thread: each region call is checked ahead
    (``compile_core.beside``). A torch that cannot check guards ahead (2.8) runs them eagerly."""
    ahead = torch_compat.guard_check()
    model = wan.Model(n_blocks=2).eval()
    x, t = wan_inputs()
    with _whole_compile_held(monkeypatch, model, x, t, backend=counting_backend.name) as cm:
        runs, g, graph_runs = cm.entry.runs, graph_count(), counting_backend.runs
        for _ in range(2):
            torch.testing.assert_close(run(cm, model, x, t), eager(model, x, t))
        assert counting_backend.runs == graph_runs + 2 * 2 * ahead  # both blocks, both calls: compiled
        assert cm.entry.runs == runs + 2 * ahead and graph_count() == g
    said = [i for i in pack_log.infos() if "while" in i and "compiles in the background" in i]
    assert len(said) == 1 and "as one graph" in said[0], said  # once, not per call
    assert ("runs its compiled graphs while" in said[0]) is ahead
    assert ("cannot check its graphs' guards ahead" in said[0]) is not ahead
    run(cm, model, x, t)
    assert cm.whole.state == "ready" and cm.whole.taken == 1


def test_inside_another_compile_calls_beside_it_run_eagerly(wan, wan_inputs, counting_backend, monkeypatch,
                                                            pack_log):
    """Core's TorchCompileModel after Apply would trace the checks ahead: eager, as before."""
    torch_compat.guard_check()  # (answered: the wrapper is the only reason left)
    model = wan.Model(n_blocks=2).eval()
    x, t = wan_inputs()
    cm = engine.prepare(model, settings(backend=counting_backend.name))
    run(cm, model, x, t)
    cm.inside_other_compile = True  # (what the bridge sets when it sees such a wrapper)
    monkeypatch.setattr(background, "optional_running", lambda: True)
    monkeypatch.setattr(background.WORKER, "current", background.Job(lambda: None, "another model as one graph"))
    graph_runs = counting_backend.runs
    torch.testing.assert_close(run(cm, model, x, t), eager(model, x, t))
    assert counting_backend.runs == graph_runs
    said = [i for i in pack_log.infos() if "runs eagerly while" in i]
    assert len(said) == 1 and "another torch.compile wraps its model call" in said[0], said


def test_a_new_size_while_it_compiles_runs_eagerly_and_compiles_nothing(
        stage_on, wan, wan_inputs, graph_count, counting_backend, monkeypatch):
    model = wan.Model(n_blocks=2).eval()
    x, t = wan_inputs()
    with _whole_compile_held(monkeypatch, model, x, t, backend=counting_backend.name,
                             shape_policy="static") as cm:
        g, graph_runs = graph_count(), counting_backend.runs
        x2, t2 = wan_inputs(tokens=10)
        torch.testing.assert_close(run(cm, model, x2, t2), eager(model, x2, t2))
        assert counting_backend.runs == graph_runs and graph_count() == g  # eager, and no compile here
        assert not cm.compiling_in_background  # nothing queued for it


def test_out_of_memory_beside_the_compile_waits_for_it_and_runs_the_call_again(
        stage_on, wan, wan_inputs, monkeypatch, pack_log):
    """On a GPU the compile runs the model once beside the prompt's call (a FAKE out-of-memory
    here): the call waits for the compile and runs again alone; the prompt completes."""
    model = wan.Model(n_blocks=2).eval()
    x, t = wan_inputs()
    tries = []

    def out_of_memory(fn, device=None):
        tries.append(1)
        raise torch.OutOfMemoryError("FAKE: CUDA out of memory. Tried to allocate 2.00 GiB")
    release = threading.Event()
    with _whole_compile_held(monkeypatch, model, x, t, release=release) as cm:
        monkeypatch.setattr(background, "eager_beside_worker", out_of_memory)
        threading.Timer(0.5, release.set).start()  # the compile goes on while the call waits
        torch.testing.assert_close(run(cm, model, x, t), eager(model, x, t))
        assert not background.busy()  # it waited for the compile
    assert tries == [1]
    warnings = pack_log.warnings()
    assert len(warnings) == 1 and "ran out of memory beside a background compile" in warnings[0]


@pytest.mark.skipif(not torch_compat.load_compiled_function(), reason="no saved regions on this torch")
def test_saved_regions_run_beside_the_compile_in_variants_that_ran(stage_on, wan, wan_inputs, graph_count,
                                                                   monkeypatch, tmp_path):
    """The saved-region path (``precompiled``): a variant that has run takes the call with no
    load, trace or scope on the sampling thread (``Precompiled.takes_ready``)."""
    from compile_core import beside, precompiled
    from compile_core.persist import PersistentCache
    answers = []
    real_run = beside.StrictMiss.run
    monkeypatch.setattr(beside.StrictMiss, "run", lambda self, *a, **k: answers.append(real_run(self, *a, **k))
                        or answers[-1])
    model = wan.Model(n_blocks=2).eval()
    x, t = wan_inputs()
    with _whole_compile_held(monkeypatch, model, x, t, persistent=PersistentCache(tmp_path / "cache"),
                             backend="inductor") as cm:
        assert isinstance(cm.entry.precompiled, precompiled.Precompiled) and cm.entry.precompiled.captured
        runs, g = cm.entry.runs, graph_count()
        torch.testing.assert_close(run(cm, model, x, t), eager(model, x, t), rtol=1e-4, atol=1e-4)
        assert answers == [None, None]  # both blocks: compiled (an eager one returns its output)
        assert cm.entry.runs == runs + 1 and graph_count() == g


def test_a_model_with_graph_breaks_runs_eagerly_beside_the_compile(stage_on, wan, wan_inputs,
                                                                  counting_backend, monkeypatch, pack_log):
    """A break's resume frame is a graph the check ahead does not see: it could compile here."""
    model = wan.Model(n_blocks=2).eval()
    for block in model.blocks:
        def proj_with_a_break(a, proj=block.proj.forward):
            torch._dynamo.graph_break()
            return proj(a)
        block.proj.forward = proj_with_a_break
    x, t = wan_inputs()
    with _whole_compile_held(monkeypatch, model, x, t, backend=counting_backend.name) as cm:
        assert cm.entry.graph_breaks >= 1  # counted by the regional compile
        graph_runs = counting_backend.runs
        torch.testing.assert_close(run(cm, model, x, t), eager(model, x, t))
        assert counting_backend.runs == graph_runs
    said = [i for i in pack_log.infos() if "runs eagerly while" in i]
    assert len(said) == 1 and "its graphs have graph breaks" in said[0], said


def test_on_the_cpu_calls_while_it_compiles_run_on_a_thread_fewer(monkeypatch, wan, wan_inputs):
    """An eager call beside the compile leaves it a core (and puts the thread count back)."""
    monkeypatch.setattr(background, "optional_running", lambda: True)
    model = wan.Model(n_blocks=2).eval()
    x, t = wan_inputs()
    cm = engine.prepare(model, settings())
    run(cm, model, x, t)
    ref, runs, seen = eager(model, x, t), cm.entry.runs, []
    monkeypatch.setattr(background.WORKER, "running", lambda: True)
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda *a: (seen.append(torch.get_num_threads()), forward(*a))[1])
    threads = torch.get_num_threads()
    torch.testing.assert_close(run(cm, model, x, t), ref)
    assert cm.entry.runs == runs  # not on the compiled regions
    if threads > 1:
        assert seen == [threads - 1]
    assert torch.get_num_threads() == threads


def test_a_ready_whole_graph_waits_out_another_compile_like_any_compiled_call(stage_on, wan, wan_inputs,
                                                                               monkeypatch):
    """Its scope must not overlap a background compile's (another model's, or this model's
    new input): while the worker is busy the call takes the regular path, which waits (or,
    in background mode, runs eagerly)."""
    model, x, t, cm = _taken_once(wan, wan_inputs)
    waited = []
    monkeypatch.setattr(background, "busy", lambda: True)  # FAKE: another compile is queued
    monkeypatch.setattr(background, "wait_idle", lambda timeout=None: waited.append(1) or True)
    torch.testing.assert_close(run(cm, model, x, t), eager(model, x, t))
    assert cm.whole.taken == 1 and waited == [1]  # the regional path, after waiting


def _stance():
    from torch._dynamo import eval_frame
    return eval_frame._stance.stance


def test_after_a_taken_call_the_next_goes_straight_to_the_graph_and_a_refused_one_runs_regional(
        stage_on, wan, wan_inputs, graph_count, monkeypatch):
    """Dynamo checks the guards once: the call goes to the whole graph with misses refused; a
    refused call ran nothing of it and runs the regional graphs; then calls are checked ahead
    until one is taken again (a run at the new size pays no refusal per call)."""
    model = wan.Model(n_blocks=3).eval()
    x, t = wan_inputs()
    cm = engine.prepare(model, settings(shape_policy="static"))
    _settle_and_wait(cm, model, x, t)
    checks = []
    accepts = torch_compat.cached_graph_accepts
    monkeypatch.setattr(torch_compat, "cached_graph_accepts", lambda *a: checks.append(1) or accepts(*a))
    run(cm, model, x, t)
    assert cm.whole.taken == 1 and cm.whole.direct and len(checks) == 1  # checked ahead, taken
    torch.testing.assert_close(run(cm, model, x, t), eager(model, x, t))
    assert cm.whole.taken == 2 and cm.whole.refusals == 0 and cm.whole.direct
    assert len(checks) == 1  # straight to the graph: no check ahead
    x2, t2 = wan_inputs(tokens=10)
    g = graph_count()
    torch.testing.assert_close(run(cm, model, x2, t2), eager(model, x2, t2))
    assert cm.whole.refusals == 1 and cm.whole.regional_calls == 1 and not cm.whole.direct
    assert cm.whole.cm.entry.graphs == 1 and graph_count() == g + 1  # the regional graph of the new size
    assert _stance() == "default"
    torch.testing.assert_close(run(cm, model, x2, t2), eager(model, x2, t2))
    assert cm.whole.refusals == 1 and cm.whole.regional_calls == 2 and len(checks) == 2  # checked ahead
    for _ in range(2):
        torch.testing.assert_close(run(cm, model, x, t), eager(model, x, t))
    assert cm.whole.taken == 4 and cm.whole.direct and cm.whole.refusals == 1
    assert len(checks) == 3 and _stance() == "default"
    assert not _forward_attrs(model)


def test_nothing_goes_straight_to_the_graph_while_a_job_is_pending(stage_on, wan, wan_inputs, monkeypatch):
    """Refusing misses is process-wide: with a compile queued it is not used (the call is
    checked ahead instead), and a deferred compile does not start while it is."""
    model, x, t, cm = _taken_once(wan, wan_inputs)
    assert cm.whole.direct
    with background.quiet() as quiet:
        assert quiet
        job = background.defer(lambda: 1, "held by quiet", lambda: True)
        assert not job.done.wait(0.5)  # a deferred job does not start inside the block
    assert job.done.wait(10) and job.result == 1
    assert background.wait_idle(10)
    job = background.submit(lambda: time.sleep(0.3), "a queued compile")
    with background.quiet() as quiet:
        assert not quiet
    monkeypatch.setattr(torch_compat, "misses_refused", lambda: pytest.fail("refused while a job was pending"))
    monkeypatch.setattr(whole_graph.background, "busy", lambda: False)  # FAKE: the stage is used anyway
    checks = []
    accepts = torch_compat.cached_graph_accepts
    monkeypatch.setattr(torch_compat, "cached_graph_accepts", lambda *a: checks.append(1) or accepts(*a))
    torch.testing.assert_close(run(cm, model, x, t), eager(model, x, t))
    assert len(checks) == 1 and cm.whole.taken == 2  # checked ahead this once, and taken
    assert cm.whole.direct and cm.whole.refusals == 0  # straight again once nothing is pending
    assert job.done.wait(10)


def test_the_refusal_is_probed_where_it_is_used_not_at_start_up(stage_on, wan, wan_inputs, monkeypatch):
    """The probe sets the process-wide stance for a moment: not among the start-up probes
    (the warm-up thread), and on the sampling thread only while no job can start. Where it
    fails, the calls are checked ahead, as before."""
    assert "refusal" not in torch_compat.FEATURES
    model, x, t, cm = _taken_once(wan, wan_inputs)
    monkeypatch.setattr(torch_compat, "refusal_works", lambda: False)  # FAKE: a torch where it fails
    torch.testing.assert_close(run(cm, model, x, t), eager(model, x, t))
    assert cm.whole.taken == 2 and not cm.whole.direct and cm.whole.refusals == 0


def test_a_whole_graph_with_a_graph_break_checks_every_call_ahead(stage_on, wan, wan_inputs, monkeypatch):
    """A refusal in a frame after a break would come after the code before it had run (here a
    call counter), and the regional graphs would run it again: such a whole graph is never
    called straight, and the counter counts each call once."""
    model = wan.Model(n_blocks=2).eval()
    head, counted = model.head.forward, []

    def head_with_a_break(x):
        counted.append(1)
        torch._dynamo.graph_break()
        return head(x)
    model.head.forward = head_with_a_break
    x, t = wan_inputs()
    cm = engine.prepare(model, settings(shape_policy="static"))
    _settle_and_wait(cm, model, x, t)
    for _ in range(2):
        torch.testing.assert_close(run(cm, model, x, t), eager(model, x, t))
    assert cm.whole.state == "ready" and cm.whole.breaks >= 1 and cm.whole.taken == 2
    assert not cm.whole.direct
    monkeypatch.setattr(torch_compat, "misses_refused", lambda: pytest.fail("called straight despite a break"))
    counted.clear()
    x2, t2 = wan_inputs(tokens=10)
    torch.testing.assert_close(run(cm, model, x2, t2), eager(model, x2, t2))
    assert len(counted) == 2  # once in the call, once in eager's
    assert cm.whole.regional_calls == 1 and _forward_attrs(model) == [model.head]  # (its own, set above)


def test_a_whole_graph_that_runs_out_of_memory_is_dropped_and_the_call_runs_regional(
        stage_on, wan, wan_inputs, pack_log):
    model, x, t, cm = _taken_once(wan, wan_inputs)

    def out_of_memory(*args, **kwargs):  # FAKE: a device without room for the whole graph
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    cm.whole.cm.entry.compiled = out_of_memory
    runs = cm.entry.runs
    torch.testing.assert_close(run(cm, model, x, t), eager(model, x, t))
    assert cm.whole.state == "failed" and cm.entry.runs == runs + 1  # ran again on the regional graphs
    warnings = pack_log.warnings()
    assert len(warnings) == 1 and "ran out of memory" in warnings[0] and "2.00 GiB" in warnings[0]
    torch.testing.assert_close(run(cm, model, x, t), eager(model, x, t))
    assert cm.whole.taken == 1 and len(pack_log.warnings()) == 1 and not _forward_attrs(model)


def test_an_out_of_memory_in_the_regional_graphs_is_raised_as_it_is(stage_on, wan, wan_inputs, monkeypatch):
    """A call the whole graph did not take ran the regional graphs: their error is not the
    stage's, and running them again would not help."""
    model, x, t, cm = _taken_once(wan, wan_inputs, shape_policy="static")

    def out_of_memory(*args, **kwargs):  # FAKE: the regional graphs run out of memory
        raise torch.OutOfMemoryError("CUDA out of memory (regional)")
    monkeypatch.setattr(type(cm), "_run_compiled", out_of_memory)
    x2, t2 = wan_inputs(tokens=10)
    with pytest.raises(torch.OutOfMemoryError, match="regional"):
        run(cm, model, x2, t2)
    assert cm.whole.state == "ready"


def test_the_shared_model_is_left_as_it_is_while_the_whole_graph_compiles(stage_on, wan, wan_inputs, monkeypatch):
    """The compile traces a twin (``compile_core.twin``); the model other branches call keeps
    its own forwards for the whole compile."""
    seen = []
    real = background.Captured.modes

    def watching(self):  # entered on the worker right before the captured call is compiled
        seen.append((self.module is model, _forward_attrs(model), _forward_attrs(self.module)))
        return real(self)
    monkeypatch.setattr(background.Captured, "modes", watching)
    model = wan.Model(n_blocks=2).eval()
    x, t = wan_inputs()
    cm = engine.prepare(model, settings())
    _settle_and_wait(cm, model, x, t)
    traced_on, on_model, on_twin = seen[-1]  # the whole graph's compile
    assert not traced_on and not on_model and len(on_twin) == 2  # the twin's blocks, nested
    torch.testing.assert_close(run(cm, model, x, t), eager(model, x, t))
    assert cm.whole.state == "ready" and cm.whole.cm.entry.graphs == 1 and cm.whole.taken == 1  # the twin's graph takes the shared model's call


def test_a_forward_someone_else_sets_during_a_call_is_kept(wan):
    model = wan.Model(n_blocks=2)
    nested, theirs = whole_graph.NestedBlocks(), (lambda *a: None)
    with nested.attached(list(model.blocks)):
        model.blocks[0].__dict__["forward"] = theirs
    assert model.blocks[0].__dict__["forward"] is theirs and "forward" not in model.blocks[1].__dict__
