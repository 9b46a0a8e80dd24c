"""compile_core.run.fallback: telling a compile failure from the model's own error, in one line."""
from __future__ import annotations

import pytest
import torch

from compile_core.torch_support import scoped
from compile_core.run.fallback import explain, is_compile_failure


@pytest.fixture
def backend_failure(raising_backend):
    """A real BackendCompilerFailed, raised by dynamo for the test's raising backend."""
    # scoped: torch 2.8/2.9's torch.compile() sets TORCHINDUCTOR_CACHE_DIR
    with scoped.scoped_state(), pytest.raises(Exception) as info:
        f = torch.compile(lambda t: t.sin() + 1, backend=raising_backend.name)
        f(torch.randn(3))
    return info.value


def test_backend_failure_is_a_compile_failure(backend_failure):
    assert type(backend_failure).__name__ == "BackendCompilerFailed"
    assert isinstance(backend_failure, torch._dynamo.exc.TorchDynamoException)
    assert is_compile_failure(backend_failure)


def test_explain_is_one_line_with_cause_and_fix(backend_failure, raising_backend):
    msg = explain(backend_failure)
    assert "\n" not in msg
    assert "BackendCompilerFailed" in msg
    assert "RuntimeError: boom" in msg  # the cause, which torch puts on the second line
    assert "-> fix:" in msg and "backend" in msg.split("-> fix:")[1]
    assert len(msg) < 500


def test_fake_tensor_error_while_tracing_is_a_dynamo_exception():
    """Dynamo wraps the model's own shape errors (TorchRuntimeError), so classification alone
    cannot tell them apart; the engine lets eager decide (see test_engine)."""
    lin = torch.nn.Linear(8, 8)
    with scoped.scoped_state():  # torch 2.8/2.9's torch.compile() sets TORCHINDUCTOR_CACHE_DIR
        f = torch.compile(lin, backend="aot_eager")
        with pytest.raises(Exception) as info:
            f(torch.randn(2, 5))
    assert isinstance(info.value, torch._dynamo.exc.TorchDynamoException)
    assert is_compile_failure(info.value)


@pytest.mark.parametrize("exc", [
    ValueError("bad value in the model"),
    RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x5 and 8x8)"),
    KeyError("weight"),
    TypeError("forward() missing 1 required positional argument"),
    torch.OutOfMemoryError("CUDA out of memory"),
    KeyboardInterrupt(),
    MemoryError(),
])
def test_user_errors_are_not_compile_failures(exc):
    assert is_compile_failure(exc) is False


def test_real_user_runtime_error_is_not_a_compile_failure():
    with pytest.raises(RuntimeError) as info:
        torch.nn.Linear(8, 8)(torch.randn(2, 5))
    assert is_compile_failure(info.value) is False


def test_errors_defined_in_compiler_modules_are_compile_failures():
    from torch._inductor.exc import CppCompileError
    cpp = CppCompileError(["g++", "kernel.cpp"], "fatal error: Python.h: No such file")
    assert not isinstance(cpp, torch._dynamo.exc.TorchDynamoException)  # found by its module
    assert is_compile_failure(cpp)
    assert "compiler" in explain(cpp).split("-> fix:")[1]
    assert is_compile_failure(torch._dynamo.exc.Unsupported("graph break"))


@pytest.mark.parametrize("exc, fix_words", [
    (RuntimeError("CppCompileError: C++ compile error\ngcc: fatal"), "compiler"),
    (RuntimeError("triton: 0 active drivers"), "Triton"),
    (RuntimeError("backend='x' raised:\nRuntimeError: boom"), "another backend"),
    (RuntimeError("something else went wrong"), "compile_transformer_blocks_only"),
    # torch 2.8/2.9 on WAN with backed_size_oblivious: symbolic sizes fail on the size-1 dim
    (RuntimeError("TorchRuntimeError: Dynamo failed to run FX node with fake tensors: call_function "
                  "addcmul(*(FakeTensor(..., size=(s0, s27, 32)),), **{}): got RuntimeError("
                  "'Attempting to broadcast a dimension of length s27 at -2!')"), "shape_policy 'static'"),
])
def test_explain_suggests_a_fix_for_each_kind(exc, fix_words):
    msg = explain(exc)
    assert "\n" not in msg
    fix = msg.split("-> fix:")[1]
    assert fix_words in fix


def test_explain_handles_empty_and_long_messages():
    assert explain(RuntimeError()).startswith("RuntimeError")
    long = explain(RuntimeError("x" * 5000))
    assert "\n" not in long and len(long) < 500 and "-> fix:" in long


# --- errors raised while compiled code runs (e.g. Hunyuan-DiT's guard assertion) ------------------

def _raise_from_dynamo_guards():
    """A plain AssertionError raised from a torch._dynamo module, as dynamo's guard check raises
    ``Guard failed on the same frame it was created`` (torch/_dynamo/guards.py)."""
    import torch._dynamo.guards as guards
    code = compile("raise AssertionError('Guard failed on the same frame it was created. This is a "
                   "bug - please create an issue.')", guards.__file__, "exec")
    exec(code, {"__name__": guards.__name__})


def test_plain_error_raised_inside_dynamo_is_a_compile_failure():
    with pytest.raises(AssertionError) as info:
        _raise_from_dynamo_guards()
    assert is_compile_failure(info.value)
    msg = explain(info.value)
    assert "\n" not in msg
    assert "compiled code failed while running (raised in torch._dynamo.guards)" in msg
    assert "AssertionError: Guard failed on the same frame" in msg
    assert "torch.compile bug" in msg.split("-> fix:")[1]


def test_same_error_raised_by_the_model_is_not_a_compile_failure():
    with pytest.raises(AssertionError) as info:
        assert False, "Guard failed on the same frame it was created"  # the model's own code
    assert not is_compile_failure(info.value)


def test_out_of_memory_inside_compiled_code_is_not_a_compile_failure():
    import torch._inductor.utils as where
    with pytest.raises(torch.OutOfMemoryError) as info:
        exec(compile("raise OOM('CUDA out of memory')", where.__file__, "exec"),
             {"__name__": where.__name__, "OOM": torch.OutOfMemoryError})
    assert not is_compile_failure(info.value)


def test_error_in_inductor_generated_code_is_a_compile_failure():
    with pytest.raises(IndexError) as info:
        exec(compile("raise IndexError('out of bounds')", "/tmp/torchinductor_x/ab/cabc.py", "exec"),
             {"__name__": "cabc", "async_compile": object()})
    assert is_compile_failure(info.value)
    assert "raised in inductor-generated code" in explain(info.value)


def test_engine_falls_back_when_compiled_region_raises_from_dynamo(monkeypatch):
    """The failure reaches CompiledModel.run from inside the compiled call: the call is answered
    eagerly and compile is switched off with the runtime message."""
    from compile_core.run import engine
    from compile_core.cache.registry import ReuseRegistry
    from compile_core.plan.settings import CompileSettings, build_compile_args

    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    settings = CompileSettings.from_args(build_compile_args(background_compile=False,
        backend="eager", mode="default", compile_transformer_blocks_only=False))
    cm = engine.prepare(model, settings, registry=ReuseRegistry())
    cm.entry.compiled = lambda module, *a, **k: _raise_from_dynamo_guards()
    x = torch.randn(2, 4)
    out = cm.run(model, lambda: model(x), torch.device("cpu"))
    torch.testing.assert_close(out, model(x))
    assert "Guard failed on the same frame" in cm.entry.failed
    assert "compiled code failed while running" in cm.entry.failed
