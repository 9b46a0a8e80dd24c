"""ComfyUI node adapters: thin classes that parse inputs and call compile_core."""
from .apply_node import ApplyTorchCompile
from .diagnostics_node import TorchCompileDiagnostics
from .settings_node import TorchCompileSpeedSettings
from .vae_node import ApplyTorchCompileVAE

NODE_CLASS_MAPPINGS = {
    "TorchCompileSpeedSettings": TorchCompileSpeedSettings,
    "ApplyTorchCompile": ApplyTorchCompile,
    "TorchCompileDiagnostics": TorchCompileDiagnostics,
    "ApplyTorchCompileVAE": ApplyTorchCompileVAE,
}
NODE_DISPLAY_NAME_MAPPINGS = {
    "TorchCompileSpeedSettings": "Torch Compile Speed Settings",
    "ApplyTorchCompile": "Apply Torch Compile",
    "TorchCompileDiagnostics": "Torch Compile Diagnostics",
    "ApplyTorchCompileVAE": "Apply Torch Compile (VAE)",
}

