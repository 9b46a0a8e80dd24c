"""GPU tests: the paths that run only on an NVIDIA GPU (``bash scripts/gpu_session.sh check``, or
``tests``, runs them on a CUDA machine). They skip where CUDA is not available, as in CI.
``TCS_GPU_TEST_DEVICE=cpu`` runs the ones that can run on the CPU, to check the tests themselves.

The unit tests' fixtures (fresh toy models, the global-state check) apply here too."""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

_UNIT = Path(__file__).resolve().parents[1] / "unit"
if str(_UNIT) not in sys.path:
    sys.path.insert(0, str(_UNIT))
_spec = importlib.util.spec_from_file_location("tcs_unit_conftest", _UNIT / "conftest.py")
_unit = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_unit)
wan, wan_inputs, graph_count, pack_log = _unit.wan, _unit.wan_inputs, _unit.graph_count, _unit.pack_log
clean_registry, torch_state_unchanged = _unit.clean_registry, _unit.torch_state_unchanged
cuda_init_tried_once = _unit.cuda_init_tried_once

DEVICE = torch.device(os.environ.get("TCS_GPU_TEST_DEVICE", "cuda"))


def pytest_collection_modifyitems(config, items):
    if DEVICE.type != "cuda" or torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device here (tests/gpu run on a GPU; "
                                   "TCS_GPU_TEST_DEVICE=cpu runs what can run on the CPU)")
    for item in items:
        if Path(str(item.fspath)).parent == Path(__file__).parent:
            item.add_marker(skip)


@pytest.fixture
def device() -> torch.device:
    return DEVICE
