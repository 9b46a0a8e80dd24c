"""What engine tests share: settings as the node builds them, and one sampler step."""
from __future__ import annotations

import torch

from compile_core.plan.settings import CompileSettings, build_compile_args

CPU = torch.device("cpu")


def settings(**kw):
    kw.setdefault("backend", "aot_eager")
    kw.setdefault("mode", "default")
    kw.setdefault("background_compile", False)  # (the tests of background mode ask for it)
    return CompileSettings.from_args(build_compile_args(**kw))


def run(cm, model, *inputs):
    """One sampler step: the engine wraps ``model(*inputs)`` like the APPLY_MODEL wrapper does."""
    with torch.no_grad():
        return cm.run(model, lambda: model(*inputs), CPU)


def eager(model, *inputs):
    with torch.no_grad():
        return model(*inputs)
