"""compile_core.plan.preflight: a broken toolchain or an unsupported GPU is found before compiling,
with an actionable message and the model left eager, and torch features are detected.

The C++ compiler checks run for real (a script that exits 1 stands in for a broken compiler;
this machine's g++ is the working one). The CUDA checks use a FAKE device: there is no GPU
here, so ``torch.cuda.get_device_capability`` and ``has_triton`` are monkeypatched. The
Windows branches (MSVC, long paths) are in ``test_windows.py``.
"""
from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch._inductor.config as inductor_config
from torch._inductor import cpp_builder

from compile_core.plan import preflight as pf
from compile_core.plan.settings import CompileSettings, build_compile_args

REPO_ROOT = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")
CUDA = torch.device("cuda", 0)
FP8 = getattr(torch, "float8_e4m3fn", None)


def settings(**kw):
    kw.setdefault("backend", "inductor")
    kw.setdefault("mode", "default")
    kw.setdefault("background_compile", False)
    return CompileSettings.from_args(build_compile_args(**kw))


def _clear_compiler_caches():
    pf._cpp_compiler_problem.cache_clear()
    cpp_builder.cpp_compiler_search.cache_clear()


def _write_failing_compiler(path: Path) -> Path:
    path.write_text("#!/bin/sh\necho 'tcs test: this compiler is broken' >&2\nexit 1\n")
    path.chmod(0o755)
    return path


@pytest.fixture
def failing_cxx(tmp_path, monkeypatch):
    """CXX and CC point at a script that exits 1, as inductor sees it: torch reads CXX into
    ``torch._inductor.config.cpp.cxx`` when inductor's config is imported, so that is patched too
    (``test_failing_cxx_set_before_torch_starts`` covers the environment-only path)."""
    script = _write_failing_compiler(tmp_path / "broken-g++")
    monkeypatch.setenv("CXX", str(script))
    monkeypatch.setenv("CC", str(script))
    _clear_compiler_caches()
    with inductor_config.patch({"cpp.cxx": (None, str(script))}):
        yield script
    _clear_compiler_caches()


@pytest.fixture
def fake_cuda(monkeypatch):
    """FAKE CUDA device: ``capability`` and ``triton`` say what the checks will see."""
    import torch.utils._triton as triton_utils

    ns = types.SimpleNamespace(capability=(8, 6), triton=True, asked=[])

    def capability(device=None):
        ns.asked.append(device)
        return ns.capability

    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    monkeypatch.setattr(triton_utils, "has_triton", lambda: ns.triton)
    return ns


# --------------------------------------------------------------------------- C++ compiler (CPU)

def test_failing_compiler_is_reported(failing_cxx):
    problem = pf.cpp_compiler_problem()
    assert problem and "C++ compiler" in problem, problem


def test_failing_compiler_makes_inductor_on_cpu_stay_eager_with_the_fix(failing_cxx):
    checked, findings = pf.preflight(settings(), CPU, {torch.float32})
    assert checked is None
    assert len(findings) == 1 and findings[0].check == "cpp-compiler"
    msg = findings[0].message
    assert "C++ compiler" in msg and "g++" in msg and "CXX" in msg, msg  # the reason and the fix
    assert "eager" in msg


