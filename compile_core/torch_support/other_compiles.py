"""What another node's torch.compile left on modules and functions this pack meets: a module
that ``torch.compile`` wrapped (an ``OptimizedModule``, e.g. KJNodes' TorchCompileVAE sets one
as the VAE's decoder), and a function that ``torch._dynamo.disable`` wrapped (KJNodes marks
ComfyUI's weight casts so, process-wide). Both are read from what torch sets on them, so a
torch that renames it makes the tests of this module fail."""
from __future__ import annotations

from typing import Callable

from torch import nn


def compiled_module(module: object) -> bool:
    """``module`` is what ``torch.compile(a_module)`` returned (it wraps ``_orig_mod``)."""
    return type(module).__name__ == "OptimizedModule" and isinstance(getattr(module, "_orig_mod", None), nn.Module)


def dynamo_disabled(fn: Callable | None) -> bool:
    """``fn`` is what ``torch._dynamo.disable(f)`` returned: dynamo never traces it, so a
    compiled graph that calls it splits there."""
    return getattr(fn, "_torchdynamo_disable", False) is True
