"""The nodes' one entry into ComfyUI: every name a node calls that touches ComfyUI internals
(ModelPatcher wrappers, the VAE copy, PromptServer, folder_paths), from the ``comfy_*`` modules
that hold them. Only ``nodes/comfy_*.py`` import ComfyUI; ``compile_core`` never does.
"""
from __future__ import annotations

from .comfy_compile_ahead import compile_ahead
from .comfy_diagnosis import diagnosis_calls
from .comfy_model import (compiled_model_of, diffusion_model, load_device, with_compile_wrapper,
                          without_compile_wrapper)
from .comfy_paths import user_directory
from .comfy_server import send_status
from .comfy_vae import vae_device, vae_model, with_vae_compile

__all__ = ["compile_ahead", "diagnosis_calls", "compiled_model_of", "diffusion_model",
           "load_device", "with_compile_wrapper", "without_compile_wrapper", "user_directory",
           "send_status", "vae_device", "vae_model",
           "with_vae_compile"]
