"""Row L of the GPU matrix (``gpu_matrix.py``): WAN's blocks in bf16 with a rank-64 LoRA on every
Linear, loaded by ComfyUI's ``ModelPatcher`` partially, as on a card without room for the whole
model. The layers that fit are loaded with the LoRA merged into their weights; the others stay
in RAM and are cast to the card at each call, their LoRA computed there (``LowVramPatch``):
unmerged LoRA, where eager does weight-sized work that a compile can fuse.

The pack runs as its Apply node runs it (``nodes/comfy_model.run_compiled``): the LoRA-patched
weight fetches go through its weight-fetch op (``nodes/weight_routing``), imported here as a
package whose ``compile_core`` is the copy already imported (one copy registers the op).
"""
from __future__ import annotations

import functools
import importlib
import sys
import types
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "tcs_matrix_pack"
RANK = 64
LOADED_FRACTION = 0.5  # of the model's weight bytes loaded on the card; the rest in lowvram mode
_PATCHERS = []  # the rows' ModelPatchers (a model does not hold its patcher)


def lora_patches(model, rank: int = RANK, seed: int = 2) -> dict:
    """``{weight key: LoRAAdapter}`` for every Linear inside the blocks: up [out, rank] and down
    [rank, in] small enough that the LoRA changes a block's output by a few per cent."""
    import torch
    from comfy.weight_adapter.lora import LoRAAdapter
    g = torch.Generator(device="cpu").manual_seed(seed)
    out = {}
    for name, m in model.named_modules():
        if name.startswith("blocks.") and isinstance(m, torch.nn.Linear):
            up = torch.randn(m.out_features, rank, generator=g) * 0.02
            down = torch.randn(rank, m.in_features, generator=g) / m.in_features ** 0.5
            out[f"{name}.weight"] = LoRAAdapter(set(), (up.to(m.weight.dtype), down.to(m.weight.dtype),
                                                        float(rank), None, None, None))
    return out


def lora_model(model, device):
    """``model`` (on the CPU) with a LoRA on every block Linear, partially loaded on ``device``
    by a ModelPatcher: ``LOADED_FRACTION`` of its weight bytes loaded, the rest in lowvram mode."""
    import torch
    from comfy.model_patcher import ModelPatcher
    patcher = ModelPatcher(model, load_device=device, offload_device=torch.device("cpu"))
    added = patcher.add_patches(lora_patches(model))
    if not added:
        raise RuntimeError("no LoRA patch matched a weight of the model")
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    patcher.load(device, lowvram_model_memory=int(size * LOADED_FRACTION))
    if not lowvram_patches(model):
        raise RuntimeError("the partial load left no layer with its LoRA unmerged")
    _check_unmerged_lora_changes_a_weight(model, device)
    _PATCHERS.append(patcher)
    return model


def lowvram_patches(model) -> int:
    """Layers whose LoRA is applied at each call (not merged at load)."""
    return sum(any(getattr(f, "is_lowvram_patch", False) for f in getattr(m, "weight_function", ()))
               for m in model.modules())


def _check_unmerged_lora_changes_a_weight(model, device) -> None:
    """ComfyUI logs a LoRA it cannot apply and goes on: make sure an unmerged one really applies."""
    import torch
    layer = next(m for m in model.modules()
                 if any(getattr(f, "is_lowvram_patch", False) for f in getattr(m, "weight_function", ())))
    weight = layer.weight.detach().to(device)
    patched = weight.clone()
    for f in layer.weight_function:
        patched = f(patched)
    if torch.equal(patched, weight):
        raise RuntimeError("an unmerged LoRA left its layer's weight unchanged")


def bridge_run(cm, model, forward, device):
    """One model call of ``cm`` as the Apply node makes it (``comfy_model.run_compiled``'s way:
    the patched weight fetches routed through the pack's op while the compiled run lasts)."""
    if cm.entry.failed or cm.entry.slower:  # (eager: ComfyUI's own weight fetches)
        return cm.run(model, forward, device)
    routed = _weight_routing().routed
    with routed(model, cm.plan):
        return cm.run(model, forward, device, functools.partial(routed, model, cm.plan))


@functools.lru_cache(maxsize=None)
def _weight_routing():
    import compile_core.plan.switches  # noqa: F401 - imported before they are aliased below
    import compile_core.report.log  # noqa: F401
    import compile_core.torch_support.layer_fetch  # noqa: F401
    import compile_core.torch_support.weight_fetch  # noqa: F401
    pkg = types.ModuleType(PACKAGE)
    pkg.__path__ = [str(REPO_ROOT)]
    nodes = types.ModuleType(f"{PACKAGE}.nodes")
    nodes.__path__ = [str(REPO_ROOT / "nodes")]
    aliases = {f"{PACKAGE}.{name}": mod for name, mod in sys.modules.copy().items()
               if name == "compile_core" or name.startswith("compile_core.")}
    sys.modules.update({PACKAGE: pkg, f"{PACKAGE}.nodes": nodes, **aliases})
    return importlib.import_module(f"{PACKAGE}.nodes.weight_routing")
