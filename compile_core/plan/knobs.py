"""The dynamo, inductor and fx knobs a ``CompileSettings`` asks for, which
``torch_support.scoped`` applies for the duration of a compiled call."""
from __future__ import annotations

from ..torch_support import torch_compat
from . import shapes


def knobs_for(settings, on_cuda: bool) -> dict[str, dict]:
    """The scoped knobs a ``CompileSettings`` asks for (docs/how-it-works.md describes them)."""
    dynamo = {  # torch before 2.7 names the recompile limit cache_size_limit
        torch_compat.recompile_limit_knob() or "recompile_limit": settings.cache_size_limit,
        "accumulated_recompile_limit": max(settings.recompile_limit, settings.cache_size_limit),
        # auto marks exactly the latent dims dynamic; letting weights turn symbolic after a
        # shape mismatch (heterogeneous UNet layers share forward code) would only slow it down
        "force_parameter_static_shapes": (settings.force_parameter_static_shapes
                                          or settings.shape_policy == "auto"),
    }
    inductor: dict[str, object] = {}
    if settings.experimental_ptx and on_cuda and settings.ptx_fast_math:
        inductor["use_fast_math"] = True
    return {"dynamo": dynamo, "inductor": inductor, "fx": shapes.fx_knobs(settings.shape_policy)}
