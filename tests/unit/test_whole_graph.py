"""The whole-graph stage (``compile_core.whole_graph``, experimental, issue #16): once a regional
compile has settled, the whole model is compiled as one graph (blocks nested) in the background
and takes the calls its guards accept; every other call runs the regional graphs."""
import pytest
import torch

from compile_core import background, engine, whole_graph
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


def test_calls_while_it_compiles_run_eagerly_beside_it_without_waiting(stage_on, wan, wan_inputs, graph_count,
                                                                      monkeypatch):
    """No scope of the sampling thread may overlap the worker's: restored out of order, the
    two would leave the cache folder set. So the calls run eagerly (the server was idle when
    the compile started; a prompt that comes meanwhile is the rare case)."""
    import threading
    started, release = threading.Event(), threading.Event()
    compile_captured = engine.CompiledModel._compile_captured

    def slow(self, *args, **kwargs):
        if not self.plan.regional:  # the whole graph's compile: hold it while the test calls
            started.set()
            assert release.wait(60)
        return compile_captured(self, *args, **kwargs)
    monkeypatch.setattr(engine.CompiledModel, "_compile_captured", slow)
    model = wan.Model(n_blocks=2).eval()
    x, t = wan_inputs()
    cm = engine.prepare(model, settings())
    for _ in range(3):
        run(cm, model, x, t)
    assert started.wait(60) and background.optional_running()
    runs, g = cm.entry.runs, graph_count()
    try:
        torch.testing.assert_close(run(cm, model, x, t), eager(model, x, t))
    finally:
        release.set()
    assert cm.entry.runs == runs and graph_count() == g  # eagerly: not on its compiled regions
    assert cm.whole.job.done.wait(60) and background.wait_idle(60)
    run(cm, model, x, t)
    assert cm.whole.state == "ready" and cm.whole.taken == 1


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
    model = wan.Model(n_blocks=2).eval()
    x, t = wan_inputs()
    cm = engine.prepare(model, settings())
    _settle_and_wait(cm, model, x, t)
    run(cm, model, x, t)
    assert cm.whole.taken == 1
    waited = []
    monkeypatch.setattr(background, "busy", lambda: True)  # FAKE: another compile is queued
    monkeypatch.setattr(background, "wait_idle", lambda timeout=None: waited.append(1) or True)
    torch.testing.assert_close(run(cm, model, x, t), eager(model, x, t))
    assert cm.whole.taken == 1 and waited == [1]  # the regional path, after waiting
