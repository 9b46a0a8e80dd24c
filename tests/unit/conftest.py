"""Unit-test fixtures: fresh toy models, a raising backend, and a guard on torch's global state.

Dynamo caches compiled code on the ``forward`` *code object* of a module class. Classes
defined inside a factory function are new on every call, but their methods still share one
code object (it is a constant of the factory's own code), so the factory also gives every
method a renamed copy of its code (``code.replace()``, see ``own_code``). Each test thus gets
code objects of its own and no test sees another's compiled graphs, cache entries or
automatic-dynamic size history, without the cost of ``torch._dynamo.reset()``.
"""
from __future__ import annotations

import contextlib
import importlib
import logging
import os
import sys
import types

import uuid
from pathlib import Path

import pytest
import torch

from compile_core.torch_support import scoped
from compile_core.cache.registry import REGISTRY

LOGGER = "TorchCompileSpeed"


def graphs() -> int:
    """Dynamo graphs compiled so far in this process (a test compares deltas)."""
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


def pack_records(caplog, level=logging.WARNING):
    return [r for r in caplog.records if r.name == LOGGER and r.levelno == level]


from tcs_toy_models import make_wan_classes, own_code  # noqa: E402


@pytest.fixture(scope="module")
def import_benchmark():
    """``import_benchmark(name)``: a script of ``benchmarks/`` as a module (its folder is on
    ``sys.path`` while the test module runs, as the scripts import each other)."""
    folder = str(Path(__file__).resolve().parents[2] / "benchmarks")
    sys.path.insert(0, folder)
    try:
        yield importlib.import_module
    finally:
        sys.path.remove(folder)


@pytest.fixture
def wan():
    """Fresh WAN-like classes for this test: ``wan.Model(n_blocks=4, n_vace=0, dim=32)``."""
    return make_wan_classes()


@pytest.fixture
def wan_factory():
    """``make_wan_classes``: call it for more fresh class sets (optionally named)."""
    return make_wan_classes


@pytest.fixture
def fresh_code():
    """``own_code``: for a test's own module classes."""
    return own_code


@pytest.fixture
def wan_inputs():
    def make(batch=2, tokens=6, in_dim=8, seed=0):
        g = torch.Generator().manual_seed(seed)
        return torch.randn(batch, tokens, in_dim, generator=g), torch.rand(batch, generator=g)
    return make


@contextlib.contextmanager
def _registered_backend(prefix: str, make):
    """``make(ns)``, a dynamo backend, registered under a unique name while the block runs;
    yields ``ns`` (with ``name``), which the backend may count into."""
    from torch._dynamo.backends import registry

    ns = types.SimpleNamespace(name=f"{prefix}_{uuid.uuid4().hex[:8]}")
    torch._dynamo.register_backend(make(ns), name=ns.name)
    try:
        yield ns
    finally:
        registry._COMPILER_FNS.pop(ns.name, None)
        registry._BACKENDS.pop(ns.name, None)


@pytest.fixture
def raising_backend():
    """A dynamo backend, registered under a unique name for this test only, that raises
    RuntimeError("boom"); ``calls`` counts how often dynamo asked it to compile."""
    def make(ns):
        ns.calls = 0

        def boom(gm, example_inputs):
            ns.calls += 1
            raise RuntimeError("boom")
        return boom
    with _registered_backend("tcs_test_raising", make) as ns:
        yield ns


@pytest.fixture
def counting_backend():
    """A dynamo backend, registered under a unique name for this test only, that runs each
    graph as traced (like ``eager``); ``runs`` counts the calls of its compiled graphs, so a
    test can tell a compiled call from an eager one."""
    def make(ns):
        ns.runs = 0

        def counting(gm, example_inputs):
            def run(*args):
                ns.runs += 1
                return gm.forward(*args)
            return run
        return counting
    with _registered_backend("tcs_test_counting", make) as ns:
        yield ns


@pytest.fixture
def graph_count():
    """``graph_count()``: dynamo graphs compiled so far in this process (compare deltas)."""
    return graphs


@pytest.fixture
def pack_log(caplog):
    """The pack's log lines of this test: ``pack_log.warnings()`` / ``pack_log.infos()``
    (``all_infos()``: every INFO line). ``infos()`` leaves out the once-per-process notes about a feature this torch lacks
    (``torch_notes``): which test sees them depends on the order the tests run in."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    notes = torch_notes()
    return types.SimpleNamespace(
        warnings=lambda: [r.getMessage() for r in pack_records(caplog, logging.WARNING)],
        infos=lambda: [m for m in (r.getMessage() for r in pack_records(caplog, logging.INFO))
                       if not any(n in m for n in notes)],
        all_infos=lambda: [r.getMessage() for r in pack_records(caplog, logging.INFO)],
        clear=caplog.clear)


def torch_notes() -> tuple[str, ...]:
    """The pack's once-per-process INFO notes about what this torch lacks (compile_core.run.engine),
    only where ``torch_compat`` finds the feature missing: on a torch that has them all, none."""
    from compile_core.torch_support import aot, torch_compat
    notes = []
    if not torch_compat.isolate_recompiles():
        notes.append("has no working isolate_recompiles")
    if not aot.load_compiled_function():
        notes.append("cannot save and load a compiled function")
    return tuple(notes)


@pytest.fixture(autouse=True)
def clean_registry():
    REGISTRY.clear()
    yield
    REGISTRY.clear()


# Not state a test could leak: pytest's own marker, the handshake inductor writes into
# os.environ before loading every compiled CPU .so, and the ptxas inductor points Triton at before
# its first Triton compile (torch does both with or without this pack).
_NOT_STATE_ENV = {"PYTEST_CURRENT_TEST", "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR", "TRITON_PTXAS_PATH"}


def _global_state() -> dict:
    from torch._dynamo.backends import registry
    torch._dynamo.list_backends(exclude_tags=())  # loads the built-in backends (lazily, once)
    return {
        **scoped.snapshot(),
        "grad": torch.is_grad_enabled(),
        "inference_mode": torch.is_inference_mode_enabled(),
        "default_dtype": torch.get_default_dtype(),
        "backends": sorted(registry._COMPILER_FNS),
        "environ": {k: v for k, v in os.environ.items() if k not in _NOT_STATE_ENV},
    }


@pytest.fixture(scope="session", autouse=True)
def cuda_init_tried_once():
    """torch's own CUDA init, tried once before the first test as ComfyUI's start does: on a CUDA
    build it sets ``CUDA_MODULE_LOADING`` (once per process, even with no GPU, before it fails),
    and inductor's cache key asks for the device on a CPU compile too (2.8/2.9:
    ``CacheBase.get_system``), so the leak check below would blame whichever test compiles first."""
    if torch.version.cuda:
        try:
            torch.cuda.current_device()
        except Exception:  # noqa: BLE001 - no GPU here: only the variable torch sets matters
            pass
    yield


@pytest.fixture(autouse=True)
def torch_state_unchanged():
    """Every unit test must leave dynamo/inductor config, env vars and grad mode as it found them."""
    before = _global_state()
    yield
    after = _global_state()
    changed = {k for k in before if before[k] != after[k]}
    detail = {k: (before[k], after[k]) for k in changed if k not in ("dynamo", "inductor", "environ")}
    for section in {"dynamo", "inductor", "environ"} & changed:
        keys = set(before[section]) | set(after[section])
        detail[section] = {k: (before[section].get(k), after[section].get(k)) for k in keys
                           if before[section].get(k) != after[section].get(k)}
    assert not changed, f"test leaked global state: {detail}"
