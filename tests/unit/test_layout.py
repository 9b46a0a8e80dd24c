"""compile_core's layout: folders in layers whose imports run one way, no module over 400 lines,
no import cycle, and no package import inside a function (the way a cycle hides)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[2] / "compile_core"
# lowest first: a module imports from its own layer or the ones before it
LAYERS = ("report", "torch_support", "plan", "cache", "run", "diagnose", "api")
MAX_LINES = 400


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(CORE.rglob("*.py")):
        rel = path.relative_to(CORE).with_suffix("")
        if rel.name != "__init__":
            out[".".join(rel.parts)] = path
    return out


def _layer(name: str) -> str:
    return name.split(".", 1)[0]


def _imports(name: str, path: Path) -> list[tuple[str, bool]]:
    """(imported compile_core module, whether the import is inside a function) of ``name``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name.split(".")[:-1]
    found = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.ImportFrom) and child.level:
                base = package[:len(package) - child.level + 1]
                base += child.module.split(".") if child.module else []
                for alias in child.names:
                    target = ".".join(base + [alias.name])
                    found.append((target if target in MODULES else ".".join(base), in_function))
            visit(child, inner)

    visit(tree, False)
    return [(t, f) for t, f in found if t in MODULES]


MODULES = _modules()


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_is_small(name):
    lines = len(MODULES[name].read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_LINES, f"{name}: {lines} lines"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_run_down_the_layers_at_module_level(name):
    assert _layer(name) in LAYERS, f"{name}: a folder outside {LAYERS}"
    for target, in_function in _imports(name, MODULES[name]):
        assert not in_function, f"{name} imports {target} inside a function"
        assert LAYERS.index(_layer(target)) <= LAYERS.index(_layer(name)), f"{name} imports {target} (a higher layer)"


def test_no_import_cycle():
    graph = {name: {t for t, _ in _imports(name, path)} for name, path in MODULES.items()}
    state: dict[str, int] = {}

    def walk(node, stack):
        state[node] = 1
        for nxt in graph[node]:
            assert state.get(nxt) != 1, "import cycle: " + " -> ".join(stack + [node, nxt])
            if nxt not in state:
                walk(nxt, stack + [node])
        state[node] = 2

    for name in graph:
        if name not in state:
            walk(name, [])
