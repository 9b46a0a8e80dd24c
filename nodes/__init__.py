"""ComfyUI node adapters: thin classes that parse inputs and call compile_core."""
from .apply_node import ApplyTorchCompile
from .settings_node import TorchCompileSpeedSettings

NODE_CLASS_MAPPINGS = {
    "TorchCompileSpeedSettings": TorchCompileSpeedSettings,
    "ApplyTorchCompile": ApplyTorchCompile,
}
NODE_DISPLAY_NAME_MAPPINGS = {
    "TorchCompileSpeedSettings": "Torch Compile Speed Settings",
    "ApplyTorchCompile": "Apply Torch Compile",
}
