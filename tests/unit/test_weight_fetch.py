"""compile_core.torch_support.weight_fetch: a weight fetch behind ``tcs::weight_fetch`` on an opaque reference
object compiles to one graph for every block and every LoRA strength, with eager's values;
the same fetch traced as Python (ComfyUI's LowVramPatch: a key and a float) does not."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from compile_core.torch_support import probing, scoped, weight_fetch as wf


@pytest.fixture
def op():
    if not wf.opaque_weight_fetch():
        pytest.skip(f"torch {torch.__version__} cannot pass an opaque object to a custom op")
    return wf


class _Count:
    def __init__(self):
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return gm.forward


class _Patch:
    """Like ComfyUI's LowVramPatch: the strength is a float read at every forward."""

    def __init__(self, key: str, delta: torch.Tensor, strength: float):
        self.key, self.delta, self.strength = key, delta, strength

    def __call__(self, weight):  # calculate_weight reads the key too (a guard on its value)
        return weight + (self.strength if self.key.endswith("weight") else 0.0) * self.delta


class _OpPatch:
    """What ``nodes/weight_routing`` puts in its place: the patch behind the op."""

    def __init__(self, patch: _Patch):
        self.ref = wf.WeightRef(lambda w: [patch(w.clone())], lambda w: [torch.empty_like(w)], patch.key)

    def __call__(self, weight):
        return wf.fetch(self.ref, weight)[0]


def _model_classes(fresh_code):
    class Layer(nn.Linear):
        weight_function: list = []

        def forward(self, x):
            w = self.weight
            for f in self.weight_function:
                w = f(w)
            return nn.functional.linear(x, w, self.bias)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = Layer(8, 8), Layer(8, 8)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))
    return fresh_code(Layer, Block)


def _call(blk, x):
    return blk(x)


def _run(blocks, x, compiled=None):
    for blk in blocks:
        x = compiled(blk, x) if compiled else blk(x)
    return x


def _sweep(fresh_code, wrap, backend, strengths=(1.0, 0.5, -0.7)):
    """(graphs, worst rel L2 against eager) for 2 blocks x ``strengths``; scoped, as the pack's
    own compiles are (torch 2.8's torch.compile sets TORCHINDUCTOR_CACHE_DIR)."""
    with scoped.scoped_state():
        return _sweep_unscoped(fresh_code, wrap, backend, strengths)


def _sweep_unscoped(fresh_code, wrap, backend, strengths):
    torch.manual_seed(0)
    _, Block = _model_classes(fresh_code)
    blocks = [Block() for _ in range(2)]
    deltas = {(i, n): torch.randn(8, 8) * 0.1 for i in range(2) for n in "ab"}
    count = _Count() if backend is None else None
    compiled = torch.compile(fresh_fn(_call), backend=count or backend)
    x, worst = torch.randn(3, 8), 0.0
    for s in strengths:
        for i, blk in enumerate(blocks):
            for n in "ab":
                getattr(blk, n).weight_function = [_Patch(f"blocks.{i}.{n}.weight", deltas[i, n], s)]
        with torch.no_grad():
            eager = _run(blocks, x)
            for blk in blocks:
                for n in "ab":
                    layer = getattr(blk, n)
                    layer.weight_function = [wrap(f) for f in layer.weight_function]
            out = _run(blocks, x, compiled)
        worst = max(worst, ((out - eager).norm() / eager.norm()).item())
    return (count.graphs if count else None), worst


def test_a_strength_traced_as_python_recompiles(fresh_code):
    """The problem the op solves: the patch's key and float strength become guards (one
    graph per block, and more per strength)."""
    graphs, err = _sweep(fresh_code, lambda p: p, None)
    assert graphs >= 3 and err < 1e-6


def test_the_op_gives_one_graph_for_every_block_and_strength(fresh_code, op):
    graphs, err = _sweep(fresh_code, _OpPatch, None)
    assert graphs == 1 and err < 1e-6


