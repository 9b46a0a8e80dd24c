"""compile_core.diagnose.diagnostics: median timing after warm-up, graph breaks with file:line (without
``torch._dynamo.reset()``), recompile hints, verdict and auto-disable; end to end on a toy model."""
from __future__ import annotations

import collections
import inspect
import time
import traceback
import types
import uuid

import pytest
import torch
from torch import nn

from compile_core.diagnose import diagnostics, graph_breaks
from compile_core.run import engine, warmup
from compile_core.report import recompiles, timing
from compile_core.torch_support import scoped
from compile_core.diagnose.diagnostics import Report
from compile_core.report.timing import Timing
from compile_core.plan.settings import CompileSettings, build_compile_args

CPU = torch.device("cpu")
HERE = __file__


def line_of(fn, text: str) -> int:
    """The file line number of the first source line of ``fn`` that contains ``text``."""
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, ln in enumerate(lines) if text in ln)


def at(fn, text: str) -> str:
    """``"file:line in name"`` of the line of ``fn`` containing ``text``, as a report shows it."""
    return f"{HERE}:{line_of(fn, text)} in {fn.__code__.co_name}"


# --------------------------------------------------------------------------- timing

def sleeper(times_s):
    """A plain callable that sleeps times_s[0], then times_s[1], ... (the last one repeats)."""
    calls = []

    def call():
        calls.append(time.perf_counter())
        time.sleep(times_s[min(len(calls) - 1, len(times_s) - 1)])
    call.calls = calls
    return call


def test_measure_uses_medians_and_keeps_warmup_apart():
    eager = sleeper([0.030])
    # first call "compiles" (0.3 s); one measured call is a 0.2 s outlier (e.g. a stray stall)
    compiled = sleeper([0.30, 0.010, 0.010, 0.200, 0.010, 0.010])
    t = timing.measure(eager, compiled, runs=5)
    assert len(eager.calls) == 6 and len(compiled.calls) == 6  # 1 warm-up + 5 measured each
    assert len(t.eager_ms) == len(t.compiled_ms) == 5
    assert t.compiled_warmup_s >= 0.3 and max(t.compiled_ms) < 300  # warm-up not in the runs
    assert 10 <= t.compiled_median_ms < 25 and 30 <= t.eager_median_ms < 50
    assert t.speedup > 1.5  # the mean (48 ms) would have called compiled slower than eager
    assert "not measured on CPU" in t.memory_note and t.eager_peak_mib is None


def test_measure_alternates_and_flips_the_order():
    order = []
    clock = types.SimpleNamespace(now=0.0)

    def make(name, ms):
        def call():
            order.append(name)
            clock.now += ms / 1000
        return call

    t = timing.measure(make("E", 4), make("C", 2), runs=4, clock=lambda: clock.now)
    assert order == ["E", "C", "E", "C", "C", "E", "E", "C", "C", "E"]
    assert t.eager_ms == pytest.approx([4] * 4) and t.compiled_ms == pytest.approx([2] * 4)
    assert t.speedup == pytest.approx(2.0)
    with pytest.raises(ValueError):
        timing.measure(make("E", 1), make("C", 1), runs=0)


# --------------------------------------------------------------------------- graph breaks

def make_breaking(fresh_code):
    def helper(y):
        if y.sum().item() > 1e9:  # graph break: Tensor.item()
            return y
        return y + 1

    class Breaking(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, scale=1.0):
            y = self.lin(x)
            print("tcs diagnostics test")  # graph break: print()
            return helper(y) * scale

    fresh_code(Breaking)
    helper.__code__ = helper.__code__.replace()
    return Breaking, helper


def test_graph_breaks_have_reason_and_file_line(fresh_code, capsys):
    Breaking, helper = make_breaking(fresh_code)
    breaks = graph_breaks.find_graph_breaks(Breaking(), (torch.randn(2, 4),), {"scale": 2.0})
    assert [b.region for b in breaks] == ["Breaking", "Breaking"]
    printed, item = breaks
    assert printed.where == at(Breaking.forward, 'print(')
    assert "print" in printed.summary and printed.summary.startswith("Failed to trace builtin")
    assert item.where == at(helper, '.item()')
    assert "item()" in item.summary
    assert "tcs diagnostics test" in capsys.readouterr().out  # the call really ran


