"""compile_core.run.engine: prepare + run on toy WAN-like models (aot_eager; one real inductor test)."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from compile_core.run import compile_pass, engine
from compile_core.torch_support import scoped
from compile_core.cache.registry import REGISTRY

from tcs_engine_helpers import CPU, eager, run, settings


def attached_anywhere(model: nn.Module) -> list[str]:
    return [n or "<root>" for n, m in model.named_modules() if "_compiled_call_impl" in m.__dict__]


def test_output_matches_eager_and_model_is_left_untouched(wan, wan_inputs, graph_count):
    model = wan.Model(n_blocks=4).eval()
    x, t = wan_inputs()
    keys_before = list(model.state_dict())
    ref = eager(model, x, t)
    cm = engine.prepare(model, settings())
    assert cm.plan.paths == ("blocks.0", "blocks.1", "blocks.2", "blocks.3")
    assert cm.reused is False and cm.entry.failed == ""
    g0 = graph_count()
    out = run(cm, model, x, t)
    assert graph_count() - g0 >= 1  # it really compiled
    torch.testing.assert_close(out, ref)
    assert attached_anywhere(model) == []
    keys = list(model.state_dict())
    assert keys == keys_before and not any("_orig_mod" in k for k in keys)
    torch.testing.assert_close(eager(model, x, t), ref)  # plain calls stay eager and equal
    assert cm.entry.runs == 1 and cm.entry.graphs == graph_count() - g0


def test_identical_blocks_share_one_graph_and_later_runs_add_none(wan, wan_inputs, graph_count):
    model = wan.Model(n_blocks=4).eval()
    x, t = wan_inputs()
    cm = engine.prepare(model, settings())
    g0 = graph_count()
    run(cm, model, x, t)
    assert graph_count() - g0 == 1
    g1 = graph_count()
    run(cm, model, x, t)
    run(cm, model, x, t)
    assert graph_count() == g1
    assert cm.entry.runs == 3 and cm.entry.graphs == 1


def test_vace_blocks_are_compiled_too(wan, wan_inputs, graph_count):
    model = wan.Model(n_blocks=3, n_vace=2).eval()
    x, t = wan_inputs()
    ref = eager(model, x, t)
    cm = engine.prepare(model, settings())
    assert cm.plan.paths[-2:] == ("vace_blocks.0", "vace_blocks.1")
    g0 = graph_count()
    torch.testing.assert_close(run(cm, model, x, t), ref)
    assert graph_count() - g0 == 2  # one graph per block class
    assert attached_anywhere(model) == []


def test_weights_are_inputs_not_constants(wan, wan_inputs, graph_count):
    """An in-place weight change (a LoRA merge) changes the compiled output, with no recompile."""
    model = wan.Model(n_blocks=2).eval()
    x, t = wan_inputs()
    cm = engine.prepare(model, settings())
    run(cm, model, x, t)
    with torch.no_grad():
        model.blocks[1].proj.weight.mul_(2.0)
    g0 = graph_count()
    torch.testing.assert_close(run(cm, model, x, t), eager(model, x, t))
    assert graph_count() == g0


def test_auto_shape_policy_serves_new_sizes_without_recompiling(wan, wan_inputs, graph_count):
    """A batch of 1 first must not pin the batch (``backed_size_oblivious``); on a torch where
    that knob is unsafe (2.8/2.9, ``torch_compat``) the first batch of 2 recompiles once."""
    from compile_core.torch_support import torch_compat
    model = wan.Model(n_blocks=3).eval()
    cm = engine.prepare(model, settings(shape_policy="auto", dynamic=False))
    g0 = graph_count()
    new = []
    for batch, tokens in [(1, 6), (1, 10), (2, 10), (3, 14), (1, 5)]:
        x, t = wan_inputs(batch=batch, tokens=tokens)
        g = graph_count()
        torch.testing.assert_close(run(cm, model, x, t), eager(model, x, t))
        new.append(graph_count() - g)
    batch_two = 0 if torch_compat.backed_size_oblivious_safe() else 1
    assert new == [1, 0, batch_two, 0, 0]
    assert graph_count() - g0 == 1 + batch_two


def test_static_shape_policy_compiles_per_size(wan, wan_inputs, graph_count):
    model = wan.Model(n_blocks=3).eval()
    cm = engine.prepare(model, settings(shape_policy="static", dynamic=False))
    g0 = graph_count()
    for tokens in (6, 10, 6):
        x, t = wan_inputs(tokens=tokens)
        torch.testing.assert_close(run(cm, model, x, t), eager(model, x, t))
    assert graph_count() - g0 == 2


def test_inference_mode_like_comfyui(wan, wan_inputs):
    model = wan.Model(n_blocks=2).eval()
    x, t = wan_inputs()
    ref = eager(model, x, t)
    cm = engine.prepare(model, settings())
    with torch.inference_mode():
        out = cm.run(model, lambda: model(x, t), CPU)
    torch.testing.assert_close(out, ref)


def test_whole_model_compile_when_blocks_only_is_off(wan, wan_inputs, graph_count):
    model = wan.Model(n_blocks=3).eval()
    x, t = wan_inputs()
    ref = eager(model, x, t)
    cm = engine.prepare(model, settings(compile_transformer_blocks_only=False))
    assert not cm.plan.regional
    g0 = graph_count()
    torch.testing.assert_close(run(cm, model, x, t), ref)
    assert graph_count() - g0 >= 1
    assert attached_anywhere(model) == []
    assert not any("_orig_mod" in k for k in model.state_dict())


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x).relu()


def test_two_compiles_with_the_same_settings_share_their_graphs_as_dynamo_does(graph_count, monkeypatch,
                                                                               tmp_path):
    """What ``compiled_call`` relies on: dynamo keeps graphs per code object, so a second
    ``torch.compile`` of ``_call_impl`` with the same settings runs the first one's graph."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # (torch 2.8 sets it at a first compile)
    fwd = _Block.forward
    cls = type("FreshBlock", (_Block,), {"forward": type(fwd)(fwd.__code__.replace(), fwd.__globals__)})
    block, x = cls(), torch.randn(2, 4)
    torch.compile(nn.Module._call_impl, backend="eager", dynamic=False)(block, x)
    g0 = graph_count()
    again = torch.compile(nn.Module._call_impl, backend="eager", dynamic=False)
    torch.testing.assert_close(again(block, x), block.lin(x).relu())
    assert graph_count() == g0  # no compile


