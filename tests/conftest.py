"""Shared by all tests: the repo root and tests/host on sys.path, the ``pack`` fixture, markers,
and the tiny WAN model the host and browser tests run."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
PACK_NAME = "TorchCompileSpeed"

# ``import compile_core`` (pure torch, no ComfyUI) and ``import harness`` (the real-ComfyUI host)
for _p in (REPO_ROOT, REPO_ROOT / "tests" / "host"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))


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


@pytest.fixture(scope="session")
def tiny_wan_path():
    """Path of the cached 2-layer dim-256 tiny WAN 2.1 checkpoint (generated once)."""
    from harness import make_tiny_wan
    return make_tiny_wan(num_layers=2, dim=256, seed=0)


@pytest.fixture(scope="session")
def tiny_wan(tiny_wan_path):
    """UNETLoader name of the 2-layer dim-256 tiny WAN (linked into every host's models)."""
    return tiny_wan_path.name


def pytest_report_header(config):
    from harness import COMFY_DIR, HOST_VERSION
    return f"ComfyUI host: {HOST_VERSION} ({COMFY_DIR}); set TCS_COMFY_HOST to test another"
