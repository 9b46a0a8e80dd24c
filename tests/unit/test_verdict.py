"""compile_core.run.verdict: a model whose compiled steps are not faster than its eager ones runs
eagerly, the verdict kept with its saved work and shared with the fleet.

Verdicts are made on CUDA only; here the CPU stands in for a GPU (``verdict.DEVICES`` gets
``"cpu"``: a fake of the device, nothing else). The models are real: their blocks do extra work
only when compiled (``slow="compiled"``: output-neutral matmuls inside the graph) or only
eagerly (``slow="eager"``: a sleep that dynamo leaves out of the graph), so the timings are
what the calls really take.
"""
from __future__ import annotations

import json
import time

import pytest
import torch
from torch import nn

from compile_core.cache.fleet import Fleet
from compile_core.cache.fleet_stores import DirStore
from compile_core.cache.persist import PersistentCache
from compile_core.cache.registry import ReuseRegistry
from compile_core.report.status import status_payload
from compile_core.run import engine, verdict

from tcs_engine_helpers import eager, run, settings
from tcs_toy_models import own_code


@pytest.fixture
def gpu_standin(monkeypatch):
    """FAKE: the CPU stands in for the CUDA device verdicts are made on."""
    monkeypatch.setattr(verdict, "DEVICES", ["cuda", "cpu"])


def make_model(slow: str, n_blocks: int = 3):
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 16)
            self.register_buffer("heavy", torch.randn(256, 256) / 16)

        def forward(self, x):
            if torch.compiler.is_compiling() == (slow == "compiled"):
                if slow == "eager":
                    time.sleep(0.01)
                else:
                    y = self.heavy
                    for _ in range(40):
                        y = y @ self.heavy
                    x = x + 0.0 * y.sum()
            return self.lin(x)

    class WanModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(n_blocks))

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    own_code(Block, WanModel)
    return WanModel().eval()


def steps(cm, model, x, n):
    """``n`` sampler steps, each checked against eager."""
    for _ in range(n):
        torch.testing.assert_close(run(cm, model, x), eager(model, x))


def test_a_model_not_faster_compiled_runs_eagerly_after_its_pairs_and_says_so_once(gpu_standin, pack_log):
    model, x = make_model("compiled"), torch.randn(2, 8, 16)
    cm = engine.prepare(model, settings(), registry=ReuseRegistry())
    steps(cm, model, x, 1)  # compiles
    assert cm.entry.graphs >= 1 and cm.entry.slower == ""
    steps(cm, model, x, 2 * verdict.PAIRS)
    t = cm.entry.trial
    assert t.decided and len(t.ratios) == verdict.PAIRS and min(t.ratios) > 1.0, t.ratios
    assert "compiled steps took" in cm.entry.slower
    assert status_payload(cm)["state"] == "eager-slower"
    runs = cm.entry.runs
    steps(cm, model, x, 3)
    assert cm.entry.runs == runs  # no compiled call after the verdict
    said = [w for w in pack_log.warnings() if "runs eagerly from now on" in w]
    assert len(said) == 1 and "x the time of its eager ones" in said[0], pack_log.warnings()


def test_a_model_faster_compiled_stays_compiled(gpu_standin, pack_log):
    model, x = make_model("eager"), torch.randn(2, 8, 16)
    cm = engine.prepare(model, settings(), registry=ReuseRegistry())
    steps(cm, model, x, 1 + 2 * verdict.PAIRS)
    t = cm.entry.trial
    assert t.decided and max(t.ratios) < 1.0 and cm.entry.slower == "", t.ratios
    runs = cm.entry.runs
    steps(cm, model, x, 2)
    assert cm.entry.runs == runs + 2  # compiled calls go on
    assert status_payload(cm)["state"] != "eager-slower"
    assert any("stays compiled" in m for m in pack_log.infos()), pack_log.infos()


def test_on_the_cpu_no_verdict_is_made():
    model, x = make_model("compiled"), torch.randn(2, 8, 16)
    cm = engine.prepare(model, settings(), registry=ReuseRegistry())
    steps(cm, model, x, 1 + 2 * verdict.PAIRS)
    assert cm.entry.trial is None and cm.entry.slower == ""
    assert cm.entry.runs == 1 + 2 * verdict.PAIRS