def test_graph_break_search_keeps_other_compiled_code(fresh_code, graph_count):
    """torch._dynamo.explain() resets dynamo (every compiled graph in the server is lost);
    this must not."""
    Breaking, _ = make_breaking(fresh_code)

    def f(x):
        return torch.sin(x) * 2

    f.__code__ = f.__code__.replace()
    x = torch.randn(3)
    with scoped.scoped_state():  # other code's compile: torch 2.8/2.9 set TORCHINDUCTOR_CACHE_DIR
        cf = torch.compile(f, backend="aot_eager")
        cf(x)
    g0 = graph_count()
    graph_breaks.find_graph_breaks(Breaking(), (torch.randn(2, 4),), {})
    g1 = graph_count()
    with scoped.scoped_state():
        cf(x)
    assert graph_count() == g1 > g0  # the break search traced; f was not compiled again


class FakeCounterOfAnotherThreadsTrace(collections.Counter):
    """FAKE: dynamo's graph-break counter as a background compile's trace in another thread
    adds to it while this thread walks its items."""

    def items(self):
        view = iter(super().items())
        for item in view:
            self[f"another thread's break {len(self)}"] = 1
            yield item


def test_graph_break_counts_are_read_whole_while_another_thread_adds_to_them(monkeypatch):
    from torch._dynamo.utils import counters
    monkeypatch.setitem(counters, "graph_break", FakeCounterOfAnotherThreadsTrace({"print": 2}))
    assert graph_breaks._break_counts() == {"print": 2}


def test_nested_break_is_reported_once_at_the_user_frame(fresh_code):
    """A break in nested model code: one break, at the innermost frame, with its callers; the
    frames it cut on the way (each caller breaks at the call) are folded in."""
    def leaf(x):
        y = x - 1
        print("tcs leaf")  # graph break: print()
        return y * 2

    class Inner(nn.Module):
        def forward(self, x):
            h = x * 3
            return leaf(h) + 1

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Inner()

        def forward(self, x):
            h = x + 1
            return self.inner(h) * 2

    fresh_code(Inner, Outer)
    leaf.__code__ = leaf.__code__.replace()
    breaks = graph_breaks.find_graph_breaks(Outer(), (torch.randn(3),), {})
    assert len(breaks) == 1, [b.stack for b in breaks]
    b = breaks[0]
    assert b.where == at(leaf, 'print(')
    assert b.callers[:2] == [at(Inner.forward, 'leaf(h)'), at(Outer.forward, 'self.inner(h)')]
    assert b.splits >= 2  # Outer.forward and Inner.forward were cut too


def test_break_before_any_traced_op_is_still_listed(fresh_code):
    """Nothing traced before the break: dynamo compiles no graph, so only its counters know."""
    class Early(nn.Module):
        def forward(self, x):
            torch._dynamo.graph_break()
            return x + 1

    fresh_code(Early)
    breaks = graph_breaks.find_graph_breaks(Early(), (torch.randn(3),), {})
    assert len(breaks) == 1 and breaks[0].where == graph_breaks.UNLOCATED
    assert "graph_break" in breaks[0].reason


def test_library_frames_are_not_the_location():
    lib = torch.__file__.replace("__init__.py", "nn/functional.py")
    site = "/opt/venv/lib/python3.11/site-packages/psutil/_common.py"
    user = "/srv/ComfyUI/comfy/model_management.py"

    def rec(reason, *frames):
        return types.SimpleNamespace(reason=reason, user_stack=[
            traceback.FrameSummary(f, n, fn, lookup_line=False) for f, n, fn in frames])

    outer = ("/srv/ComfyUI/comfy/ldm/wan/model.py", 236, "forward")
    mid = ("/srv/ComfyUI/comfy/ldm/modules/attention.py", 234, "attention_sub_quad")
    inner = [(user, 1265, "get_free_memory"), (site, 682, "open_binary")]
    records = [rec("open", outer, mid, *inner), rec("open", mid, *inner),
               rec("other", (lib, 10, "linear")), rec("open", (user, 1265, "get_free_memory"))]
    breaks = graph_breaks.breaks_from_records(records, "Block")
    assert [b.where for b in breaks] == [f"{user}:1265 in get_free_memory", f"{lib}:10 in linear",
                                         f"{user}:1265 in get_free_memory"]
    first = breaks[0]
    assert first.inside == f"{site}:682 in open_binary" and first.splits == 2
    assert first.callers == [f"{mid[0]}:234 in attention_sub_quad", f"{outer[0]}:236 in forward"]
    assert graph_breaks.is_library(site) and graph_breaks.is_library(lib)
    assert not graph_breaks.is_library(user)


