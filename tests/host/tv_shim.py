"""Lets the CUDA-linked torchvision wheel import on a CPU-only torch (test venv only).

Installed by scripts/bootstrap.sh as a ``.pth`` hook. torchvision's compiled ops
cannot load without CUDA, yet ``torchvision._meta_registrations`` registers fake
kernels for ``torchvision::nms`` / ``qnms`` at import time, which fails unless the
op schemas exist. On the first ``import torchvision`` this hook declares them.
Diffusion sampling never calls these ops. Nothing happens until torchvision is
imported, so other processes pay no start-up cost.

Where torchvision's compiled ops DO load (a torchvision built for this torch, e.g. the CUDA
builds of the torch matrix, which load on a machine without a GPU), declaring the schemas
first would make the real library fail with "Tried to register an operator
(torchvision::nms...) multiple times". So the hook first tries to load the real library, the
way torchvision itself does, and steps aside when that works: detection by trying, not by
version.
"""
import importlib.abc
import importlib.machinery
import os
import sys

_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_LIBS = []


class _DeclareTorchvisionOps(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "torchvision":
            return None
        sys.meta_path.remove(self)
        import torch

        if _real_ops_load(torch, path):
            return None  # torchvision's own ops are there: nothing to fake
        lib = torch.library.Library("torchvision", "DEF")
        for schema in _SCHEMAS:
            try:
                lib.define(schema)
            except RuntimeError:
                pass  # already declared (a real torchvision build did it)
        _LIBS.append(lib)
        return None  # let the normal finders import torchvision


def _real_ops_load(torch, path) -> bool:
    """True when torchvision's compiled ops are (or can now be) registered in this process."""
    if hasattr(torch.ops.torchvision, "nms"):
        return True
    spec = importlib.machinery.PathFinder.find_spec("torchvision", path)
    if spec is None or not spec.submodule_search_locations:
        return False
    for folder in spec.submodule_search_locations:
        for name in sorted(os.listdir(folder)):
            if name.startswith("_C.") and name.endswith((".so", ".pyd")):
                try:
                    # the same call torchvision's extension.py makes; loading twice is a no-op
                    torch.ops.load_library(os.path.join(folder, name))
                    return True
                except (ImportError, OSError):
                    return False
    return False


sys.meta_path.insert(0, _DeclareTorchvisionOps())
