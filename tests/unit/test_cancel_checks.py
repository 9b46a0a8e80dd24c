"""The pure torch side of cancelling: the host's cancel check (``check_interrupt``, ComfyUI's
``throw_exception_if_processing_interrupted`` in the node) stops the Diagnostics measuring
loop between model calls, and whatever it raises propagates (an ``Exception`` subclass, as in
ComfyUI 0.3.75, as well as a ``BaseException`` one, as in 0.33)."""
from __future__ import annotations

import pytest
import torch

from compile_core.diagnose import diagnostics
from compile_core.run import engine
from compile_core.report import timing
from compile_core.plan.settings import CompileSettings, build_compile_args

CPU = torch.device("cpu")


class Cancel075(Exception):  # ComfyUI 0.3.75's InterruptProcessingException base
    pass


class Cancel033(BaseException):  # ComfyUI 0.33's
    pass


def cancel_after(n_checks, exc):
    """A check that passes ``n_checks`` times, then raises ``exc`` (the user pressed cancel)."""
    state = {"checks": 0}

    def check():
        state["checks"] += 1
        if state["checks"] > n_checks:
            raise exc()
    return check, state


@pytest.mark.parametrize("exc", [Cancel075, Cancel033])
def test_measure_checks_the_interrupt_before_every_call(exc):
    calls = []
    check, state = cancel_after(3, exc)  # eager warm-up, compiled warm-up, 1st measured call
    with pytest.raises(exc):
        timing.measure(lambda: calls.append("e"), lambda: calls.append("c"), runs=20,
                       check_interrupt=check)
    assert len(calls) == 3 and state["checks"] == 4


def test_measure_without_a_check_is_unchanged():
    calls = []
    t = timing.measure(lambda: calls.append("e"), lambda: calls.append("c"), runs=3)
    assert len(calls) == 8 and len(t.eager_ms) == len(t.compiled_ms) == 3


@pytest.mark.parametrize("exc", [Cancel075, Cancel033])
def test_diagnose_stops_measuring_at_a_cancel(wan, wan_inputs, exc):
    model = wan.Model(n_blocks=2, dim=32)
    x, t = wan_inputs()
    cm = engine.prepare(model, CompileSettings.from_args(
        build_compile_args(backend="aot_eager", mode="default", background_compile=False)))
    calls = []

    def eager():
        calls.append("e")
        with torch.no_grad():
            return model(x, t)

    def compiled():
        calls.append("c")
        with torch.no_grad():
            return cm.run(model, lambda: model(x, t), CPU)

    check, _ = cancel_after(4, exc)  # cancelled after the 1st measured call of each
    with pytest.raises(exc):
        diagnostics.diagnose(cm, model, eager, compiled, runs=10, device=CPU,
                             reraise=(Cancel075,), check_interrupt=check)
    # the capture call, then warm-ups and one measured round: nothing after the cancel
    assert calls == ["e", "e", "c", "e", "c"], calls
    assert not any("_compiled_call_impl" in m.__dict__ for m in model.modules())