def test_the_op_under_aot_eager_matches_eager(fresh_code, op, graph_count):
    g0 = graph_count()
    _, err = _sweep(fresh_code, _OpPatch, "aot_eager", strengths=(1.0, -0.7))
    assert graph_count() - g0 == 1 and err < 1e-6


def test_eager_call_returns_fetch_values_and_never_aliases_its_input(op):
    x = torch.randn(4)
    same = op.fetch(op.WeightRef(lambda t: [t], lambda t: [torch.empty_like(t)]), x)[0]
    assert torch.equal(same, x) and same.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    two = op.fetch(op.WeightRef(lambda t: [t * 2, t[:2] + 1], lambda t: []), x)
    assert torch.equal(two[0], x * 2) and torch.equal(two[1], x[:2] + 1)


def test_tracing_takes_shapes_from_the_refs_fake(op):
    """A GGUF-like fetch: the weight's shape is not the input's (the fake gives it)."""
    weight = torch.randn(5, 3)
    ref = op.WeightRef(lambda x: [weight.to(x.dtype) * 2],
                       lambda x: [x.new_empty((5, 3), dtype=x.dtype)])

    def f(x):
        return nn.functional.linear(x, op.fetch(ref, x)[0])
    count, x = _Count(), torch.randn(2, 3)
    out = torch.compile(fresh_fn(f), backend=count, fullgraph=True)(x)
    assert count.graphs == 1 and torch.allclose(out, x @ (weight * 2).T)


def fresh_fn(fn):
    import types
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__,
                              fn.__closure__)


def test_registered_once_under_a_name_a_schema_can_hold(op):
    assert op.register() is op.register()
    assert op.WeightRef.__module__ == op.ALIAS and op.ALIAS.isidentifier()
    import pickle
    assert pickle.loads(pickle.dumps(op.WeightRef)) is op.WeightRef  # torch's caches pickle it


def test_without_opaque_objects_the_feature_is_off(monkeypatch):
    monkeypatch.setattr(wf, "opaque_weight_fetch", lambda: False)
    assert wf.available() is False


def test_probe_agrees_with_registration():
    assert wf.opaque_weight_fetch() == (wf.register() and wf.opaque_weight_fetch())
    if probing.version() >= (2, 13):
        assert wf.opaque_weight_fetch()


def test_a_pickled_ref_is_a_cache_key_and_never_a_weight(op):
    """Inductor's FX-graph cache pickles the graph inputs into its key: every ref pickles the
    same (the graph does not depend on which), and one restored from a pickle refuses to run."""
    import pickle
    a = op.WeightRef(lambda t: [t], lambda t: [t], "a")
    b = op.WeightRef(lambda t: [t * 2], lambda t: [t], "b")
    assert pickle.dumps(a) == pickle.dumps(b)
    with pytest.raises(RuntimeError, match="pickled"):
        pickle.loads(pickle.dumps(a)).fetch(torch.ones(1))


# ------------------------------------------------ nodes/weight_routing (ComfyUI-like layers)

@pytest.fixture
def routing(monkeypatch):
    """``nodes/weight_routing`` imported on its own (the pack's ``nodes`` package needs ComfyUI),
    with this process's ``compile_core`` as its parent's."""
    return import_routing(monkeypatch.setitem, monkeypatch.delitem)