def test_similar_model_reuses_compiled_work(wan, wan_inputs, graph_count):
    x, t = wan_inputs()
    torch.manual_seed(0)
    a = wan.Model(n_blocks=3).eval()
    cm_a = engine.prepare(a, settings())
    run(cm_a, a, x, t)
    torch.manual_seed(1)
    b = wan.Model(n_blocks=3).eval()  # the same structure, other weights
    ref_b = eager(b, x, t)
    cm_b = engine.prepare(b, settings())
    assert cm_b.reused is True
    assert cm_b.entry is cm_a.entry and cm_b.entry.reuses == 1
    assert len(REGISTRY) == 1
    g0 = graph_count()
    out_b = run(cm_b, b, x, t)
    assert graph_count() == g0  # first run of b: nothing compiled
    torch.testing.assert_close(out_b, ref_b)  # with b's own weights
    assert not torch.allclose(out_b, eager(a, x, t))


def test_reuse_if_similar_off_compiles_afresh(wan, wan_inputs, graph_count):
    x, t = wan_inputs()
    a = wan.Model(n_blocks=3).eval()
    cm_a = engine.prepare(a, settings())
    run(cm_a, a, x, t)
    b = wan.Model(n_blocks=3).eval()
    cm_b = engine.prepare(b, settings(reuse_if_similar=False))
    assert cm_b.reused is False
    assert cm_b.fingerprint == cm_a.fingerprint  # alike, but reuse was declined...
    assert cm_b.entry is not cm_a.entry       # ...so it has an entry of its own
    assert len(REGISTRY) == 1
    entry, _ = REGISTRY.get_or_create(cm_b.fingerprint, lambda: pytest.fail("rebuilt"))
    assert entry is cm_a.entry
    g0 = graph_count()
    torch.testing.assert_close(run(cm_b, b, x, t), eager(b, x, t))
    assert graph_count() - g0 == 1  # a real compile (isolate_recompiles), not a cache hit


