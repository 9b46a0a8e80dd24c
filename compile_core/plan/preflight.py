"""Checks before compiling, each with an actionable message for this platform.

``preflight()`` returns the settings to compile with, or ``None`` when compiling here cannot
work (the model then stays eager), plus the findings to log once. A missing Triton leaves the
model eager rather than switching to ``cudagraphs``: cudagraph trees re-record for every
shape under the ``auto`` marks and hold private memory pools, which tight VRAM cannot afford.
Torch features are detected, never assumed from the version number.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import re
import subprocess
import sys

import torch

from ..torch_support import aot, inductor_names, torch_compat
from ..torch_support.longpaths import on_windows
from .settings import CompileSettings


@dataclasses.dataclass(frozen=True)
class Finding:
    check: str
    message: str


@functools.lru_cache(maxsize=None)
def torch_features() -> dict[str, bool]:
    """What this torch can do, each feature tried by ``torch_compat`` (probed once, lazily)."""
    return {
        "isolate_recompiles": torch_compat.isolate_recompiles(),
        "compile_recompile_limit": torch_compat.recompile_limit_kwarg(),
        "guard_filter_fn": torch_compat.guard_filter_fn(),
        "cache_artifacts": aot.cache_artifacts(),
        "aot_compile": aot.aot_compile_knobs() is not None,
        "load_compiled_function": aot.load_compiled_function(),
        "backed_size_oblivious_safe": torch_compat.backed_size_oblivious_safe(),
    }


def cpp_compiler_problem() -> str:
    """'' when inductor's C++ compiler (torch's own search: CXX / g++ / clang++, or on Windows
    CXX / ``cl``) runs. Cached per CXX/CC value, PATH (a Visual Studio prompt puts ``cl`` there)
    and ``torch._inductor.config.cpp.cxx`` (the list torch really searches, read from CXX when
    inductor's config is imported), so a reuse hit does not pay for a subprocess and a changed
    compiler is checked again."""
    try:
        from torch._inductor import config as inductor_config
        search = repr(inductor_config.cpp.cxx)
    except Exception:  # noqa: BLE001 - no inductor: the search below reports it
        search = ""
    env = os.environ
    return _cpp_compiler_problem(env.get("CXX"), env.get("CC"), search, env.get("PATH"),
                                 sys.platform)


@functools.lru_cache(maxsize=8)
def _cpp_compiler_problem(_cxx, _cc, _search, _path, _platform) -> str:
    try:
        compiler = inductor_names.cpp_compiler()
    except subprocess.CalledProcessError as exc:  # torch 2.9 on Windows runs ``cl /help`` here
        cmd = exc.cmd[0] if isinstance(exc.cmd, (list, tuple)) and exc.cmd else exc.cmd
        return f"C++ compiler {cmd!r} fails (exit {exc.returncode})"
    except Exception as exc:  # noqa: BLE001 - torch raises various errors when none is found
        return f"no C++ compiler found ({exc.__class__.__name__}: {exc})"
    return _msvc_problem(compiler) if on_windows() else _gnu_problem(compiler)


def _gnu_problem(compiler: str) -> str:
    try:
        proc = subprocess.run([compiler, "--version"], capture_output=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"C++ compiler {compiler!r} cannot run ({exc})"
    if proc.returncode != 0:
        return f"C++ compiler {compiler!r} fails (exit {proc.returncode})"
    return ""


def _msvc_problem(compiler: str) -> str:
    """MSVC's ``cl`` has no ``--version``: probe it as torch does (``/help``, the banner on the
    first line); clang-cl and icx-cl answer ``/help`` with exit 0."""
    try:
        proc = subprocess.run([compiler, "/help"], capture_output=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"C++ compiler {compiler!r} cannot run ({exc})"
    if proc.returncode != 0 and b"Microsoft" not in (proc.stdout + proc.stderr)[:200]:
        return f"C++ compiler {compiler!r} fails (exit {proc.returncode})"
    return ""


def compiler_banner(compiler: str) -> str:
    """The compiler's first line of version text ('' when it gives none): ``--version``, or
    ``/help`` on Windows (MSVC prints its banner there, to stderr)."""
    windows = on_windows()
    proc = subprocess.run([compiler, "/help" if windows else "--version"], capture_output=True,
                          text=True, timeout=20)
    lines = ((proc.stderr + proc.stdout) if windows else proc.stdout).splitlines()
    return lines[0] if lines else ""


def cpp_compiler_fix() -> str:
    if on_windows():
        return ("Install Visual Studio Build Tools with the \"Desktop development with C++\" "
                "workload and start ComfyUI from an \"x64 Native Tools Command Prompt for VS\" "
                "(or call vcvars64.bat first in the .bat that starts it), so cl.exe and its "
                "INCLUDE/LIB are set; or set CXX")
    return "Install g++ (apt-get install g++) or set CXX"


# The triton-windows minor version each torch minor version works with (triton-windows README).
TRITON_WINDOWS = {(2, 4): (3, 1), (2, 5): (3, 1), (2, 6): (3, 2), (2, 7): (3, 3), (2, 8): (3, 4),
                  (2, 9): (3, 5), (2, 10): (3, 6)}


def triton_fix(torch_version: str | None = None) -> str:
    """How to install the Triton this torch needs."""
    version = torch_version or torch.__version__
    if not on_windows():
        return (f"pip install the triton that torch {version} pins (the one its pytorch.org wheel "
                "installs)")
    pip = f'"{sys.executable}" -m pip install -U'
    found = re.match(r"(\d+)\.(\d+)", version)
    triton = TRITON_WINDOWS.get((int(found[1]), int(found[2]))) if found else None
    if triton is None:
        return (f"{pip} the triton-windows for torch {version}: the triton-windows README lists "
                "the Triton minor version each torch needs; pin below the next one (torch 2.10: "
                '"triton-windows<3.7")')
    return f'{pip} "triton-windows<{triton[0]}.{triton[1] + 1}" (Triton {triton[0]}.{triton[1]} ' \
           f"matches torch {version})"


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


def limit_zero(settings: CompileSettings) -> str:
    """The message when a limit of 0 (accepted, as the original pack and WanVideoWrapper accept
    it) turns compile off: at 0 torch's dynamo compiles nothing and runs every frame eagerly."""
    zero = [k for k, v in (("dynamo_cache_size_limit", settings.cache_size_limit),
                           ("dynamo_recompile_limit", settings.recompile_limit)) if v == 0]
    if not zero:
        return ""
    return (f"{' and '.join(zero)} is 0, and at 0 torch compiles nothing, so the model runs "
            "eagerly; set it to 1 or more to compile.")


