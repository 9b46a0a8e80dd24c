"""ComfyUI's memory compiler (``comfy.model_prefetch``, after 0.33) paused around a compile on
the calling thread. Its malloc graph needs CUDA and comfy-aimdo, so ``FakePrefetch`` (a FAKE of
the module's two public functions) stands in for it; the engine's side runs for real."""
import contextlib
import importlib.util
import types
from pathlib import Path

import torch

from compile_core.run import engine
from tcs_engine_helpers import eager, run, settings

_SPEC = importlib.util.spec_from_file_location(
    "tcs_memory_compiler", Path(__file__).resolve().parents[2] / "nodes" / "memory_compiler.py")
memory_compiler = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(memory_compiler)


class FakePrefetch(types.SimpleNamespace):
    """FAKE ``comfy.model_prefetch``: ``malloc_graph_enabled(device)`` and ``pause_malloc_graph()``."""

    def __init__(self, enabled):
        super().__init__(paused=[], asked=[])
        self._enabled = enabled

    def malloc_graph_enabled(self, device):
        self.asked.append(device)
        return self._enabled

    @contextlib.contextmanager
    def pause_malloc_graph(self, sync=False):
        self.paused.append("enter")
        yield
        self.paused.append("exit")


def test_the_graph_is_paused_only_where_comfyui_says_it_records():
    on, off = FakePrefetch(True), FakePrefetch(False)
    with memory_compiler.paused("cuda:0", on):
        assert on.paused == ["enter"]
    assert on.paused == ["enter", "exit"] and on.asked == ["cuda:0"]
    with memory_compiler.paused("cuda:0", off):
        pass
    assert off.paused == [] and off.asked == ["cuda:0"]


def test_without_the_memory_compiler_it_is_a_no_op():
    with memory_compiler.paused("cpu", types.SimpleNamespace()):  # a module without the functions
        pass
    with memory_compiler.paused("cpu"):  # no comfy.model_prefetch importable here
        pass


def test_the_first_compiled_call_runs_inside_the_host_context_and_later_calls_do_not(wan, wan_inputs, graph_count):
    model = wan.Model(n_blocks=2).eval()
    x, t = wan_inputs()
    cm = engine.prepare(model, settings(), engine.ReuseRegistry())
    fake, inside = FakePrefetch(True), []
    cm.state.compile_context = lambda device: _recording(memory_compiler.paused(device, fake), inside, graph_count)
    g0 = graph_count()
    torch.testing.assert_close(run(cm, model, x, t), eager(model, x, t))
    assert fake.paused == ["enter", "exit"] and graph_count() > g0
    assert inside == [graph_count() - g0]  # the whole compile happened while paused
    run(cm, model, x, t)
    assert fake.paused == ["enter", "exit"] and len(inside) == 1


@contextlib.contextmanager
def _recording(ctx, inside, graph_count):
    g0 = graph_count()
    with ctx:
        yield
        inside.append(graph_count() - g0)