def test_capture_inputs_records_first_call_and_removes_hooks(wan, wan_inputs):
    model = wan.Model(n_blocks=3).eval()
    x, t = wan_inputs()
    targets = graph_breaks.one_per_type(list(model.blocks))
    assert targets == [model.blocks[0]]
    with pytest.raises(RuntimeError, match="boom"):
        with graph_breaks.capture_inputs(targets) as captured:
            model(x, t)
            raise RuntimeError("boom")
    args, kwargs = captured[0]
    assert args[0].shape == (2, 6, 32) and kwargs == {}
    assert all(not b._forward_pre_hooks for b in model.blocks)


# --------------------------------------------------------------------------- recompiles

@pytest.mark.parametrize("guard, hint", [
    ("len(L['self'].to_q.weight_function) == 0", "LoRA/lowvram weight_function"),
    ("GLOBAL_STATE changed: grad_mode ", "TF32/grad-mode/autocast toggled"),
    ("tensor 'x' size mismatch at index 1. expected 6, actual 9", "a new latent size"),
    ("tensor 'x' stride mismatch at index 0. expected 96, actual 4", "memory layout changed"),
    ("tensor 'x' dtype mismatch. expected Float, actual BFloat16", "model dtype changed"),
    ("___check_obj_id(L['self'].norm, 140234)", "an object was replaced"),
    ("ID_MATCH: L['self'].norm", "an object was replaced"),
    ("k_tokens == 128", "a Python number this code reads"),
    ("L['self'].training == False", ""),
])
def test_recompile_hints(guard, hint):
    got = recompiles.recompile_hint(guard)
    assert (hint in got) if hint else got == ""


def test_recompiles_from_frame_records_parse_dynamo_guard_text():
    reason = ("0/1: k_tokens == 128                       # if count >= k_tokens:  "
              "# comfy/ldm/modules/attention.py:242 in resume_in_attention\n"
              "User stack trace:\n  File \"comfy/ldm/modules/attention.py\", line 242\n")
    frames = [{"frame": "forward at /m.py:1", "seconds": 2.0, "recompile_reason": ""},
              {"frame": "forward at /m.py:1", "seconds": 0.5,
               "recompile_reason": "0/0: tensor 'x' size mismatch at index 1. expected 6, actual 9"},
              {"frame": "resume at /a.py:234", "seconds": 0.25, "recompile_reason": reason}]
    rec = recompiles.recompiles_from(frames, new_from=2)
    assert [r.guard for r in rec] == ["tensor 'x' size mismatch at index 1. expected 6, actual 9",
                                      "k_tokens == 128"]
    assert "a new latent size" in rec[0].hint and not rec[0].during_diagnosis
    assert rec[1].source == "comfy/ldm/modules/attention.py:242 in resume_in_attention  if count >= k_tokens:"
    assert rec[1].during_diagnosis and rec[1].seconds == 0.25


# --------------------------------------------------------------------------- verdict, auto-disable

def timed(eager_ms, compiled_ms):
    return Timing([eager_ms] * 3, [compiled_ms] * 3, 0.01, 5.0)


def test_verdict_text():
    fast = Report(timing=timed(13.2, 10.0), graph_breaks=[])
    assert fast.verdict() == "compiled is 1.32x faster; 0 graph breaks; 0 recompiles"
    slow = Report(timing=timed(9.1, 10.0), graph_breaks=[graph_breaks.GraphBreak("r", "f:1 in g")],
                  recompiles=[recompiles.Recompile("f", "g", "", 1.0)] * 2,
                  auto_disable_requested=True, auto_disabled=True)
    assert slow.verdict() == ("compiled is slower (0.91x); 1 graph break; 2 recompiles"
                              " — auto-disabled: eager model returned")
    kept = Report(timing=timed(13.2, 10.0), graph_breaks=[], auto_disable_requested=True)
    assert kept.verdict().endswith("— kept compiled (not slower)")
    unknown = Report(frames=[{"frame": "torch_dynamo_resume_in_forward_at_9 at /m.py:9"}],
                     timing_note="call failed", breaks_note="no inputs")
    assert unknown.verdict() == "step time not measured; graph breaks not analysed; 0 recompiles"
    assert "Graph breaks: not analysed (no inputs); 1 compiled frame resume" in unknown.render()
    assert Report(failed="boom").verdict().startswith("compile failed, so the model runs eagerly")
    assert fast.status_fields()["speedup"] == pytest.approx(1.32)
    assert fast.status_fields()["eager_ms"] == pytest.approx(13.2)


