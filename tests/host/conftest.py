"""Fixtures for the real-ComfyUI integration tests (see harness.py). Every test here is ``host``."""
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # so ``import harness`` works under any --import-mode
    sys.path.insert(0, str(HERE))

import harness  # noqa: E402
from harness import ComfyHost  # noqa: E402

harness.API_NODES = False  # (no test uses ComfyUI's API nodes; a start without them is shorter)


def pytest_configure(config):
    config.addinivalue_line("markers", "host: integration test against a real ComfyUI server")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.host)


@pytest.fixture(scope="session")
def comfy_host(tmp_path_factory, tiny_wan_path):
    """One ComfyUI server shared by the whole session (SDPA attention, OMP_NUM_THREADS=1)."""
    host = ComfyHost(tmp_path_factory.mktemp("comfy_session"), models=[tiny_wan_path])
    with host:
        yield host


@pytest.fixture
def make_host(tmp_path_factory, tiny_wan_path):
    """Factory for a test's own server: ``make_host(env={...}, extra_args=[...])``; not started
    unless ``start=True`` (default). Every host it made is stopped after the test."""
    hosts = []

    def factory(start=True, **kw):
        kw.setdefault("models", [tiny_wan_path])
        host = ComfyHost(tmp_path_factory.mktemp("comfy_host"), **kw)
        hosts.append(host)
        return host.start() if start else host

    yield factory
    for host in hosts:
        host.stop()
