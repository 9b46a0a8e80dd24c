"""experimental_ptx: a per-run Triton kernel cache and kernel warm-up on the model's own device.

The original pack warmed a toy matmul through ``triton.ops`` (gone from Triton). Here the
warm-up runs the model's own compiled regions on the real inputs, on their device and
dtype, so Triton JITs/caches exactly the kernels sampling will use and CUDA-graph modes
get their recording runs before the sampler's first real step.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from ..report import log
from ..torch_support import longpaths


def ptx_env(enabled: bool, on_cuda: bool, cache_dir: Path | None) -> dict[str, str]:
    """Environment for the run: ``TRITON_CACHE_DIR`` on CUDA, nothing elsewhere."""
    if not enabled:
        return {}
    if not on_cuda:
        log.info_once("ptx-skip", "experimental_ptx skipped: no CUDA device for this model "
                      "(Triton/PTX warm-up only applies on NVIDIA GPUs)")
        return {}
    if cache_dir is None:
        return {}
    deepest = len(str(cache_dir)) + longpaths.below_triton_dir()
    if not longpaths.fits(deepest):
        log.warn_once(f"ptx-long:{cache_dir}", "experimental_ptx: ptx_cache_dir %s not used: "
                      "Triton's files would nest to %d characters there, past Windows' "
                      "%d-character limit (long paths are not enabled). Use a shorter "
                      "ptx_cache_dir or enable long paths; Triton uses its other cache folder "
                      "meanwhile", cache_dir, deepest, longpaths.MAX_PATH)
        return {}
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        log.warn_once(f"ptx-io:{cache_dir}", "experimental_ptx: ptx_cache_dir %s not used (%s: %s)",
                      cache_dir, type(exc).__name__, exc)
        return {}
    return {"TRITON_CACHE_DIR": str(cache_dir)}


def warm(call: Callable[[], object], runs: int, device: torch.device) -> float:
    """Run ``call`` ``runs`` times (outputs discarded) and return the seconds it took."""
    import time
    start = time.perf_counter()
    for _ in range(runs):
        with torch.no_grad():
            call()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


# Family -> how a declared (width, height, frames) becomes the diffusion model's inputs.
# WAN: VAE compresses time 4x and space 8x (16x for the 48-channel WAN 2.2 VAE); the text
# encoder pads context to >= 512 tokens of the text embedding's input width.
def _wan_inputs(dm, latent_channels: int, size, device, dtype):
    width, height, frames = size
    spatial = 16 if latent_channels == 48 else 8
    lat = (1, latent_channels, (frames - 1) // 4 + 1, max(height // spatial, 2), max(width // spatial, 2))
    return _wan_latent_inputs(dm, lat, device, dtype)


def _wan_latent_inputs(dm, latent_shape, device, dtype, sigma: float = 0.5):
    """WAN inputs for a latent of ``latent_shape`` ([B, C, T, H, W]): random x, zero context."""
    batch, channels = latent_shape[0], latent_shape[1]
    inputs = {
        "x": torch.randn(tuple(latent_shape), device=device, dtype=torch.float32),
        "t": torch.full((batch,), sigma, device=device),
        "c_crossattn": torch.zeros(batch, 512, dm.text_embedding[0].in_features, device=device, dtype=dtype),
    }
    extra = dm.patch_embedding.in_channels - channels  # i2v models take a concat latent
    if extra > 0:
        inputs["c_concat"] = torch.zeros((batch, extra) + tuple(latent_shape[2:]), device=device,
                                         dtype=torch.float32)
    return inputs


LATENT_INPUTS = {"WanModel": _wan_latent_inputs}


def latent_inputs(diffusion_model, family: str, latent_shape, device, dtype, sigma: float = 0.5):
    """``apply_model`` inputs for a latent of ``latent_shape`` (random values) and ``True``, or,
    for a family without a recipe, only ``x``/``t`` and ``False`` (the call may then fail)."""
    build = LATENT_INPUTS.get(family)
    if build is not None:
        return build(diffusion_model, latent_shape, device, dtype, sigma), True
    batch = latent_shape[0] if len(latent_shape) else 1
    return {"x": torch.randn(tuple(latent_shape), device=device, dtype=torch.float32),
            "t": torch.full((batch,), sigma, device=device)}, False


AHEAD_INPUTS = {"WanModel": _wan_inputs}


def ahead_sizes(settings) -> list[tuple[int, int, int]]:
    """Which declared sizes to compile ahead: the largest one covers all under a dynamic policy;
    a static policy needs each end of the range."""
    if not settings.declared_shapes or not settings.warmup_runs:
        return []
    lo, hi = settings.declared_shapes
    if settings.shape_policy == "static" and lo != hi:
        return [lo, hi]
    return [hi]


def ahead_inputs(diffusion_model, family: str, latent_channels: int, size, device, dtype):
    """Inputs shaped like the declared latent, or None when this family has no recipe."""
    build = AHEAD_INPUTS.get(family)
    return None if build is None else build(diffusion_model, latent_channels, size, device, dtype)
