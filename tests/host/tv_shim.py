"""Lets the CUDA-linked torchvision wheel import on a CPU-only torch (test venv only).

Installed by scripts/bootstrap.sh as a ``.pth`` hook. torchvision's compiled ops
cannot load without CUDA, yet ``torchvision._meta_registrations`` registers fake
kernels for ``torchvision::nms`` / ``qnms`` at import time, which fails unless the
op schemas exist. On the first ``import torchvision`` this hook declares them.
Diffusion sampling never calls these ops. Nothing happens until torchvision is
imported, so other processes pay no start-up cost.
"""
import importlib.abc
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

        lib = torch.library.Library("torchvision", "DEF")
        for schema in _SCHEMAS:
            try:
                lib.define(schema)
            except RuntimeError:
                pass  # already declared (a real torchvision build did it)
        _LIBS.append(lib)
        return None  # let the normal finders import torchvision


sys.meta_path.insert(0, _DeclareTorchvisionOps())