def import_routing(setitem, delitem):
    """``routing``'s work, with ``setitem(sys.modules, name, module)`` and ``delitem(sys.modules,
    name, raising=False)`` (a monkeypatch's, or plain ones in a child process)."""
    import importlib
    import sys
    import types

    import compile_core
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    pkg = types.ModuleType("tcs_pack")
    pkg.__path__ = [str(root)]
    nodes = types.ModuleType("tcs_pack.nodes")
    nodes.__path__ = [str(root / "nodes")]
    from compile_core.torch_support import layer_fetch, weight_fetch  # noqa: F401 - the one copy their ops register from
    ours = {"tcs_pack." + name: mod for name, mod in sys.modules.copy().items()
            if name == "compile_core" or name.startswith("compile_core.")}
    for name, mod in (("tcs_pack", pkg), ("tcs_pack.nodes", nodes), *ours.items()):
        setitem(sys.modules, name, mod)
    delitem(sys.modules, "tcs_pack.nodes.weight_routing", raising=False)
    return importlib.import_module("tcs_pack.nodes.weight_routing")


class LowVramPatch:  # the name and attributes ComfyUI's weight patches have
    is_lowvram_patch = True

    def __init__(self, key, delta, strength):
        self.key, self.delta, self.strength = key, delta, strength
        self.convert_func = self.set_func = None

    def __call__(self, weight):  # like calculate_weight: in place on the (copied) weight
        weight += (self.strength if self.key.endswith("weight") else 0.0) * self.delta
        return weight


def _comfy_like(fresh_code):
    class Linear(nn.Linear):  # comfy.ops: the cast path applies weight_function
        weight_function: list = []
        bias_function: list = []

        def forward(self, x):
            w, b = self.weight.clone(), self.bias.clone()
            for f in self.weight_function:
                w = f(w)
            for f in self.bias_function:
                b = f(b)
            return nn.functional.linear(x, w, b)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = Linear(8, 8), Linear(8, 8)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([Block(), Block()])
    fresh_code(Linear, Block, Model)
    return Model


class _Plan:
    def modules(self, model):
        return list(model.blocks)


def test_routing_gives_one_graph_for_every_strength_and_restores_the_layers(fresh_code, op, routing):
    torch.manual_seed(0)
    model, plan, x = _comfy_like(fresh_code)(), _Plan(), torch.randn(3, 8)
    deltas = {(i, n, p): torch.randn(8, 8 if p == "weight" else 1).squeeze(-1) * 0.1
              for i in range(2) for n in "ab" for p in ("weight", "bias")}
    count = _Count()
    compiled = torch.compile(fresh_fn(_call), backend=count)
    for s in (1.0, 0.5, -0.7):
        for i, blk in enumerate(model.blocks):
            for n in "ab":
                layer = getattr(blk, n)
                layer.weight_function = [LowVramPatch(f"{i}.{n}.weight", deltas[i, n, "weight"], s)]
                layer.bias_function = [LowVramPatch(f"{i}.{n}.bias", deltas[i, n, "bias"], s)]
        before = {id(m): dict(m.__dict__) for m in model.modules()}
        with torch.no_grad():
            eager = _run(model.blocks, x)
            with routing.routed(model, plan) as routed:
                out = _run(model.blocks, x, compiled)
        assert routed and ((out - eager).norm() / eager.norm()).item() < 1e-6
        assert {id(m): dict(m.__dict__) for m in model.modules()} == before  # all put back
    assert count.graphs == 1


def test_routing_leaves_unpatched_layers_and_other_functions_alone(op, routing, fresh_code):
    model, plan = _comfy_like(fresh_code)(), _Plan()
    with routing.routed(model, plan) as routed:
        assert not routed
    other = [lambda w: w * 2]  # a weight wrapper patch, not a LowVramPatch: traced as before
    model.blocks[0].a.weight_function = other
    with routing.routed(model, plan) as routed:
        assert not routed and model.blocks[0].a.weight_function is other


def test_two_plans_on_one_model_keep_their_layer_lists(routing, fresh_code):
    """Two Apply nodes on one model alternate model calls: each plan's layers are walked once."""
    model, walked = _comfy_like(fresh_code)(), []

    class CountingPlan(_Plan):
        def modules(self, m):
            walked.append(self)
            return super().modules(m)
    first, second = CountingPlan(), CountingPlan()
    for _ in range(3):
        for plan in (first, second):
            with routing.routed(model, plan) as routed:
                assert not routed
    assert walked == [first, second]


