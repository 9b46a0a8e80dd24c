"""A compiled model call that raises what the eager call does not ends in an eager run of that
call, with one message, and the model stays eager (``api.run_model_call``)."""
from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from compile_core import api
from compile_core.run import engine
from compile_core.cache.registry import ReuseRegistry
from compile_core.torch_support import scoped
from tcs_engine_helpers import CPU, settings


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return x + self.lin(x)


class Model(nn.Module):
    def __init__(self, fail_eager=False):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.calls, self.fail_eager = 0, fail_eager

    def forward(self, x):
        self.calls += 1
        if self.fail_eager:
            raise ValueError("the model's own error")
        for b in self.blocks:
            x = b(x)
        return x


class Interrupted(Exception):
    """Stands in for the host's interrupt (an Exception on ComfyUI 0.3.75)."""


@pytest.fixture
def runtime_failure_backend():
    """A backend whose graphs compile fine and raise when they run, as the compiled clone's
    call did under dynamic VRAM ("mat1 and mat2 must have the same dtype"); raised from this
    module, so it is no compile failure the regions fall back from on their own."""
    ran = []

    def backend(gm, example_inputs):
        def fails(*args):
            ran.append(1)
            raise RuntimeError("mat1 and mat2 must have the same dtype, but got Half and Float")
        return fails
    torch._dynamo.reset()
    yield backend, ran
    torch._dynamo.reset()


def _compiled(model, backend):
    s = settings()
    cm = engine.prepare(model, s, registry=ReuseRegistry())
    with scoped.scoped_state():  # torch 2.8's torch.compile() sets TORCHINDUCTOR_CACHE_DIR
        cm.state.entry.compiled = torch.compile(nn.Module._call_impl, backend=backend)
    return cm


def _call(cm, model, x, passthrough=()):
    def eager():
        return model(x)
    with torch.no_grad():
        return api.run_model_call(cm, lambda: cm.run(model, eager, CPU), eager, passthrough)


def test_a_compiled_call_that_raises_runs_eagerly_once_and_the_model_stays_eager(runtime_failure_backend, caplog):
    backend, ran = runtime_failure_backend
    model, x = Model(), torch.randn(2, 8)
    with torch.no_grad():
        want = model(x)
    cm = _compiled(model, backend)
    model.calls = 0
    with caplog.at_level(logging.WARNING, logger="TorchCompileSpeed"):
        out = _call(cm, model, x)
        assert ran and torch.equal(out, want) and model.calls == 2  # compiled (raised), then eager
        ran.clear()
        again = _call(cm, model, x)
    assert torch.equal(again, want) and not ran and model.calls == 3  # eager at once: no compiled call
    assert "mat1 and mat2" in cm.entry.failed
    said = [r.getMessage() for r in caplog.records if "ran again, eagerly" in r.getMessage()]
    assert len(said) == 1 and "mat1 and mat2" in said[0], said


def test_an_error_the_eager_call_raises_too_is_the_models_own(runtime_failure_backend):
    backend, _ = runtime_failure_backend
    model = Model(fail_eager=True)
    cm = _compiled(model, backend)
    with pytest.raises(ValueError, match="the model's own error"):
        _call(cm, model, torch.randn(2, 8))


def test_the_hosts_interrupt_propagates_without_an_eager_run(runtime_failure_backend):
    backend, _ = runtime_failure_backend
    model, x = Model(), torch.randn(2, 8)
    cm = _compiled(model, backend)

    def interrupted():
        raise Interrupted()
    model.calls = 0
    with pytest.raises(Interrupted):
        api.run_model_call(cm, interrupted, lambda: model(x), (Interrupted,))
    assert model.calls == 0 and not cm.entry.failed