def test_a_pair_whose_compiled_call_compiled_is_not_counted(gpu_standin):
    model = make_model("compiled")
    cm = engine.prepare(model, settings(shape_policy="static"), registry=ReuseRegistry())
    steps(cm, model, torch.randn(2, 8, 16), 2)  # the compile, then a pair's eager call
    graphs = cm.entry.graphs
    steps(cm, model, torch.randn(2, 12, 16), 1)  # its compiled call: a new size compiles
    assert cm.entry.graphs > graphs
    assert cm.entry.trial.ratios == [] and cm.entry.trial.half == {}


def test_the_verdict_is_kept_and_a_restart_runs_eagerly_without_compiling(gpu_standin, tmp_path,
                                                                         graph_count, pack_log):
    model, x = make_model("compiled"), torch.randn(2, 8, 16)
    cache = PersistentCache(tmp_path / "cache")
    cm = engine.prepare(model, settings(), registry=ReuseRegistry(), persistent=cache)
    steps(cm, model, x, 1 + 2 * verdict.PAIRS)
    assert cm.entry.slower
    saved = json.loads((cache.entry_dir(cm.fingerprint) / verdict.FILE).read_text())
    assert saved["cpu"]["eager"] is True and saved["cpu"]["torch"] == torch.__version__

    restarted = engine.prepare(model, settings(), registry=ReuseRegistry(), persistent=cache)
    g0 = graph_count()
    steps(restarted, model, x, 2)
    assert graph_count() == g0 and restarted.entry.runs == 0  # nothing compiled, nothing measured
    assert status_payload(restarted)["state"] == "eager-slower"
    assert any("runs eagerly without compiling" in m for m in pack_log.infos())


def test_a_verdict_of_another_card_or_torch_or_a_damaged_file_is_measured_again(gpu_standin, tmp_path,
                                                                              pack_log):
    model, x = make_model("compiled"), torch.randn(2, 8, 16)
    cache = PersistentCache(tmp_path / "cache")
    cm = engine.prepare(model, settings(), registry=ReuseRegistry(), persistent=cache)
    path = cache.entry_dir(cm.fingerprint) / verdict.FILE
    path.parent.mkdir(parents=True)
    for content in (json.dumps({"cpu": {"card": "cpu", "torch": "1.0", "eager": True, "ratio": 2.0}}),
                    json.dumps({"other": {"card": "other", "torch": torch.__version__, "eager": True}}),
                    "{not json"):
        path.write_text(content)
        again = engine.prepare(model, settings(), registry=ReuseRegistry(), persistent=cache)
        steps(again, model, x, 1)
        assert again.entry.slower == "" and again.entry.runs == 1, content  # it compiled
    assert any("could not be read" in m for m in pack_log.infos())


def test_a_fleet_worker_on_the_same_card_gets_the_verdict(gpu_standin, tmp_path, graph_count):
    model, x = make_model("compiled"), torch.randn(2, 8, 16)
    store = DirStore(tmp_path / "store")
    first = engine.prepare(model, settings(), registry=ReuseRegistry(),
                           persistent=PersistentCache(tmp_path / "a"), fleet=Fleet(store, secret=b"k"))
    steps(first, model, x, 1 + 2 * verdict.PAIRS)
    assert first.entry.slower
    second = engine.prepare(model, settings(), registry=ReuseRegistry(),
                            persistent=PersistentCache(tmp_path / "b"), fleet=Fleet(store, secret=b"k"))
    g0 = graph_count()
    steps(second, model, x, 2)
    assert graph_count() == g0 and second.entry.slower and second.entry.runs == 0


def test_in_background_mode_the_pairs_start_after_the_swap(gpu_standin):
    from compile_core.run import background
    model, x = make_model("compiled"), torch.randn(2, 8, 16)
    cm = engine.prepare(model, settings(background_compile=True), registry=ReuseRegistry())
    steps(cm, model, x, 1)  # eagerly, the compile queued
    assert background.wait_idle(timeout=120)
    steps(cm, model, x, 1)  # the swap: the first compiled call is not timed
    assert cm.swapped_at == 2 and cm.entry.trial.ratios == [] and not cm.entry.trial.half
    assert background.wait_idle(timeout=120)  # (a compile it queued: no pair is timed beside it)
    for _ in range(2 * verdict.PAIRS + 4):  # (a call that swaps in a queued compile is no pair's)
        steps(cm, model, x, 1)
        if cm.entry.trial.decided:
            break
    assert cm.entry.trial.decided and len(cm.entry.trial.ratios) == verdict.PAIRS and cm.entry.slower
