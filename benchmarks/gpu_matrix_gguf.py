"""The GGUF rows of the GPU matrix (``gpu_matrix.py``): WAN's blocks with quantized weights
through ComfyUI-GGUF's own ops (``GGMLOps``: each weight is dequantized in its layer's forward),
laid out as ComfyUI-GGUF's tools quantize a WAN (``tests/host/gguf_models.qtype_for``): the
blocks' 2-D weights in the row's type, the rest F16 or F32.

ComfyUI-GGUF comes from ``.gpu/ComfyUI-GGUF`` (the GPU bundle, ``scripts/gpu_prepare.sh``) or
``.host/ComfyUI-GGUF`` (``scripts/bootstrap.sh``); its modules are imported as a package of their
own without its ``__init__`` (which registers nodes with a server).
"""
from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
PACK_DIRS = (REPO_ROOT / ".gpu" / "ComfyUI-GGUF", REPO_ROOT / ".host" / "ComfyUI-GGUF")
PACKAGE = "tcs_matrix_comfyui_gguf"
FORMATS = {"gguf_q8_0": "Q8_0"}


def gguf_ops():
    """ComfyUI-GGUF's ``ops`` module (imported once, after ComfyUI is on the path)."""
    if PACKAGE not in sys.modules:
        path = next((p for p in PACK_DIRS if (p / "ops.py").is_file()), None)
        if path is None:
            raise FileNotFoundError(f"ComfyUI-GGUF is in none of {[str(p) for p in PACK_DIRS]}")
        package = types.ModuleType(PACKAGE)
        package.__path__ = [str(path)]
        sys.modules[PACKAGE] = package
    return importlib.import_module(f"{PACKAGE}.ops")


def quantized_state_dict(model, fmt: str) -> dict:
    """``model``'s weights as ComfyUI-GGUF's loader gives them: ``GGMLTensor``s of the raw
    quantized bytes (F16 and F32 ones in their shape), each with its type and shape."""
    import gguf
    import torch
    sys.path.insert(0, str(REPO_ROOT / "tests" / "host"))
    from gguf_models import qtype_for
    ops, blocks_type = gguf_ops(), getattr(gguf.GGMLQuantizationType, FORMATS[fmt])
    plain = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
    out = {}
    for key, tensor in model.state_dict().items():
        data = tensor.detach().float().cpu().numpy()
        qtype = qtype_for(key, tuple(data.shape))
        qtype = blocks_type if qtype == gguf.GGMLQuantizationType.Q8_0 else qtype
        raw = torch.from_numpy(gguf.quants.quantize(data, qtype))
        shape = torch.Size(data.shape)
        out[key] = ops.GGMLTensor(raw.view(*shape) if qtype in plain else raw, tensor_type=qtype,
                                  tensor_shape=shape)
    return out


def gguf_model(build, model, fmt: str, device):
    """A model built by ``build(operations)`` with ComfyUI-GGUF's ops, holding ``model``'s
    weights quantized to ``fmt`` (on ``device``)."""
    sd = quantized_state_dict(model, fmt)
    quantized = build(gguf_ops().GGMLOps)
    missing, unexpected = quantized.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"GGUF state dict does not fit: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return quantized.to(device).eval()


def quantized_weights(model) -> int:
    """How many of ``model``'s tensors hold quantized bytes (not F16 or F32)."""
    import gguf
    plain = (None, gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
    return sum(getattr(p, "tensor_type", None) not in plain for p in model.parameters())
