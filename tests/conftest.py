"""Shared by the unit and the host tests: the repo root on sys.path, the ``pack`` fixture, markers."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
PACK_NAME = "TorchCompileSpeed"

if str(REPO_ROOT) not in sys.path:  # ``import compile_core`` (pure torch, no ComfyUI)
    sys.path.insert(0, str(REPO_ROOT))


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a real inductor compile (about 10-20 s on a small CPU)")


def import_pack(name: str = PACK_NAME):
    """Import the repository as the package ``name``, the way ComfyUI loads a custom node folder,
    so the relative imports in ``nodes/`` work without ComfyUI."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(
        name, REPO_ROOT / "__init__.py", submodule_search_locations=[str(REPO_ROOT)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


@pytest.fixture(scope="session")
def pack():
    """The whole repo imported as the package ``TorchCompileSpeed`` (removed again afterwards
    unless something else had imported it first)."""
    preexisting = PACK_NAME in sys.modules
    module = import_pack()
    yield module
    if not preexisting:
        for mod in [m for m in sys.modules if m == PACK_NAME or m.startswith(PACK_NAME + ".")]:
            sys.modules.pop(mod, None)