def test_failing_cxx_set_before_torch_starts(tmp_path):
    """The server's real situation: CXX/CC in the environment before torch is imported."""
    script = _write_failing_compiler(tmp_path / "broken-cc")
    code = ("import json, torch\n"
            "from compile_core.plan import preflight as pf\n"
            "from compile_core.plan.settings import CompileSettings, build_compile_args\n"
            "s = CompileSettings.from_args(build_compile_args(backend='inductor', mode='default'))\n"
            "checked, findings = pf.preflight(s, torch.device('cpu'), {torch.float32})\n"
            "print(json.dumps({'problem': pf.cpp_compiler_problem(), 'checked': checked is not None,"
            " 'messages': [f.message for f in findings]}))\n")
    env = {**os.environ, "CXX": str(script), "CC": str(script), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["problem"] and out["checked"] is False
    assert len(out["messages"]) == 1 and "g++" in out["messages"][0]


def test_working_compiler_leaves_settings_unchanged():
    _clear_compiler_caches()
    assert pf.cpp_compiler_problem() == ""
    s = settings(mode="max-autotune-no-cudagraphs")
    checked, findings = pf.preflight(s, CPU, {torch.float32, torch.bfloat16})
    assert checked is s and findings == []


def test_compiler_check_is_cached_and_follows_a_changed_compiler(tmp_path):
    _clear_compiler_caches()
    assert pf.cpp_compiler_problem() == ""
    hits = pf._cpp_compiler_problem.cache_info().hits
    assert pf.cpp_compiler_problem() == ""
    assert pf._cpp_compiler_problem.cache_info().hits == hits + 1  # no second subprocess
    script = _write_failing_compiler(tmp_path / "other-g++")
    with inductor_config.patch({"cpp.cxx": (None, str(script))}):
        assert pf.cpp_compiler_problem(), "a changed compiler must be checked again"
    cpp_builder.cpp_compiler_search.cache_clear()
    assert pf.cpp_compiler_problem() == ""


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
@pytest.mark.parametrize("zero", [{"dynamo_cache_size_limit": 0}, {"dynamo_recompile_limit": 0},
                                  {"dynamo_cache_size_limit": 0, "dynamo_recompile_limit": 0}])
def test_a_limit_of_0_keeps_the_model_eager_naming_the_limit(backend, zero):
    """At 0 torch's dynamo compiles nothing (every frame runs eagerly), so the pack does not
    compile and says which limit is 0."""
    checked, findings = pf.preflight(settings(backend=backend, **zero), CPU, {torch.float32})
    assert checked is None and [f.check for f in findings] == ["limit-zero"]
    for key in zero:
        assert key in findings[0].message
    assert "set it to 1 or more" in findings[0].message


def test_a_limit_of_0_is_torchs_own_compile_nothing():
    """What the message says is what torch does: with the limit at 0 dynamo traces nothing."""
    import torch._dynamo
    from compile_core.torch_support import scoped
    traced = []

    def backend(gm, example_inputs):
        traced.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with scoped.scoped_state(), torch._dynamo.config.patch(recompile_limit=0):
        out = torch.compile(lambda x: x.sin() + 1, backend=backend)(torch.ones(3))
    torch._dynamo.reset()
    assert traced == [] and torch.equal(out, torch.ones(3).sin() + 1)


@pytest.mark.parametrize("backend", ["aot_eager", "eager", "cudagraphs"])
def test_other_backends_skip_the_checks(failing_cxx, fake_cuda, backend):
    fake_cuda.triton = False
    fake_cuda.capability = (7, 5)
    s = settings(backend=backend)
    for device, dtypes in ((CPU, {torch.float32}), (CUDA, {torch.float16} | ({FP8} if FP8 else set()))):
        checked, findings = pf.preflight(s, device, dtypes)
        assert checked is s and findings == []
    assert fake_cuda.asked == []


# --------------------------------------------------------------------------- CUDA (FAKE device)

@pytest.mark.skipif(FP8 is None, reason="this torch has no float8_e4m3fn")
def test_fp8_e4m3_on_sm86_stays_eager_and_names_sm89(fake_cuda):
    fake_cuda.capability = (8, 6)
    checked, findings = pf.preflight(settings(), CUDA, {FP8, torch.bfloat16})
    assert checked is None
    assert [f.check for f in findings] == ["fp8"]
    msg = findings[0].message
    assert "sm 8.9" in msg and "sm 8.6" in msg and "fp16/bf16" in msg, msg


@pytest.mark.skipif(FP8 is None, reason="this torch has no float8_e4m3fn")
@pytest.mark.parametrize("capability", [(8, 9), (9, 0), (12, 0)])
def test_fp8_e4m3_on_new_gpus_compiles(fake_cuda, capability):
    fake_cuda.capability = capability
    s = settings()
    checked, findings = pf.preflight(s, CUDA, {FP8})
    assert checked is s and findings == []


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32]
                         + ([torch.float8_e5m2] if hasattr(torch, "float8_e5m2") else []))
def test_other_dtypes_on_sm86_compile(fake_cuda, dtype):
    fake_cuda.capability = (8, 6)
    s = settings()
    checked, findings = pf.preflight(s, CUDA, {dtype})
    assert checked is s and findings == []