def preflight(settings: CompileSettings, device: torch.device,
              param_dtypes: set[torch.dtype]) -> tuple[CompileSettings | None, list[Finding]]:
    findings: list[Finding] = []
    off = limit_zero(settings)
    if off:
        findings.append(Finding("limit-zero", off))
        return None, findings
    if settings.backend != "inductor":
        return settings, findings
    if device.type == "cpu":
        problem = cpp_compiler_problem()
        if problem:
            findings.append(Finding("cpp-compiler", f"{problem}: inductor on CPU needs one. "
                                    f"{cpp_compiler_fix()}; the model stays eager."))
            return None, findings
    elif device.type == "cuda":
        problem = triton_problem(device)
        if problem:
            fix = "" if problem.startswith("this GPU") else f" Fix: {triton_fix()}."
            findings.append(Finding("triton", f"{problem}: inductor on CUDA needs Triton, so the "
                                    f"model stays eager.{fix}"))
            return None, findings
        fp8 = {d for d in param_dtypes if "float8_e4m3" in str(d)}
        if fp8:
            major, minor = torch.cuda.get_device_capability(device)
            if (major, minor) < (8, 9):
                findings.append(Finding("fp8", f"fp8 e4m3 weights need sm 8.9+ for compiled kernels; "
                                        f"this GPU is sm {major}.{minor}. Load the model in fp16/bf16 "
                                        "(weight_dtype default) to compile it; it stays eager now."))
                return None, findings
    return settings, findings
