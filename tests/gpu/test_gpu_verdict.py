"""The defaults never lose, on the GPU (``compile_core.run.verdict``): with the settings node's
defaults, a model's own steps after the swap time compiled against eager, and a model whose
compiled blocks are slower runs eagerly. Skipped without CUDA (see ``conftest.py``)."""
from __future__ import annotations

import os
import statistics

import pytest
import torch

from compile_core.cache.registry import ReuseRegistry
from compile_core.plan.settings import CompileSettings, build_compile_args
from compile_core.run import background, engine, verdict

from test_verdict import make_model

pytestmark = pytest.mark.skipif(os.environ.get("TCS_GPU_TEST_DEVICE", "cuda") != "cuda",
                                reason="verdicts are made on CUDA only")


def steps(cm, model, x, n, device):
    for _ in range(n):
        with torch.no_grad():
            out = cm.run(model, lambda: model(x), device)
            ref = model(x)
        torch.testing.assert_close(out, ref, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("slow", ["compiled", "eager"])
def test_node_defaults_judge_compiled_against_eager_on_the_models_own_steps(slow, device):
    model, x = make_model(slow).to(device), torch.randn(2, 8, 16, device=device)
    cm = engine.prepare(model, CompileSettings.from_args(build_compile_args()), registry=ReuseRegistry())
    steps(cm, model, x, 1, device)
    assert background.wait_idle(timeout=600)
    steps(cm, model, x, 1, device)  # the swap
    assert background.wait_idle(timeout=600)  # (a compile it queued: no pair is timed beside it)
    t = cm.entry.trial
    for _ in range(2 * verdict.PAIRS + 4):  # (a call that swaps in a queued compile is no pair's)
        steps(cm, model, x, 1, device)
        if t.decided:
            break
    assert cm.swapped_at == 2 and not cm.entry.failed and t.decided, t
    ratio = statistics.median(t.ratios)
    assert bool(cm.entry.slower) == (ratio >= 1.0), (ratio, cm.entry.slower)
    assert bool(cm.entry.slower) == (slow == "compiled"), t.ratios
