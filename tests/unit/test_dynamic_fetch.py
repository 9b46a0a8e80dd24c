"""Dynamic VRAM fetched in the graph (``nodes/dynamic_fetch.py`` through ``nodes/weight_routing``,
``compile_core.torch_support.layer_fetch``): a block whose ComfyUI layers fetch their weights
through comfy-aimdo compiles as one graph for every block, with eager's values, LoRA strength
changes included; without the routing the same fetch splits the graph.

The layer classes are FAKES of ComfyUI 0.33's ops: their source is compiled as module
``comfy.ops`` (what the routing recognises), with ComfyUI's method shapes
(``forward_comfy_cast_weights`` under ``CastBiasWeightContext(self, input, offloadable=True)``).
Their ``CastBiasWeightContext`` is a FAKE of the dynamic-VRAM fetch: a ctypes call (as
comfy-aimdo's ``vbar_fault``, a graph break), then the weight cast to the input's dtype with the
layer's ``weight_function`` (LoRA) applied, and a release on exit that counts."""
from __future__ import annotations

import ctypes
import gc
import json
import subprocess
import sys
import textwrap
import types
import weakref
from pathlib import Path

import pytest
import torch

from compile_core.torch_support import aot, layer_fetch, scoped
from test_weight_fetch import LowVramPatch, fresh_fn, routing  # noqa: F401 - fixture

_libc = ctypes.CDLL(None)

FAKE_COMFY_OPS = textwrap.dedent('''
    import torch

    class CastBiasWeightContext:  # FAKE: comfy-aimdo's fetch, then ComfyUI's cast and patches
        released = 0

        def __init__(self, s, input, offloadable=False):
            self.s, self.input = s, input

        def __enter__(self):
            FAKE_VBAR_FAULT()
            w = self.s.weight.to(self.input.dtype, copy=True)
            for f in self.s.weight_function:
                w = f(w)
            bias = getattr(self.s, "bias", None)
            b = None if bias is None else bias.to(self.input.dtype, copy=True)
            return w, b

        def __exit__(self, *exc):
            type(self).released += 1

    class CastWeightBiasOp:
        comfy_cast_weights = False
        weight_function = []
        bias_function = []

    class disable_weight_init:
        class Linear(torch.nn.Linear, CastWeightBiasOp):
            def forward_comfy_cast_weights(self, input):
                with CastBiasWeightContext(self, input, offloadable=True) as (weight, bias):
                    return torch.nn.functional.linear(input, weight, bias)

            def forward(self, *args, **kwargs):
                if self.comfy_cast_weights or len(self.weight_function) > 0:
                    return self.forward_comfy_cast_weights(*args, **kwargs)
                return super().forward(*args, **kwargs)

        class RMSNorm(torch.nn.RMSNorm, CastWeightBiasOp):
            def forward_comfy_cast_weights(self, input):
                with CastBiasWeightContext(self, input, offloadable=True) as (weight, bias):
                    return torch.nn.functional.rms_norm(input, self.normalized_shape, weight, self.eps)

            def forward(self, *args, **kwargs):
                if self.comfy_cast_weights or len(self.weight_function) > 0:
                    return self.forward_comfy_cast_weights(*args, **kwargs)
                return super().forward(*args, **kwargs)
''')


@pytest.fixture
def ops(monkeypatch):
    """The FAKE ``comfy.ops`` module, in sys.modules while the test runs (dynamo imports a traced
    function's module by name)."""
    return install_fake_ops(monkeypatch.setitem)


def install_fake_ops(setitem):
    """``ops``' work, with ``setitem(sys.modules, name, module)`` (a monkeypatch's, or a plain one
    in a child process)."""
    setitem(sys.modules, "comfy", types.ModuleType("comfy"))
    mod = types.ModuleType("comfy.ops")
    setitem(sys.modules, "comfy.ops", mod)
    mod.FAKE_VBAR_FAULT = _libc.getpid  # FAKE stand-in for comfy-aimdo's lib.vbar_fault (a _FuncPtr)
    exec(compile(FAKE_COMFY_OPS, "<fake comfy.ops>", "exec"), mod.__dict__)
    return mod


@pytest.fixture
def fetch_op(monkeypatch):
    """The op, with the operator's switch on (``TORCH_COMPILE_SPEED_DYNAMIC_VRAM_FETCH=1``)."""
    if not layer_fetch.available():
        pytest.skip(f"tcs::layer_fetch does not work on torch {torch.__version__}")
    monkeypatch.setenv("TORCH_COMPILE_SPEED_DYNAMIC_VRAM_FETCH", "1")
    return layer_fetch


