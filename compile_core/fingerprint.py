"""What makes two compile requests "alike": the model's structure, the settings and the torch version.

Weights are not part of it: compiled graphs take parameters as inputs, so the same
checkpoint loaded again, or a LoRA-patched copy, reuses the same compiled work.
"""
from __future__ import annotations

import hashlib
import weakref

import torch
from torch import nn

from .regions import RegionPlan

# Structure digests, held weakly per module so an unloaded model is freed.
_structure_cache: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()


def _cheap_signature(module: nn.Module) -> tuple:
    """Changes when a submodule or parameter is replaced (new objects) or moved/cast."""
    params = list(module.parameters())
    head = params[0] if params else None
    return (hash(tuple(map(id, params))), None if head is None else (head.dtype, head.device))


def structure_digest(module: nn.Module) -> str:
    """Hash of class names, parameter/buffer names, shapes, dtypes and devices."""
    sig = _cheap_signature(module)
    hit = _structure_cache.get(module)
    if hit is not None and hit[0] == sig:
        return hit[1]
    h = hashlib.sha256(f"{type(module).__module__}.{type(module).__qualname__}".encode())
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}|{t.device}\n".encode())
    digest = h.hexdigest()
    _structure_cache[module] = (sig, digest)
    return digest


def fingerprint(diffusion_model: nn.Module, plan: RegionPlan, settings) -> str:
    regions = [f"{p}:{type(m).__qualname__}" for p, m in zip(plan.paths, plan.modules(diffusion_model))]
    key = "|".join([
        torch.__version__,
        structure_digest(diffusion_model),
        ",".join(regions),
        repr(settings.artifact_key()),
    ])
    return hashlib.sha256(key.encode()).hexdigest()[:24]
