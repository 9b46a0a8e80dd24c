"""Private torch names: only ``compile_core/torch_support`` reaches them (``torch._dynamo.config``
and ``torch._inductor.config`` knobs aside), and every one it reaches is still where it was
on this torch, so a rename fails here and not in a user's workflow."""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest
import torch

from compile_core.torch_support import probing

CORE = Path(__file__).resolve().parents[2] / "compile_core"
KNOBS = ("torch._dynamo.config", "torch._inductor.config")


def _dotted(node: ast.AST) -> str:
    """``a.b.c`` for an attribute chain on a name, else ''."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else ""


def _private_names(path: Path) -> set[str]:
    """The ``torch._*`` names the code of ``path`` imports or reads (a module whose own names
    are listed counts through them)."""
    found = set()

    def visit(node):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch._"):
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("torch._"))
        elif isinstance(node, ast.Attribute):
            name = _dotted(node)
            if name.startswith("torch._") and not name.startswith("torch.__"):
                found.add(name)
                return
        for child in ast.iter_child_nodes(node):
            visit(child)
    visit(ast.parse(path.read_text(encoding="utf-8")))
    names = {n for n in found if not n.startswith(KNOBS)}
    return {n for n in names if not any(o.startswith(n + ".") for o in names)}


def test_only_torch_support_reaches_private_torch_names():
    outside = {str(p.relative_to(CORE)): sorted(_private_names(p)) for p in CORE.rglob("*.py")
               if "torch_support" not in p.parts and _private_names(p)}
    assert outside == {}


def test_the_pack_reaches_no_more_private_torch_names_than_now():
    every = set().union(*(_private_names(p) for p in CORE.rglob("*.py")))
    names = {n for n in every if not any(o.startswith(n + ".") for o in every)}
    assert len(names) <= 20, sorted(names)


# (module, attribute, the oldest torch that has it): each name torch_support reaches on every
# torch it supports. The names of the weight-fetch op's opaque objects change from one torch to
# the next (``weight_fetch``): the probe table of test_torch_compat fails when they move.
REACHED = [("torch._dynamo.utils", "counters", (2, 8)), ("torch._dynamo.utils", "get_compilation_metrics", (2, 8)),
           ("torch._dynamo", "maybe_mark_dynamic", (2, 8)),
           ("torch._dynamo.convert_frame", "compile_lock", (2, 8)),
           ("torch._dynamo.guards", "CheckFunctionManager", (2, 8)),
           ("torch._dynamo.guards", "GuardsStatePickler", (2, 8)),
           ("torch._utils", "_set_obj_state", (2, 8)), ("torch._subclasses", "FakeTensor", (2, 8)),
           ("torch._inductor.codecache", "_HEADER_DIR", (2, 8)),
           ("torch._inductor.loop_body", "InterpreterShim", (2, 8)),
           ("torch._inductor", "list_mode_options", (2, 8)), ("torch._inductor.cpp_builder", "get_cpp_compiler", (2, 8)),
           ("torch._inductor.utils", "clear_caches", (2, 8)),
           ("torch", "_TorchCompileInductorWrapper", (2, 8)), ("torch", "_TorchCompileWrapper", (2, 8))]


@pytest.mark.parametrize("module, name, since", REACHED, ids=[f"{m}.{n}" for m, n, _ in REACHED])
def test_each_private_name_is_still_where_torch_support_looks(module, name, since):
    if probing.version() < since:
        pytest.skip(f"torch {torch.__version__} is older than {since}")
    assert hasattr(importlib.import_module(module), name)