def test_no_reuse_entry_alone_is_not_registered(wan, wan_inputs):
    model = wan.Model(n_blocks=2).eval()
    cm = engine.prepare(model, settings(reuse_if_similar=False))
    assert cm.fingerprint not in REGISTRY and len(REGISTRY) == 0


def test_global_state_is_unchanged_by_runs_and_knobs_apply_inside(wan, wan_inputs):
    model = wan.Model(n_blocks=2).eval()
    x, t = wan_inputs()
    # static policy: force_parameter_static_shapes passes through as asked (auto forces it on)
    s = settings(dynamo_cache_size_limit=5, dynamo_recompile_limit=300, shape_policy="static",
                 force_parameter_static_shapes=not torch._dynamo.config.force_parameter_static_shapes)
    cm = engine.prepare(model, s)
    seen = []

    def call():
        seen.append((torch._dynamo.config.recompile_limit,
                     torch._dynamo.config.accumulated_recompile_limit,
                     torch._dynamo.config.force_parameter_static_shapes,
                     torch._inductor.config.freezing))
        return model(x, t)

    before = scoped.snapshot()
    with torch.no_grad():
        for _ in range(2):
            cm.run(model, call, CPU)
            assert scoped.snapshot() == before
    assert seen == [(5, 300, s.force_parameter_static_shapes, False)] * 2


def test_compile_failure_falls_back_to_eager_once(wan, wan_inputs, raising_backend, graph_count,
                                                 pack_log):
    model = wan.Model(n_blocks=3).eval()
    x, t = wan_inputs()
    ref = eager(model, x, t)
    before = scoped.snapshot()
    cm = engine.prepare(model, settings(backend=raising_backend.name))
    g0 = graph_count()
    out = run(cm, model, x, t)
    torch.testing.assert_close(out, ref)
    assert raising_backend.calls == 1
    warnings = pack_log.warnings()
    assert len(warnings) == 1 and "eagerly" in warnings[0], warnings
    assert "boom" in warnings[0] and "fix" in warnings[0]  # the cause and what to do
    assert cm.entry.failed and "boom" in cm.entry.failed
    assert attached_anywhere(model) == []
    assert scoped.snapshot() == before
    # Later runs do not try again: no backend call, no graph, no new warning.
    for _ in range(2):
        torch.testing.assert_close(run(cm, model, x, t), ref)
    assert raising_backend.calls == 1
    assert graph_count() == g0
    assert len(pack_log.warnings()) == 1
    # A new Apply of the same fingerprint gets a fresh entry and retries once (a failure may be
    # transient, e.g. out of memory while autotuning); here it fails the same way again.
    other = wan.Model(n_blocks=3).eval()
    cm2 = engine.prepare(other, settings(backend=raising_backend.name))
    assert not cm2.reused and cm2.entry is not cm.entry
    torch.testing.assert_close(run(cm2, other, x, t), eager(other, x, t))
    assert raising_backend.calls == 2 and cm2.entry.failed
    assert cm.entry.failed  # the first model keeps its eager fallback


def test_model_error_propagates_unchanged(wan_factory, wan_inputs, pack_log, fresh_code):
    classes = wan_factory()

    class Strict(classes.Block):
        def forward(self, x, e):
            if x.shape[1] > 4:
                raise ValueError("sequence too long for this toy block")
            return super().forward(x, e)

    fresh_code(Strict)

    model = classes.Model(n_blocks=2).eval()
    model.blocks = nn.ModuleList(Strict(32, 2) for _ in range(2))
    x, t = wan_inputs(tokens=6)
    cm = engine.prepare(model, settings())
    with pytest.raises(ValueError, match="sequence too long") as info:
        run(cm, model, x, t)
    assert type(info.value) is ValueError
    assert cm.entry.failed == ""
    assert pack_log.warnings() == []
    assert attached_anywhere(model) == []
    del info
    # ...and compile still works for valid inputs afterwards.
    x4, t4 = wan_inputs(tokens=4)
    torch.testing.assert_close(run(cm, model, x4, t4), eager(model, x4, t4))
    assert cm.entry.failed == ""


