"""The compiled copy of a ComfyUI VAE (``comfy.sd.VAE``): its decode and/or encode calls run
through ``CompiledModel.run``."""
from __future__ import annotations

import copy

import torch

from ..compile_core import api
from .comfy_model import INTERRUPT
from .comfy_server import send_if_any

VAE_METHODS = {"decode": ("decode", "decode_tiled"), "encode": ("encode", "encode_tiled")}
VAE_ATTR = "torch_compile_speed"  # on the compiled copy only: its CompiledModel


def vae_model(vae):
    """The VAE's ``nn.Module`` (``comfy.sd.VAE.first_stage_model``), or None for an invalid VAE."""
    return getattr(vae, "first_stage_model", None)


def vae_device(vae):
    return torch.device(getattr(vae, "device", "cpu"))


def with_vae_compile(vae, compiled, which: str, node_id=None):
    """A shallow copy of ``vae`` whose decode (and/or encode) calls run through
    ``compiled.run``: the compiled callable is attached to the region modules only during the
    copy's call. The input VAE (same ``first_stage_model``, same patcher) stays eager."""
    clone = copy.copy(vae)
    parts = ("decode", "encode") if which == "both" else (which,)
    for part in parts:
        for name in VAE_METHODS[part]:
            setattr(clone, name, _compiled_vae_call(clone, getattr(type(vae), name), compiled, node_id))
    setattr(clone, VAE_ATTR, compiled)
    return clone


def _compiled_vae_call(clone, method, compiled, node_id):
    """``method`` (an unbound ``comfy.sd.VAE`` method) on ``clone``, with the regions compiled."""
    def call(*args, **kwargs):
        send_if_any(api.first_call_status(compiled, node_id))  # the UI shows "compiling..."
        def eager():
            return method(clone, *args, **kwargs)
        out = api.run_model_call(compiled, lambda: compiled.run(clone.first_stage_model, eager, vae_device(clone)),
                                 eager, INTERRUPT)
        send_if_any(api.changed_status(compiled, node_id))
        return out
    call.__name__ = method.__name__
    return call
