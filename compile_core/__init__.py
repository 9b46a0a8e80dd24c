"""Pure-torch core of TorchCompileSpeed: no ComfyUI imports, testable with an nn.Module alone."""
