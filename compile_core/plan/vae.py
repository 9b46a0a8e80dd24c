"""What to compile in a VAE: its repeated blocks, for decode, encode or both.

A VAE is compiled with the model path's engine (``engine.prepare(..., plan=plan_vae(...))``
and ``CompiledModel.run``); only the region plan differs. Regions are data, as in
``regions.BLOCK_ATTRS``: per VAE family, the class names of the blocks to compile inside its
``decoder`` / ``encoder``.

- Image VAEs (SD/SDXL/Flux: ComfyUI's ``AutoencoderKL`` / ``AutoencodingEngine``): the
  ``ResnetBlock`` and ``Upsample``/``Downsample`` blocks. They are stateless, so
  one graph per block configuration serves every tile and image size.
- Attention blocks stay eager: ComfyUI picks the VAE attention at load (``vae_attention()``),
  and its split/sliced variants read the free memory in Python, which is a graph break and a
  guard that fails whenever free memory changes (a recompile per decode). There is one such
  block per decoder, and with PyTorch attention it is one SDPA call already.
- WAN 2.1/2.2 video VAEs (``WanVAE``): the decoder runs chunk by chunk (1 latent frame, then 2
  at a time) with a feature cache, a Python list that every residual block and causal conv
  reads and writes at its own index. A compiled residual block indexes that list with a Python
  int, which dynamo specialises on (expected: one graph per block and chunk state; not
  measured), and the whole per-chunk decoder gave dozens of graphs (measured, aot_eager: 56
  graphs and 7 minutes for the first decode of a tiny WAN VAE). So the regions are the
  per-chunk work that holds no cache: every ``RMS_norm`` (normalize, scale, gamma, bias: one
  fused kernel instead of five passes). The convolutions and the cache
  bookkeeping stay eager, exactly ComfyUI's code.
"""
from __future__ import annotations

from torch import nn

from ..report import log
from ..torch_support.other_compiles import compiled_module
from .regions import RegionPlan

# first_stage_model class name (anywhere in the MRO) -> class names of the blocks to compile
VAE_BLOCKS: dict[str, tuple[str, ...]] = {
    "WanVAE": ("RMS_norm",),  # comfy.ldm.wan.vae / vae2_2
    "AutoencodingEngine": ("ResnetBlock", "Upsample", "Downsample"),  # + AutoencoderKL
}
# families whose decoder/encoder carry state across calls: never compiled whole
CHUNKED = ("WanVAE",)
CHOICES = ("decode", "encode", "both")
PARTS = {"decode": ("decoder",), "encode": ("encoder",), "both": ("decoder", "encoder")}


def vae_family(model: nn.Module) -> str:
    for cls in type(model).__mro__:
        if cls.__name__ in VAE_BLOCKS:
            return cls.__name__
    return ""


def _not_compiled_elsewhere(model: nn.Module, parts: list[str]) -> list[str]:
    """``parts`` less those another node's torch.compile already wrapped (KJNodes'
    TorchCompileVAE sets ``torch.compile(decoder)`` as the decoder): compiling inside them would
    trace this pack's runtime in that compile. Said once per part and VAE class."""
    other = [p for p in parts if compiled_module(getattr(model, p))]
    for p in other:
        log.warn_once(f"vae-compiled-elsewhere:{type(model).__name__}:{p}",
                      "the VAE's %s is already compiled by another node's torch.compile (e.g. "
                      "KJNodes' TorchCompileVAE): it runs as that node compiled it, and Apply Torch "
                      "Compile (VAE) does not compile it a second time%s", p,
                      "" if len(other) < len(parts) else "; the VAE stays as it is")
    return [p for p in parts if p not in other]


def plan_vae(model: nn.Module, which: str = "decode", blocks_only: bool = True) -> RegionPlan | None:
    """Region plan for a VAE's ``first_stage_model``; ``None`` when there is nothing to compile.

    ``blocks_only`` off compiles the decoder/encoder modules whole (image VAEs only)."""
    if which not in CHOICES:
        raise ValueError(f"which must be one of {CHOICES}, not {which!r}")
    family = vae_family(model)
    parts = [p for p in PARTS[which] if isinstance(getattr(model, p, None), nn.Module)]
    if not parts:
        log.info("%s has no %s module; the VAE stays eager", type(model).__name__, " or ".join(PARTS[which]))
        return None
    parts = _not_compiled_elsewhere(model, parts)
    if not parts:
        return None
    if not family or (not blocks_only and family not in CHUNKED):
        if not family:
            log.info("no known blocks in VAE %s; compiling its %s whole", type(model).__name__,
                     " and ".join(parts))
        return RegionPlan(tuple(parts), f"vae:{family or type(model).__name__}")
    if not blocks_only:
        log.info("%s decodes chunk by chunk with a feature cache: compiling its blocks, not the "
                 "whole %s", family, " and ".join(parts))
    names = VAE_BLOCKS[family]
    paths = tuple(f"{part}.{name}" for part in parts
                  for name, m in getattr(model, part).named_modules()
                  if name and type(m).__name__ in names)
    if not paths:
        log.info("no %s blocks in VAE %s; it stays eager", "/".join(names), type(model).__name__)
        return None
    return RegionPlan(paths, f"vae:{family}")
