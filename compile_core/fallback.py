"""Telling a compile failure from a real error, and saying plainly what to do about it."""
from __future__ import annotations

_COMPILER_MODULES = ("torch._dynamo", "torch._inductor", "torch._functorch", "torch.fx",
                     "triton", "torch.utils._triton")


def is_compile_failure(exc: BaseException) -> bool:
    """True for errors raised by tracing/compiling (safe to retry eagerly); False for e.g. OOM,
    user interrupts or shape errors in the model itself, which must reach the user unchanged."""
    try:
        from torch._dynamo.exc import TorchDynamoException
        if isinstance(exc, TorchDynamoException):
            return True
    except ImportError:
        pass
    for cls in type(exc).__mro__:
        if cls.__module__.startswith(_COMPILER_MODULES):
            return True
    return False


def explain(exc: BaseException) -> str:
    """One line: what failed and the fix."""
    text = f"{type(exc).__name__}: {exc}".strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    first = lines[0] if lines else type(exc).__name__
    if first.endswith(":") and len(lines) > 1:  # "backend='x' raised:" + the cause on the next line
        first = f"{first} {lines[1]}"
    first = first[:300]
    low = text.lower()
    if "cppcompileerror" in low or "c++ compile" in low or "compiler" in low and ("cxx" in low or "gcc" in low or "g++" in low):
        fix = "install a working C/C++ compiler (gcc/g++) or point CXX at one"
    elif "triton" in low:
        fix = "install a Triton build that matches this torch, or use backend 'aot_eager'"
    elif "backend" in low:
        fix = "choose another backend in Torch Compile Speed Settings"
    else:
        fix = "try compile_transformer_blocks_only, another backend, or turn compile off"
    return f"{first} -> fix: {fix}"
