"""TorchCompileSpeed: fast, safe, reusable torch.compile for ComfyUI diffusion models.

Guarded so that importing the pack outside ComfyUI (tests, tooling, a host without torch)
never raises: the mappings are then empty and the reason is logged.
"""
import logging

NODE_CLASS_MAPPINGS = {}
NODE_DISPLAY_NAME_MAPPINGS = {}
WEB_DIRECTORY = "./web/js"

try:
    from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS  # noqa: F811
except ImportError as exc:  # e.g. no torch: keep the import of the pack itself harmless
    logging.getLogger("TorchCompileSpeed").warning(
        "[TorchCompileSpeed] nodes not loaded: %s", exc)

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY"]