@pytest.mark.parametrize("mode", ["default", "max-autotune-no-cudagraphs", "speed"])
def test_missing_triton_leaves_the_model_eager_with_the_fix(fake_cuda, mode):
    """Not 'cudagraphs' instead: cudagraph trees re-record for every shape under the ``auto``
    marks and hold private memory pools, which tight VRAM cannot afford."""
    fake_cuda.triton = False
    checked, findings = pf.preflight(settings(mode=mode), CUDA, {torch.float16})
    assert checked is None
    assert [f.check for f in findings] == ["triton"]
    msg = findings[0].message
    assert "eager" in msg and "cudagraphs" not in msg and "pip install the triton" in msg, msg


@pytest.mark.parametrize("version, pin", [("2.9.1+cu128", "triton-windows<3.6"),
                                          ("2.10.0+cu130", "triton-windows<3.7"),
                                          ("2.6.0+cu126", "triton-windows<3.3")])
def test_missing_triton_on_windows_names_the_matching_triton_windows(fake_cuda, monkeypatch,
                                                                    version, pin):
    fake_cuda.triton = False
    monkeypatch.setattr(sys, "platform", "win32")  # FAKE Windows
    monkeypatch.setattr(torch, "__version__", version)
    checked, findings = pf.preflight(settings(), CUDA, {torch.float16})
    assert checked is None and len(findings) == 1
    msg = findings[0].message
    assert f'"{sys.executable}" -m pip install -U "{pin}"' in msg, msg  # the embedded Python too
    assert "eager" in msg and "cudagraphs" not in msg


def test_missing_triton_on_windows_with_an_unlisted_torch_gives_the_rule(fake_cuda, monkeypatch):
    fake_cuda.triton = False
    monkeypatch.setattr(sys, "platform", "win32")  # FAKE Windows
    monkeypatch.setattr(torch, "__version__", "2.13.0+cu130")
    _, findings = pf.preflight(settings(), CUDA, {torch.float16})
    msg = findings[0].message
    assert "triton-windows" in msg and "README" in msg and "torch 2.13.0+cu130" in msg, msg


def test_gpu_older_than_triton_supports_says_so_not_pip_install(fake_cuda):
    fake_cuda.capability = (6, 1)  # a Pascal card: torch's has_triton() is False there
    fake_cuda.triton = False
    checked, findings = pf.preflight(settings(), CUDA, {torch.float16})
    assert checked is None
    assert [f.check for f in findings] == ["triton"]
    assert "sm_61" in findings[0].message and "pip install" not in findings[0].message
    assert "eager" in findings[0].message


def test_triton_and_compiler_present_leave_cuda_settings_unchanged(fake_cuda, failing_cxx):
    """On CUDA inductor generates Triton, not C++: a broken host compiler is not checked there."""
    fake_cuda.capability = (9, 0)
    s = settings()
    checked, findings = pf.preflight(s, CUDA, {torch.bfloat16})
    assert checked is s and findings == []


def test_triton_problem_on_this_machine_says_why():
    problem = pf.triton_problem()
    assert isinstance(problem, str)
    if problem:  # CPU-only torch here: either no triton or no driver
        assert "Triton" in problem or "triton" in problem


# --------------------------------------------------------------------------- torch features

def test_torch_features_are_detected_booleans():
    feats = pf.torch_features()
    assert set(feats) >= {"isolate_recompiles", "compile_recompile_limit", "guard_filter_fn",
                          "cache_artifacts"}
    assert all(isinstance(v, bool) for v in feats.values()), feats
    params = inspect.signature(torch.compile).parameters
    assert feats["isolate_recompiles"] is ("isolate_recompiles" in params)
    assert feats["compile_recompile_limit"] is ("recompile_limit" in params)
    assert feats["cache_artifacts"] is hasattr(torch.compiler, "save_cache_artifacts")


@pytest.mark.skipif("isolate_recompiles" not in inspect.signature(torch.compile).parameters,
                    reason="torch.compile has no isolate_recompiles parameter on this torch")
def test_isolate_recompiles_is_detected_on_this_torch():
    """Where ``torch.compile(isolate_recompiles=)`` exists (2.13) the probe finds it working;
    the engine relies on it."""
    assert pf.torch_features()["isolate_recompiles"] is True
    assert pf.torch_features() is pf.torch_features()  # computed once
