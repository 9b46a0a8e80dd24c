"""Telling a compile failure from a real error, and saying plainly what to do about it."""
from __future__ import annotations

_COMPILER_MODULES = ("torch._dynamo", "torch._inductor", "torch._functorch", "torch.fx",
                     "triton", "torch.utils._triton")


# dynamo's fake-tensor / symbolic-shape failures (e.g. torch 2.8/2.9 with backed_size_oblivious
# on WAN: "Attempting to broadcast a dimension of length s27")
_SYMBOLIC_SHAPE_ERRORS = ("attempting to broadcast a dimension of length",
                          "failed to run fx node with fake tensors", "guardondatadependentsymnode",
                          "data-dependent", "constraint violation")


def is_compile_failure(exc: BaseException) -> bool:
    """True for errors raised by tracing/compiling or by compiled code while it runs (safe to
    retry eagerly); False for e.g. OOM, user interrupts or shape errors in the model itself,
    which must reach the user unchanged."""
    return _compiler_exception(exc) or bool(raised_in_compiler(exc))


def _compiler_exception(exc: BaseException) -> bool:
    """An exception class of dynamo (``torch._dynamo.exc``) or of another compiler module."""
    return any(cls.__module__.startswith(_COMPILER_MODULES) for cls in type(exc).__mro__)


def raised_in_compiler(exc: BaseException) -> str:
    """Where a plain exception (e.g. dynamo's ``AssertionError: Guard failed on the same frame it
    was created``) was raised, when that is compiler code: a torch._dynamo / _inductor / ...
    module or code inductor generated; "" otherwise (the model's own code, or out of memory).
    The innermost frame decides: a model error inside a compiled region is raised from the
    model's code (dynamo runs it at a graph break) or is wrapped by dynamo while tracing."""
    if isinstance(exc, (MemoryError, KeyboardInterrupt)) or type(exc).__name__ == "OutOfMemoryError":
        return ""
    tb, last = exc.__traceback__, None
    while tb is not None:
        last, tb = tb, tb.tb_next
    if last is None:
        return ""
    module = str(last.tb_frame.f_globals.get("__name__", ""))
    if module.startswith(_COMPILER_MODULES):
        return module
    return "inductor-generated code" if "async_compile" in last.tb_frame.f_globals else ""


def explain(exc: BaseException) -> str:
    """One line: what failed and the fix."""
    text = f"{type(exc).__name__}: {exc}".strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    first = lines[0] if lines else type(exc).__name__
    if first.endswith(":") and len(lines) > 1:  # "backend='x' raised:" + the cause on the next line
        first = f"{first} {lines[1]}"
    first = first[:300]
    low = text.lower()
    where = "" if _compiler_exception(exc) else raised_in_compiler(exc)
    if where:  # not a compile error as such: the compiled code failed while running
        first = f"compiled code failed while running (raised in {where}): {first}"
    if "cppcompileerror" in low or "c++ compile" in low or "compiler" in low and ("cxx" in low or "gcc" in low or "g++" in low):
        fix = "install a working C/C++ compiler (gcc/g++) or point CXX at one"
    elif any(k in low for k in _SYMBOLIC_SHAPE_ERRORS):
        fix = ("tracing with dynamic (symbolic) sizes failed on this torch: set shape_policy "
               "'static' in Torch Compile Speed Settings (one graph per latent size), or upgrade torch")
    elif where:
        fix = ("a torch.compile bug, not your model: it now runs eagerly; try another backend "
               "or torch version, or report it to PyTorch with this message")
    elif "triton" in low:
        fix = "install a Triton build that matches this torch, or use backend 'aot_eager'"
    elif "backend" in low:
        fix = "choose another backend in Torch Compile Speed Settings"
    else:
        fix = "try compile_transformer_blocks_only, another backend, or turn compile off"
    return f"{first} -> fix: {fix}"
