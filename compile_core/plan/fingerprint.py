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


def _named_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters and buffers with their dotted names, in one walk of ``_modules`` (several
    times faster than ``named_parameters()`` + ``named_buffers()`` on a ~1000-tensor DiT)."""
    out: list[tuple[str, torch.Tensor]] = []
    stack = [("", module)]
    while stack:
        prefix, m = stack.pop()
        for store in (m._parameters, m._buffers):
            out.extend((prefix + n, t) for n, t in store.items() if t is not None)
        stack.extend((f"{prefix}{n}.", c) for n, c in reversed(m._modules.items()) if c is not None)
    return out


def structure_digest(module: nn.Module) -> str:
    """Hash of class names, parameter/buffer names, shapes and dtypes.

    Not devices: ComfyUI moves weights between CPU and GPU (and splits them in low-VRAM mode)
    between prompts, and the same model must keep its fingerprint wherever it sits; device
    specific artifacts are keyed by the compile's device elsewhere (inductor's own cache keys,
    the fleet key). Cached per module (weakly); the cache is checked against the tensors'
    identities, so a replaced submodule or parameter, or a cast, is noticed."""
    tensors = _named_tensors(module)
    sig = hash(tuple(id(t) for _, t in tensors))
    hit = _structure_cache.get(module)
    if hit is not None and hit[0] == sig and (not tensors or hit[2] == tensors[0][1].dtype):
        return hit[1]
    described = [(n, tuple(t.shape), t.dtype) for n, t in tensors]
    key = f"{type(module).__module__}.{type(module).__qualname__}|{described!r}"
    digest = hashlib.sha256(key.encode()).hexdigest()
    head = tensors[0][1].dtype if tensors else None
    _structure_cache[module] = (sig, digest, head)
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