def test_source_paths_keep_a_windows_drive_letter():
    """``C:\\...\\model.py:12``: the drive belongs to the path (it was cut off at the colon)."""
    text = r"at C:\Users\me\ComfyUI\comfy\ldm\wan\model.py:123 (from /srv/a.py:4, b.py:5) x:y.py:6"
    assert diagnostics._PATH_AT_LINE.findall(text) == [
        r"C:\Users\me\ComfyUI\comfy\ldm\wan\model.py", "/srv/a.py", "b.py", "y.py"]


def test_kernel_compiles_line_only_when_inductor_runs_one_at_a_time(monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")
    text = Report(backend="inductor", compile_threads=1).render()
    assert "Kernel compiles: one at a time (TORCHINDUCTOR_COMPILE_THREADS" in text
    assert "Kernel compiles" not in Report(backend="inductor", compile_threads=8).render()
    assert "Kernel compiles" not in Report(backend="inductor").render()  # unknown


def test_auto_disable_decision():
    assert diagnostics.should_auto_disable(timed(9.0, 10.0), True) is True
    assert diagnostics.should_auto_disable(timed(11.0, 10.0), True) is False
    assert diagnostics.should_auto_disable(timed(9.0, 10.0), False) is False
    assert diagnostics.should_auto_disable(None, True) is False  # not measured: keep compiled


# --------------------------------------------------------------------------- inputs from a latent

def test_wan_inputs_from_a_latent_shape():
    dm = types.SimpleNamespace(text_embedding=[nn.Linear(4096, 8)],
                               patch_embedding=types.SimpleNamespace(in_channels=36))
    inputs, known = warmup.latent_inputs(dm, "WanModel", (2, 16, 3, 10, 12), CPU, torch.float32, 0.7)
    assert known
    assert inputs["x"].shape == (2, 16, 3, 10, 12) and inputs["t"].tolist() == pytest.approx([0.7] * 2)
    assert inputs["c_crossattn"].shape == (2, 512, 4096)
    assert inputs["c_concat"].shape == (2, 20, 3, 10, 12)  # i2v: 36 input channels
    other, known = warmup.latent_inputs(nn.Linear(1, 1), "", (1, 4, 8, 8), CPU, torch.float32)
    assert not known and set(other) == {"x", "t"} and other["x"].shape == (1, 4, 8, 8)
    # the declared-size recipe is unchanged
    ahead = warmup.ahead_inputs(dm, "WanModel", 16, (128, 96, 9), CPU, torch.float32)
    assert ahead["x"].shape == (1, 16, 3, 12, 16) and ahead["t"].shape == (1,)


# --------------------------------------------------------------------------- end to end

def settings(**kw):
    kw.setdefault("backend", "aot_eager")
    kw.setdefault("mode", "default")
    kw.setdefault("background_compile", False)
    return CompileSettings.from_args(build_compile_args(**kw))


def make_toy(graph_break=False):
    """A 2-block DiT-like toy whose class is named WanModel (so its blocks are the regions), with
    code objects and names of its own (no other test's graphs or automatic-dynamic history).

    Defined here rather than in conftest: dynamo resolves a function's globals through
    ``sys.modules[fn.__globals__["__name__"]]``, and when host tests are collected after the
    unit tests, ``sys.modules["conftest"]`` is tests/host/conftest.py."""
    class Block(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.norm = nn.LayerNorm(dim)
            self.lin = nn.Linear(dim, dim)

        def forward(self, x, emb):  # not "e": WAN's e is marked dynamic in dim 1 (shapes.py)
            h = self.lin(self.norm(x)) * (1 + emb)
            if graph_break:
                torch._dynamo.graph_break()
            return x + torch.nn.functional.gelu(h)

    class Model(nn.Module):
        def __init__(self, dim=16, in_dim=8):
            super().__init__()
            self.inp = nn.Linear(in_dim, dim)
            self.t_emb = nn.Linear(1, dim)
            self.blocks = nn.ModuleList(Block(dim) for _ in range(2))
            self.out = nn.Linear(dim, in_dim)

        def forward(self, x, t):
            e = self.t_emb(t[:, None])[:, None, :]
            x = self.inp(x)
            for block in self.blocks:
                x = block(x, e)
            return self.out(x)

    tag = uuid.uuid4().hex[:8]
    for cls in (Block, Model):
        for fn in vars(cls).values():
            if isinstance(fn, types.FunctionType):
                fn.__code__ = fn.__code__.replace(co_name=f"{fn.__code__.co_name}_{tag}",
                                                  co_qualname=f"{fn.__code__.co_qualname}_{tag}")
    Model.__name__ = Model.__qualname__ = "WanModel"
    return Block, Model().eval()


def toy_inputs(tokens, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, tokens, 8, generator=g), torch.rand(2, generator=g)


def diagnose_toy(cm, model, x, t, runs, **kw):
    with torch.no_grad():
        return diagnostics.diagnose(cm, model, lambda: model(x, t),
                                    lambda: cm.run(model, lambda: model(x, t), CPU), runs=runs,
                                    device=CPU, **kw)


def test_diagnose_a_compiled_toy_model():
    _, model = make_toy()
    cm = engine.prepare(model, settings(shape_policy="static"))
    x, t = toy_inputs(tokens=6)
    with torch.no_grad():
        cm.run(model, lambda: model(x, t), CPU)  # a first "sampling run"
    x, t = toy_inputs(tokens=9)  # a new size, static policy: the diagnosis recompiles
    rep = diagnose_toy(cm, model, x, t, runs=3, inputs_note="toy inputs")
    assert rep.failed == "" and rep.regions == "Block x2" and rep.region_count == 2
    assert rep.graph_breaks == [] and "traced Block on inputs from a real eager call" in rep.breaks_note
    assert len(rep.frames) == 2 and rep.new_frames_from == 1
    assert len(rep.recompiles) == 1 and rep.recompiles[0].during_diagnosis
    assert "a new latent size" in rep.recompiles[0].hint
    assert len(rep.timing.eager_ms) == 3 and rep.timing.speedup > 0
    text = rep.render()
    for needle in ("Verdict: ", "Regions compiled: Block x2", "Compile time:", "Graph breaks: 0",
                   "Recompiles: 1", "size mismatch", "likely cause: a new latent size",
                   "(recompile, during this diagnosis)", "Caches (status cold): in-process",
                   "Step time (toy inputs", "ratio", "Peak memory: not measured on CPU"):
        assert needle in text, (needle, text)
    assert f"{rep.timing.speedup:.2f}x" in text.splitlines()[1]


def test_diagnose_lists_graph_breaks_of_a_region():
    Block, model = make_toy(graph_break=True)
    cm = engine.prepare(model, settings())
    rep = diagnose_toy(cm, model, *toy_inputs(tokens=5), runs=1)
    assert rep.failed == "" and len(rep.graph_breaks) == 1, rep.render()
    assert rep.graph_breaks[0].where == at(Block.forward, "graph_break()")
    assert rep.break_count == 1 and "1 graph break;" in rep.verdict()
    assert rep.resume_frames >= 1  # the compiled code resumes after the break too


def test_diagnose_reports_a_failing_call_instead_of_raising():
    _, model = make_toy()
    cm = engine.prepare(model, settings())

    def bad():
        raise ValueError("x must have 5 dims")

    rep = diagnostics.diagnose(cm, model, bad, bad, runs=2, inputs_note="x and t only")
    assert rep.timing is None and "x must have 5 dims" in rep.timing_note
    assert rep.graph_breaks is None and "Step time: skipped" in rep.render()
    with pytest.raises(KeyboardInterrupt):
        def interrupted():
            raise KeyboardInterrupt
        diagnostics.diagnose(cm, model, interrupted, interrupted, runs=1)

    class Interrupt(Exception):
        pass

    def stop():
        raise Interrupt()
    with pytest.raises(Interrupt):
        diagnostics.diagnose(cm, model, stop, stop, runs=1, reraise=(Interrupt,))
