"""Graph breaks with reasons and the user's file:line, found by tracing one module of each
region type on inputs captured from a real eager call (what ``torch._dynamo.explain`` does,
minus its ``torch._dynamo.reset()``, which would drop every compiled graph in the process)."""
from __future__ import annotations

import contextlib
import dataclasses
import os
import types
from typing import Callable, Iterator

import torch
from torch import nn

from ..torch_support import dynamo_records, scoped, torch_compat


@dataclasses.dataclass
class GraphBreak:
    """One place where dynamo had to cut the graph, seen from the outermost traced frame."""
    reason: str                 # dynamo's reason text (first line: what; then Explanation/Hints)
    where: str                  # "file:line in function": innermost frame of user (model) code
    inside: str = ""            # innermost frame, when that is library code (torch, site-packages)
    stack: list[str] = dataclasses.field(default_factory=list)  # all frames, outermost first
    splits: int = 1             # frames cut by it (a break in nested calls cuts each caller too)
    region: str = ""            # the region type it was found in

    @property
    def summary(self) -> str:
        """The first line of the reason, plus dynamo's one-line Explanation when it has one."""
        lines = [ln.strip() for ln in self.reason.splitlines() if ln.strip()]
        if not lines:
            return "(no reason given)"
        out = lines[0]
        for ln in lines[1:]:
            if ln.startswith("Explanation:"):
                out += " - " + ln[len("Explanation:"):].strip()
                break
        return out

    @property
    def callers(self) -> list[str]:
        """The frames that led to ``where``, innermost first."""
        try:
            i = self.stack.index(self.where)
        except ValueError:
            return []
        return list(reversed(self.stack[:i]))


def _library_dirs() -> tuple[str, ...]:
    import sysconfig
    paths = sysconfig.get_paths()
    dirs = {_TORCH_DIR, paths.get("stdlib", ""), paths.get("platstdlib", "")}
    return tuple(sorted(d.rstrip(os.sep) + os.sep for d in dirs if d))


_TORCH_DIR = os.path.dirname(torch.__file__)
_LIBRARY_DIRS = _library_dirs()


def is_library(filename: str) -> bool:
    """torch, the standard library and installed packages: not the model's own code."""
    return (filename.startswith(_LIBRARY_DIRS) or f"{os.sep}site-packages{os.sep}" in filename
            or f"{os.sep}dist-packages{os.sep}" in filename)


def _frame_text(fs) -> str:
    return f"{fs.filename}:{fs.lineno} in {fs.name}"


def _user_frame(stack):
    """The innermost frame of user code; else the innermost outside torch; else the innermost."""
    for keep in (lambda f: not is_library(f.filename),
                 lambda f: not f.filename.startswith(_TORCH_DIR + os.sep)):
        for fs in reversed(stack):
            if keep(fs):
                return fs
    return stack[-1] if stack else None


def breaks_from_records(records, region: str = "") -> list[GraphBreak]:
    """Graph breaks from dynamo's ``GraphCompileReason`` records (``.reason``, ``.user_stack``).

    A break inside nested calls is recorded once per frame it cuts (the caller breaks at the
    call, then the callee, ...); those records' stacks are suffixes of the outermost one, so
    they are folded into it and counted in ``splits``."""
    items = []
    for index, r in enumerate(records):
        frames = list(getattr(r, "user_stack", None) or [])
        key = tuple((f.filename, f.lineno, f.name) for f in frames)
        items.append((str(getattr(r, "reason", "") or ""), key, frames, index))
    kept: list[list] = []  # [reason, key, frames, first index, splits]
    for reason, key, frames, index in sorted(items, key=lambda it: (-len(it[1]), it[3])):
        for k in kept:
            if k[0] == reason and k[1][len(k[1]) - len(key):] == key:
                k[3], k[4] = min(k[3], index), k[4] + 1
                break
        else:
            kept.append([reason, key, frames, index, 1])
    out = []
    for reason, _key, frames, _index, splits in sorted(kept, key=lambda k: k[3]):  # as they ran
        user = _user_frame(frames)
        inner = frames[-1] if frames else None
        out.append(GraphBreak(
            reason=reason, where=_frame_text(user) if user is not None else "(unknown location)",
            inside=_frame_text(inner) if inner is not None and inner is not user else "",
            stack=[_frame_text(f) for f in frames], splits=splits, region=region))
    return out


