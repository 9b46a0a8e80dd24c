"""Checks before compiling, each with an actionable message and a sensible downgrade.

``preflight()`` returns the settings to compile with (possibly downgraded) or ``None`` when
compiling here cannot work (the model then stays eager), plus the findings to log once.
Torch features are detected, never assumed from the version number.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import subprocess

import torch

from .settings import CompileSettings


@dataclasses.dataclass(frozen=True)
class Finding:
    check: str
    message: str


@functools.lru_cache(maxsize=None)
def torch_features() -> dict[str, bool]:
    params = set(inspect.signature(torch.compile).parameters)
    try:
        import torch._dynamo.decorators as dec
        unbacked = hasattr(dec, "mark_unbacked")
    except ImportError:
        unbacked = False
    src = inspect.getsource(torch.compile) if hasattr(torch.compile, "__code__") else ""
    return {
        "isolate_recompiles": "isolate_recompiles" in params,
        "compile_recompile_limit": "recompile_limit" in params,
        "guard_filter_fn": "guard_filter_fn" in src,
        "mark_unbacked": unbacked,
        "nested_compile_region": hasattr(torch.compiler, "nested_compile_region"),
        "cache_artifacts": hasattr(torch.compiler, "save_cache_artifacts"),
    }


def cpp_compiler_problem() -> str:
    """'' when inductor's C++ compiler (torch's own search: CXX / g++ / clang++) runs.
    Cached per CXX/CC value and per ``torch._inductor.config.cpp.cxx`` (the list torch really
    searches, read from CXX when inductor's config is imported), so a reuse hit does not pay
    for a subprocess and a changed compiler is checked again."""
    try:
        from torch._inductor import config as inductor_config
        search = repr(inductor_config.cpp.cxx)
    except Exception:  # noqa: BLE001 - no inductor: the search below reports it
        search = ""
    return _cpp_compiler_problem(os.environ.get("CXX"), os.environ.get("CC"), search)


@functools.lru_cache(maxsize=8)
def _cpp_compiler_problem(_cxx, _cc, _search) -> str:
    try:
        from torch._inductor import cpp_builder
        compiler = cpp_builder.get_cpp_compiler()
    except Exception as exc:  # noqa: BLE001 - torch raises various errors when none is found
        return f"no C++ compiler found ({exc.__class__.__name__}: {exc})"
    try:
        proc = subprocess.run([compiler, "--version"], capture_output=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"C++ compiler {compiler!r} cannot run ({exc})"
    if proc.returncode != 0:
        return f"C++ compiler {compiler!r} fails (exit {proc.returncode})"
    return ""


def triton_problem(device: torch.device | None = None) -> str:
    if device is not None and device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (7, 0):  # torch's has_triton() is False there whatever is installed
            return f"this GPU (sm_{major}{minor}) is older than Triton supports (sm_70 or newer)"
    try:
        from torch.utils._triton import has_triton
        if not has_triton():
            return "Triton is not installed or finds no GPU driver"
    except ImportError:
        return "this torch build has no Triton support"
    return ""


def preflight(settings: CompileSettings, device: torch.device,
              param_dtypes: set[torch.dtype]) -> tuple[CompileSettings | None, list[Finding]]:
    findings: list[Finding] = []
    if settings.backend != "inductor":
        return settings, findings
    if device.type == "cpu":
        problem = cpp_compiler_problem()
        if problem:
            findings.append(Finding("cpp-compiler", f"{problem}: inductor on CPU needs one. Install "
                                    "g++ (apt-get install g++) or set CXX; the model stays eager."))
            return None, findings
    elif device.type == "cuda":
        problem = triton_problem(device)
        if problem:
            fix = "" if problem.startswith("this GPU") else " pip install the triton matching this torch;"
            findings.append(Finding("triton", f"{problem}: inductor on CUDA needs Triton.{fix} "
                                    "Falling back to backend 'cudagraphs' (no kernel fusion)."))
            return dataclasses.replace(settings, backend="cudagraphs", mode="default"), findings
        fp8 = {d for d in param_dtypes if "float8_e4m3" in str(d)}
        if fp8:
            major, minor = torch.cuda.get_device_capability(device)
            if (major, minor) < (8, 9):
                findings.append(Finding("fp8", f"fp8 e4m3 weights need sm 8.9+ for compiled kernels; "
                                        f"this GPU is sm {major}.{minor}. Load the model in fp16/bf16 "
                                        "(weight_dtype default) to compile it; it stays eager now."))
                return None, findings
    return settings, findings
