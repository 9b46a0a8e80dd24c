"""The whole-graph stage's trial (``compile_core.stage_trial``): on by default (the settings
node's ``whole_graph``), its first calls take turns with the regional graphs', timed, and the
whole graph stays only if it is not slower. The slow side is made slow for real (a sleep added
to its calls), so the timing the trial reads is the time the calls took."""
import time

import pytest
import torch

from compile_core import background, engine, stage_trial, status, whole_graph
from tcs_engine_helpers import eager, run, settings

CALLS = 2 * stage_trial.SAMPLES + 1  # the whole graph's first call, then both kinds taking turns


def test_the_turns_and_the_verdict():
    trial = stage_trial.Trial()
    order, seconds = [], {True: 0.010, False: 0.011}
    while not trial.done:
        whole = not trial.regional_turn()
        order.append("W" if whole else "R")
        trial.add(whole, seconds[whole])
    assert "".join(order) == "W" + "RW" * stage_trial.SAMPLES
    assert trial.keep and trial.report() == {"whole_ms": 10.0, "regional_ms": 11.0, "ratio": 0.909}


@pytest.mark.parametrize("whole_ms, regional_ms, keep", [(10.0, 10.0, True), (10.1, 10.0, True),
                                                         (10.5, 10.0, False), (12.0, 10.0, False)])
def test_the_whole_graph_stays_unless_it_is_slower_than_the_margin(whole_ms, regional_ms, keep):
    trial = stage_trial.Trial()
    trial.add(True, 1.0)  # the first call loads kernels: not counted
    for _ in range(stage_trial.SAMPLES):
        trial.add(False, regional_ms / 1e3)
        trial.add(True, whole_ms / 1e3)
    assert trial.done and trial.keep is keep


def test_the_timer_waits_for_the_device(monkeypatch):
    """On CUDA a call returns before its kernels end: the timer synchronizes before and after
    (FAKE synchronize: no GPU here)."""
    events = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append(("sync", str(device))))
    out, secs = stage_trial.Trial.timed(torch.device("cuda:0"), lambda: events.append("call") or 7)
    assert out == 7 and events == [("sync", "cuda:0"), "call", ("sync", "cuda:0")]
    out, secs = stage_trial.Trial.timed(torch.device("cpu"), lambda: time.sleep(0.02) or 8)
    assert out == 8 and 0.02 <= secs < 1.0 and len(events) == 3  # the CPU has nothing to wait for


def _ready(monkeypatch, wan, wan_inputs):
    """A 3-block model under the node's default stage (timed), its whole graph compiled."""
    monkeypatch.delenv(whole_graph.ENV, raising=False)
    model = wan.Model(n_blocks=3).eval()
    x, t = wan_inputs()
    cm = engine.prepare(model, settings(whole_graph=True))
    for _ in range(3):
        run(cm, model, x, t)
    assert cm.whole.state == "queued" and cm.whole.trial is not None
    assert cm.whole.job.done.wait(60) and background.wait_idle(60)
    return model, x, t, cm


def _slow(monkeypatch, owner, name, seconds, when=lambda self: True):
    real = getattr(owner, name)

    def slower(self, *args, **kwargs):
        if when(self):
            time.sleep(seconds)
        return real(self, *args, **kwargs)
    monkeypatch.setattr(owner, name, slower)


def test_a_whole_graph_faster_than_the_regional_graphs_stays(monkeypatch, wan, wan_inputs, graph_count, pack_log):
    model, x, t, cm = _ready(monkeypatch, wan, wan_inputs)
    # the regional graphs made slower while the trial times them
    _slow(monkeypatch, engine.CompiledModel, "_run_compiled", 0.05,
          lambda self: self.whole is not None and self.whole.state == "ready")
    g = graph_count()
    for _ in range(CALLS):
        torch.testing.assert_close(run(cm, model, x, t), eager(model, x, t))
    stage = cm.whole
    assert stage.state == "ready" and stage.trial.done and stage.trial.keep
    assert stage.taken == stage_trial.SAMPLES + 1 and stage.regional_calls == 0
    assert stage.trial.report()["regional_ms"] >= 50
    report = status.status_payload(cm)["whole_graph"]
    assert report["trial"] == stage.trial.report() and report["timing"] is False
    run(cm, model, x, t)
    assert stage.taken == stage_trial.SAMPLES + 2 and graph_count() == g  # nothing compiled
    assert any("so the whole graph takes the calls its guards accept from now on" in i
               for i in pack_log.infos())


def test_a_whole_graph_slower_than_the_regional_graphs_is_let_go(monkeypatch, wan, wan_inputs, graph_count,
                                                               pack_log):
    model, x, t, cm = _ready(monkeypatch, wan, wan_inputs)
    _slow(monkeypatch, whole_graph.WholeGraph, "_run_whole", 0.05)
    for i in range(CALLS):
        torch.testing.assert_close(run(cm, model, x, t), eager(model, x, t))
        assert status.status_payload(cm)["whole_graph"]["timing"] is (i < CALLS - 1)
    stage = cm.whole
    assert stage.state == "slower" and stage.cm is None and stage.trial.ratio > stage_trial.SLOWER
    assert status.status_payload(cm)["whole_graph"]["state"] == "slower"
    taken, g = stage.taken, graph_count()
    for _ in range(3):  # from now on the regional graphs run every call
        torch.testing.assert_close(run(cm, model, x, t), eager(model, x, t))
    assert stage.taken == taken and graph_count() == g
    assert any("the whole graph is slower here, so it is let go" in i for i in pack_log.infos())
    assert not pack_log.warnings()


def test_a_regional_turn_that_compiles_is_not_timed(monkeypatch, wan, wan_inputs):
    """A regional call that compiled (here: a new size under static shapes) took the compile's
    time, not a step's: the trial leaves it out and times the next regional call instead."""
    monkeypatch.delenv(whole_graph.ENV, raising=False)
    model = wan.Model(n_blocks=2).eval()
    x, t = wan_inputs()
    cm = engine.prepare(model, settings(whole_graph=True, shape_policy="static"))
    for _ in range(3):
        run(cm, model, x, t)
    assert cm.whole.job.done.wait(60) and background.wait_idle(60)
    run(cm, model, x, t)  # the whole graph's first call (not timed)
    x2, t2 = wan_inputs(tokens=10)
    graphs = cm.entry.graphs
    torch.testing.assert_close(run(cm, model, x2, t2), eager(model, x2, t2))  # a regional turn: compiles
    assert cm.entry.graphs == graphs + 1 and cm.whole.trial.regional == []
    run(cm, model, x, t)  # still the regional graphs' turn
    assert len(cm.whole.trial.regional) == 1 and cm.whole.trial.whole == []