def test_routing_held_by_two_holders_is_put_back_by_the_last_one(op, routing, fresh_code):
    """A background compile holds the routing on its worker while the sampling thread enters
    and leaves it per model call: the stand-ins stay until the last holder leaves."""
    model, plan = _comfy_like(fresh_code)(), _Plan()
    layer, patch = model.blocks[0].a, LowVramPatch("0.a.weight", torch.zeros(8, 8), 1.0)
    layer.weight_function = [patch]
    worker = routing.routed(model, plan)
    assert worker.__enter__()
    stand_in = layer.weight_function
    assert stand_in != [patch]
    for _ in range(2):  # the sampling thread's model calls
        with routing.routed(model, plan) as routed:
            assert routed and layer.weight_function is stand_in
        assert layer.weight_function is stand_in  # the worker still holds it
    worker.__exit__(None, None, None)
    assert layer.weight_function == [patch] and not routing._HELD


def test_routing_keeps_patches_set_while_it_was_held(op, routing, fresh_code):
    """ComfyUI sets new patches (a new LoRA) while a holder is in: leaving keeps the new ones."""
    model, plan = _comfy_like(fresh_code)(), _Plan()
    layer = model.blocks[0].a
    layer.weight_function = [LowVramPatch("0.a.weight", torch.zeros(8, 8), 1.0)]
    with routing.routed(model, plan):
        newer = [LowVramPatch("0.a.weight", torch.ones(8, 8), 0.5)]
        layer.weight_function = newer
    assert layer.weight_function is newer and not routing._HELD


def test_routing_on_older_torch_changes_nothing_and_says_why_once(routing, fresh_code, monkeypatch, caplog):
    import logging
    monkeypatch.setattr(wf, "opaque_weight_fetch", lambda: False)
    monkeypatch.setattr(routing.log, "_said", set())
    model, plan = _comfy_like(fresh_code)(), _Plan()
    patch = LowVramPatch("0.a.weight", torch.zeros(8, 8), 1.0)
    model.blocks[0].a.weight_function = [patch]
    with caplog.at_level(logging.INFO, logger="TorchCompileSpeed"):
        for _ in range(2):
            with routing.routed(model, plan) as routed:
                assert not routed and model.blocks[0].a.weight_function == [patch]
    lines = [r.getMessage() for r in caplog.records if "recompiles" in r.getMessage()]
    assert len(lines) == 1 and "opaque object" in lines[0], lines


def test_gguf_like_layer_fetches_through_the_op(op, routing):
    """A ComfyUI-GGUF-like layer (``get_weight``, ``is_ggml_quantized``, a weight with
    ``patches``): its ``cast_bias_weight`` goes through the op while routed."""
    class GGUFLinear(nn.Linear):
        def is_ggml_quantized(self):
            return True

        def get_weight(self, tensor, dtype):
            return tensor.to(dtype) * 2

        def cast_bias_weight(self, input=None, dtype=None, device=None, bias_dtype=None):
            return self.get_weight(self.weight, input.dtype), self.bias.to(input.dtype)

        def forward(self, x):
            w, b = self.cast_bias_weight(x)
            return nn.functional.linear(x, w, b)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([nn.Sequential(GGUFLinear(4, 4))])
    m, x = M(), torch.randn(2, 4)
    m.blocks[0][0].weight.patches = [("lora", "key")]
    with torch.no_grad():
        eager = m.blocks[0](x)
        with routing.routed(m, _Plan()) as routed:
            assert "cast_bias_weight" in m.blocks[0][0].__dict__
            out = torch.compile(fresh_fn(_call), backend="aot_eager", fullgraph=True)(m.blocks[0], x)
    assert routed and torch.allclose(out, eager) and "cast_bias_weight" not in m.blocks[0][0].__dict__