def test_shape_error_in_the_model_is_not_a_compile_failure(wan, wan_inputs, graph_count, pack_log):
    """Dynamo wraps op errors found while tracing (TorchRuntimeError); the engine must still let the
    model's own error through and keep compile on, not disable it for every similar model."""
    model = wan.Model(n_blocks=2, dim=32).eval()
    h_bad = torch.randn(2, 6, 16)  # the wrong width for a dim-32 block: fails inside the region
    e = torch.randn(2, 3, 32)
    cm = engine.prepare(model, settings())
    with pytest.raises(RuntimeError) as info:
        with torch.no_grad():
            cm.run(model, lambda: model.blocks[0](h_bad, e), CPU)
    assert not isinstance(info.value, torch._dynamo.exc.TorchDynamoException)
    assert "eagerly" not in " ".join(pack_log.warnings())
    assert cm.entry.failed == ""
    del info
    x, t = wan_inputs()
    g0 = graph_count()
    torch.testing.assert_close(run(cm, model, x, t), eager(model, x, t))
    assert graph_count() - g0 >= 1


def test_interrupt_propagates_and_detaches(wan, wan_inputs):
    model = wan.Model(n_blocks=2).eval()
    x, t = wan_inputs()
    cm = engine.prepare(model, settings())

    def call():
        assert len(attached_anywhere(model)) == 2  # attached during the call
        raise KeyboardInterrupt

    before = scoped.snapshot()
    with pytest.raises(KeyboardInterrupt):
        cm.run(model, call, CPU)
    assert attached_anywhere(model) == []
    assert cm.entry.failed == ""
    assert scoped.snapshot() == before


def test_attach_restores_a_previous_compiled_call_impl(wan, wan_inputs):
    """A block the user compiled with ``block.compile()`` keeps its own hook after our run."""
    model = wan.Model(n_blocks=2).eval()
    x, t = wan_inputs()
    marker = model.blocks[0]._call_impl
    model.blocks[0].__dict__["_compiled_call_impl"] = marker
    cm = engine.prepare(model, settings())
    run(cm, model, x, t)
    assert model.blocks[0].__dict__["_compiled_call_impl"] is marker
    assert "_compiled_call_impl" not in model.blocks[1].__dict__


def test_dropping_the_model_frees_it(wan, wan_inputs):
    model = wan.Model(n_blocks=3).eval()
    x, t = wan_inputs()
    cm = engine.prepare(model, settings())
    run(cm, model, x, t)
    run(cm, model, x, t)
    refs = [weakref.ref(model), weakref.ref(model.blocks[0]), weakref.ref(model.blocks[2])]
    del model
    gc.collect()
    assert [r() for r in refs] == [None, None, None], \
        "the compiled entry or dynamo's caches keep the model alive"
    assert cm.fingerprint in REGISTRY  # the entry itself lives on for reuse


def test_a_failing_compiled_call_runs_the_models_forward_once(wan, wan_inputs, raising_backend, pack_log):
    """What ran before the failing block (and ComfyUI's wrappers around the call: a cache
    patch's step state) must not run again: the blocks fall back where the compile failed."""
    model = wan.Model(n_blocks=3).eval()
    x, t = wan_inputs()
    ref = eager(model, x, t)
    forward, calls = model.forward, []

    def counted(*a, **k):
        calls.append(1)
        return forward(*a, **k)
    model.forward = counted
    cm = engine.prepare(model, settings(backend=raising_backend.name))
    torch.testing.assert_close(run(cm, model, x, t), ref)
    assert len(calls) == 1 and raising_backend.calls == 1 and cm.entry.failed
    warnings = pack_log.warnings()
    assert len(warnings) == 1 and "ran eagerly in its place" in warnings[0], warnings
    torch.testing.assert_close(run(cm, model, x, t), ref)
    assert len(calls) == 2 and raising_backend.calls == 1