def _model(ops, fresh_code, streamed=True):
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = ops.disable_weight_init.Linear(8, 8), ops.disable_weight_init.Linear(8, 8)
            self.norm = ops.disable_weight_init.RMSNorm(8, eps=1e-6)

        def forward(self, x):
            return self.b(torch.relu(self.norm(self.a(x))))

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([Block(), Block()])
    fresh_code(Block, Model)
    torch.manual_seed(0)
    model = Model()
    for m in model.modules():
        if isinstance(m, ops.CastWeightBiasOp):
            m.comfy_cast_weights = True
            if streamed:
                m._v = ("FAKE vbar",)  # comfy-aimdo's allocation marks a streamed layer
            if m.weight is not None:
                torch.nn.init.normal_(m.weight, 1.0, 0.1)
    return model


class _Plan:
    def modules(self, model):
        return list(model.blocks)


class _Count:
    def __init__(self):
        self.graphs, self.breaks = 0, 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return gm.forward


def _call(blk, x):
    return blk(x)


def _run(model, x, compiled=None):
    for blk in model.blocks:
        x = compiled(blk, x) if compiled else blk(x)
    return x


def test_streamed_layers_compile_to_one_graph_with_eager_values_and_are_put_back(ops, fresh_code, fetch_op,
                                                                                 routing):
    model, x = _model(ops, fresh_code), torch.randn(3, 8)
    count = _Count()
    with scoped.scoped_state():  # torch 2.8's torch.compile() sets TORCHINDUCTOR_CACHE_DIR
        compiled = torch.compile(fresh_fn(_call), backend=count, fullgraph=True)  # fullgraph: no break
    before = {id(m): dict(m.__dict__) for m in model.modules()}
    with torch.no_grad():
        eager = _run(model, x)
        released = ops.CastBiasWeightContext.released
        with routing.routed(model, _Plan()) as routed:
            out = _run(model, x, compiled)
            again = _run(model, x, compiled)
    assert routed and count.graphs == 1  # both blocks, both calls
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
    torch.testing.assert_close(again, eager, rtol=0, atol=0)
    # each of the 6 layers fetched (and released) through ComfyUI's context at each of 2 calls
    assert ops.CastBiasWeightContext.released - released == 12
    assert {id(m): dict(m.__dict__) for m in model.modules()} == before


def test_a_routed_model_is_freed_once_the_run_ends(ops, fresh_code, fetch_op, routing):
    """The stand-ins refer to their layers strongly while routed; after the run nothing the
    routing or the op's registry keeps holds the model."""
    model, x = _model(ops, fresh_code), torch.randn(3, 8)
    with torch.no_grad(), routing.routed(model, _Plan()) as routed:
        _run(model, x)
        assert routed and isinstance(model.blocks[0].a.__dict__["forward_comfy_cast_weights"].layer,
                                     torch.nn.Module)
    gone = [weakref.ref(m) for m in model.modules()]
    del model
    gc.collect()
    assert all(ref() is None for ref in gone)


def test_a_lora_strength_under_dynamic_vram_is_data_not_a_recompile(ops, fresh_code, fetch_op, routing):
    model, x = _model(ops, fresh_code), torch.randn(3, 8)
    count = _Count()
    with scoped.scoped_state():
        compiled = torch.compile(fresh_fn(_call), backend=count, fullgraph=True)
    delta = torch.randn(8, 8) * 0.1
    for strength in (1.0, 0.5, -0.7):
        for blk in model.blocks:
            blk.a.weight_function = [LowVramPatch("a.weight", delta, strength)]
        with torch.no_grad():
            eager = _run(model, x)
            with routing.routed(model, _Plan()):
                out = _run(model, x, compiled)
        torch.testing.assert_close(out, eager, rtol=1e-6, atol=1e-6)
    assert count.graphs == 1


def test_without_the_routing_the_fetch_splits_the_graph(ops, fresh_code):
    """Why the routing exists: ComfyUI's fetch traced as Python breaks the graph at each layer."""
    model = _model(ops, fresh_code)
    explained = torch._dynamo.explain(fresh_fn(_call))(model.blocks[0], torch.randn(3, 8))
    assert explained.break_reasons or explained.graph_count == 0, explained