def _fresh_function(fn: Callable) -> Callable:
    """``fn`` with a code object of its own, so dynamo's cache entries for it die with it."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__,
                              fn.__defaults__, fn.__closure__)


def find_graph_breaks(module: nn.Module, args: tuple, kwargs: dict) -> list[GraphBreak]:
    """Trace ``module(*args, **kwargs)`` with dynamo and return its graph breaks.

    This is ``torch._dynamo.explain``'s mechanism (a backend that collects each graph's
    ``compile_subgraph_reason``) without its two ``torch._dynamo.reset()`` calls: those drop
    every compiled graph in the process, so the next sampling run would compile everything
    again. The call really runs (its graphs run as plain FX code). Frames dynamo compiles for
    it keep a cache entry for this backend only; the pack's compiled runs never use it.
    It runs inside ``scoped.scoped_state``: torch (2.9) sets ``TORCHINDUCTOR_CACHE_DIR`` while
    compiling, and that must not outlive the trace whoever calls this."""
    with scoped.scoped_state():
        return _find_graph_breaks(module, args, kwargs, torch_compat.isolate_recompiles())


def _find_graph_breaks(module: nn.Module, args: tuple, kwargs: dict, isolate: bool) -> list[GraphBreak]:
    records = []

    def collect(gm, example_inputs):
        reason = getattr(gm, "compile_subgraph_reason", None)
        if reason is not None and reason.graph_break:
            records.append(reason)
        return gm.forward

    def target(*a, **k):
        return module(*a, **k)

    kw = {"backend": collect, "fullgraph": False, "dynamic": False}
    if isolate:
        kw["isolate_recompiles"] = True  # its own recompile budget, never the pack's
    before = _break_counts()
    torch.compile(_fresh_function(target), **kw)(*args, **kwargs)
    region = type(module).__name__
    out = breaks_from_records(records, region)
    # A break with nothing traced before it in its frame compiles no graph, so the backend
    # never sees it; dynamo's counters still do (by reason, without a location).
    seen = {b.reason for b in out}
    for reason, n in _break_counts().items():
        if n > before.get(reason, 0) and reason not in seen:
            out.append(GraphBreak(reason=reason, where=UNLOCATED, region=region))
    return out


UNLOCATED = "(location not recorded: nothing was traced before this break in its frame)"


def _break_counts() -> dict[str, int]:
    """Dynamo's graph-break counts by reason (``dynamo_records.graph_breaks_by_reason``)."""
    return dynamo_records.graph_breaks_by_reason()


@contextlib.contextmanager
def capture_inputs(modules: list[nn.Module]) -> Iterator[dict]:
    """Record the ``(args, kwargs)`` of the first call of each module while the block runs.

    Yields ``{module_index: (args, kwargs)}``. The hooks are removed on exit: a hook left on a
    region would be traced into (and guarded by) the compiled graph."""
    captured: dict[int, tuple[tuple, dict]] = {}
    handles = []

    def hook_for(i):
        def hook(mod, args, kwargs):
            captured.setdefault(i, (tuple(args), dict(kwargs)))
        return hook

    try:
        for i, m in enumerate(modules):
            handles.append(m.register_forward_pre_hook(hook_for(i), with_kwargs=True))
        yield captured
    finally:
        for h in handles:
            h.remove()


def one_per_type(modules: list[nn.Module]) -> list[nn.Module]:
    """The first module of each class (identical blocks share code, so share graph breaks)."""
    seen, out = set(), []
    for m in modules:
        if type(m) not in seen:
            seen.add(type(m))
            out.append(m)
    return out