def test_dropping_the_model_frees_it_after_a_fallback(wan, wan_inputs, raising_backend):
    model = wan.Model(n_blocks=2).eval()
    x, t = wan_inputs()
    cm = engine.prepare(model, settings(backend=raising_backend.name))
    run(cm, model, x, t)
    assert cm.entry.failed
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


@pytest.mark.slow
def test_inductor_compiled_dit_block_matches_eager(wan, wan_inputs, graph_count, tmp_path,
                                                   monkeypatch):
    """The one real inductor compile: 4 identical blocks -> 1 graph, output within 1e-4 of eager."""
    # A private cache dir: a cold, hermetic compile. (Inductor also writes this variable into
    # os.environ on first use when it is unset; setting it here keeps the env unchanged.)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    model = wan.Model(n_blocks=4, dim=64, heads=2).eval()
    x, t = wan_inputs(tokens=16)
    ref = eager(model, x, t)
    cm = engine.prepare(model, settings(backend="inductor", mode="default", dynamic=False))
    before = scoped.snapshot()
    g0 = graph_count()
    out = run(cm, model, x, t)
    assert cm.entry.failed == "", cm.entry.failed
    assert graph_count() - g0 == 1
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    g1 = graph_count()
    torch.testing.assert_close(run(cm, model, x, t), ref, atol=1e-4, rtol=1e-4)
    assert graph_count() == g1
    assert scoped.snapshot() == before
    assert attached_anywhere(model) == []
    assert not any("_orig_mod" in k for k in model.state_dict())
    ref_model = weakref.ref(model)
    del model
    gc.collect()
    assert ref_model() is None, "inductor's compiled graph keeps the model alive"


def test_frames_since_reads_records_of_older_torch(monkeypatch):
    """torch 2.5/2.6 records have no ``start_time_us`` / ``recompile_reason``: the first sampling
    run after a compile must not fail on them (they are skipped: no start time, no 'since')."""
    import types as _types
    old = _types.SimpleNamespace(co_name="forward", co_filename="m.py", co_firstlineno=3,
                                 entire_frame_compile_time_s=0.5)
    new = _types.SimpleNamespace(co_name="forward", co_filename="m.py", co_firstlineno=3,
                                 entire_frame_compile_time_s=None, start_time_us=20)
    monkeypatch.setattr("torch._dynamo.utils.get_compilation_metrics", lambda: [old, new])
    assert compile_pass.frames_since(10) == [{"frame": "forward at m.py:3", "seconds": 0.0,
                                         "recompile_reason": ""}]
    monkeypatch.setattr("torch._dynamo.utils.get_compilation_metrics",
                        lambda: (_ for _ in ()).throw(AttributeError("no metrics")))
    assert compile_pass.frames_since(10) == []


def test_prepare_log_says_how_many_graphs_a_reused_entry_compiled(wan, wan_inputs, pack_log):
    x, t = wan_inputs()
    a = wan.Model(n_blocks=2).eval()
    engine.prepare(a, settings())
    b = wan.Model(n_blocks=2).eval()
    cm_b = engine.prepare(b, settings())  # the entry exists but has not run yet
    assert cm_b.reused
    assert any("reusing compiled Block x2 (no graph of its own yet)" in m for m in pack_log.infos())
    run(cm_b, b, x, t)
    pack_log.clear()
    cm_c = engine.prepare(wan.Model(n_blocks=2).eval(), settings())
    assert cm_c.entry.graphs >= 1
    assert any(f"reusing compiled Block x2 ({cm_c.entry.graphs} graph(s) compiled earlier)" in m
               for m in pack_log.infos()), pack_log.infos()


def test_prepare_log_for_a_failed_entry_says_it_stays_eager_and_why():
    from compile_core.cache.registry import CompiledEntry
    failed = CompiledEntry("fp", None, failed="TorchRuntimeError: boom -> fix: x")
    text = engine._prepared(failed, True, "WanAttentionBlock x2")
    assert text == "WanAttentionBlock x2 stays eager (TorchRuntimeError: boom -> fix: x)"
    assert "reusing" not in text