def test_layers_not_streamed_and_other_classes_are_left_alone(ops, fresh_code, fetch_op, routing, monkeypatch):
    model = _model(ops, fresh_code, streamed=False)
    with routing.routed(model, _Plan()) as routed:
        assert not routed and "forward_comfy_cast_weights" not in model.blocks[0].a.__dict__
    # streamed layers with the switch off (the default, and a dynamic clone that could not be
    # reloaded): ComfyUI's method, traced as before
    monkeypatch.setenv("TORCH_COMPILE_SPEED_DYNAMIC_VRAM_FETCH", "0")
    streamed = _model(ops, fresh_code)
    with routing.routed(streamed, _Plan()) as routed:
        assert not routed and "forward_comfy_cast_weights" not in streamed.blocks[0].a.__dict__

    class Scaled(ops.disable_weight_init.Linear):  # an fp8-style subclass: its own method
        def forward_comfy_cast_weights(self, input):
            return super().forward_comfy_cast_weights(input) * 2
    from tcs_pack.nodes import dynamic_fetch
    assert dynamic_fetch.candidate(model.blocks[0].a) and not dynamic_fetch.candidate(Scaled(8, 8))


def test_a_fetch_of_another_shape_raises_instead_of_computing(fetch_op):
    key = layer_fetch.LayerKey(lambda x: [torch.zeros(4, 4)])
    with pytest.raises(RuntimeError, match="traced for"):
        layer_fetch.fetch(key, torch.randn(2, 8), (8, 8))
    gone = layer_fetch.LayerKey(lambda x: [torch.zeros(8, 8)])
    tensor = gone.tensor
    del gone
    with pytest.raises(RuntimeError, match="is gone"):
        torch.ops.tcs.layer_fetch(tensor, torch.randn(2, 8), [8, 8], [])


SAVED_CHILD = textwrap.dedent("""
    import json, logging, os, sys
    from pathlib import Path
    logging.basicConfig(level=logging.INFO)
    sys.path[:0] = [{root!r}, {tests!r}]
    os.environ["TORCH_COMPILE_SPEED_DYNAMIC_VRAM_FETCH"] = {switch!r}
    import torch
    from torch._dynamo.utils import counters
    import test_dynamic_fetch as t
    from test_weight_fetch import import_routing
    from compile_core.cache import precompiled
    from compile_core.torch_support import scoped
    from compile_core.plan.settings import CompileSettings, build_compile_args

    def put(d, k, v):
        d[k] = v
    ops = t.install_fake_ops(put)
    routing = import_routing(put, lambda d, k, raising=False: d.pop(k, None))
    model = t._model(ops, lambda *classes: None)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_({scale})
    settings = CompileSettings.from_args(build_compile_args(backend="inductor", mode="default",
                                                            background_compile=False))
    fast = precompiled.Precompiled(Path({cache!r}), settings.compile_kwargs())
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        eager = t._run(model, x)
        with scoped.scoped_state(), routing.routed(model, t._Plan()) as routed:
            fast.begin_run(list(model.blocks), x.device)
            y = x
            for blk in model.blocks:
                y = fast.call(blk, (y,), {{}}, lambda: None, lambda m, *a, **k: m(*a, **k))
    print("RESULT " + json.dumps(dict(
        routed=routed, loaded=fast.loaded, captured=fast.captured, regular=sorted(fast.regular),
        traced=counters["stats"]["unique_graphs"], diff=float((y - eager).abs().max()))))
""")


def _saved_child(cache, switch: str, scale: float) -> dict:
    root = Path(__file__).resolve().parents[2]
    code = SAVED_CHILD.format(root=str(root), tests=str(root / "tests" / "unit"), cache=str(cache),
                              switch=switch, scale=scale)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return {**json.loads(line[len("RESULT "):]), "log": proc.stderr}


@pytest.mark.slow
def test_a_saved_region_with_fetched_weights_loads_after_a_restart_and_only_where_they_are_fetched(tmp_path):
    """A region traced through the stand-ins is saved; a new process with other weights loads it
    without a trace and computes its own weights (the op's key is data); a process whose layers
    are not routed (the switch off) never runs it."""
    if not (aot.load_compiled_function() and layer_fetch.available()):
        pytest.skip(f"torch {torch.__version__} cannot save regions or run tcs::layer_fetch")
    first = _saved_child(tmp_path, "1", 1.0)
    assert first["routed"] and first["captured"] == 1 and first["diff"] < 1e-5, first
    assert "a restart loads it without a trace" in first["log"], first["log"]
    again = _saved_child(tmp_path, "1", 1.5)
    assert again["routed"] and again["loaded"] == 1 and again["captured"] == 0 and again["traced"] == 0, again
    assert again["diff"] < 1e-5, again
    off = _saved_child(tmp_path, "0", 1.0)
    assert not off["routed"] and off["loaded"] == 0 and off["diff"] < 1e-5, off
