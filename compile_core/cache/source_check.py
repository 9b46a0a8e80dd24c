"""Binds a saved region to the code it was traced from.

A region saved with torch's AOT API runs without a dynamo trace in a later process, so none of
dynamo's checks on the code itself run there: after a ComfyUI update that changed a line of the
block's ``forward`` (or of any function the trace inlined), the saved graph would compute the
old code's output. torch records, with the compiled function, the source lines of every
function the trace inlined (``source_info.inlined_sources``: module, line range, a sha256 of the
lines) but does not compare them when ``load_compiled_function`` loads it. ``changed`` does.

A torch that records no sources cannot bind a region to its code, so nothing is saved there
(``recorded`` returns None and the capture refuses).
"""
from __future__ import annotations

import hashlib
import importlib
import inspect
import sys

# (module name, first line, last line + 1, sha256 hex of those lines)
Source = tuple[str, int, int, str]


def recorded(fn) -> list[Source] | None:
    """The inlined sources torch recorded for an ``AOTCompiledFunction``, or None where this
    torch records none (the attribute is torch's ``CompileArtifacts.source_info``)."""
    info = getattr(getattr(fn, "_artifacts", None), "source_info", None)
    sources = getattr(info, "inlined_sources", None)
    if sources is None:
        return None
    try:
        return sorted((s.module, int(s.firstlineno), int(s.lastlineno), str(s.checksum)) for s in sources)
    except (AttributeError, TypeError, ValueError):
        return None


def _module(name: str):
    module = sys.modules.get(name)
    if module is None and name.startswith("torch."):
        try:
            module = importlib.import_module(name)
        except Exception:  # noqa: BLE001 - gone in this torch: counts as changed
            return None
    return module


def digest(lines: list[str]) -> str:
    """torch's checksum of a line range: sha256 of the lines joined as they are."""
    return hashlib.sha256("".join(lines).encode()).hexdigest()


def changed(sources: list[Source]) -> str:
    """'' when every recorded line range reads the same in the code loaded now, else which one
    differs. A module that is not imported in this process counts as changed: the region then
    takes the regular path. Nothing is imported because a saved file names it, except torch's
    own modules (dynamo inlines its polyfills, which a new process imports only once it traces)."""
    for module_name, first, last, checksum in sources:
        module = _module(module_name)
        if module is None:
            return f"{module_name} is not loaded here"
        try:
            lines = inspect.getsourcelines(module)[0][first - 1:last - 1]
        except (OSError, TypeError):
            return f"the source of {module_name} cannot be read"
        if digest(lines) != checksum:
            return f"{module_name} lines {first}-{last - 1}"
    return ""
