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

from . import log


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
    cache_dir.mkdir(parents=True, exist_ok=True)
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
