"""A tiny WAN 2.1 T2V model as a GGUF file that the ComfyUI-GGUF pack's UnetLoaderGGUF loads.

It is written from the same state dict as ``harness.make_tiny_wan`` and laid out the way
ComfyUI-GGUF's own tools produce a quantized WAN (``.host/ComfyUI-GGUF/tools``):

* ``convert.py``: architecture ``wan`` in ``general.architecture``; 1-D tensors, tensors of at
  most 1024 elements and ``.modulation`` parameters in F32, every other tensor in F16; 5-D
  tensors (the Conv3d ``patch_embedding.weight``) left out there and added back as F32 by
  ``fix_5d_tensors.py``;
* ``lcpp.patch`` (its llama-quantize rules for ``LLM_ARCH_WAN``): the transformer blocks' 2-D
  weights quantized (here Q8_0), while ``modulation``, ``patch_embedding``, ``text_embedding``,
  ``time_projection``, ``time_embedding``, ``img_emb`` and ``head`` stay as converted (F16).

So the file holds Q8_0, F16 and F32 tensors, like a real ``wan2.1-t2v-*-Q8_0.gguf``.
"""
from __future__ import annotations

import os
from pathlib import Path

from harness import MODEL_CACHE, make_tiny_wan

QUANTIZATION_THRESHOLD = 1024  # convert.py: tensors this small stay F32
HIPREC = (".modulation",)  # convert.py ModelWan.keys_hiprec
NOT_QUANTIZED = ("modulation", "patch_embedding.", "text_embedding.", "time_projection.",
                 "time_embedding.", "img_emb.", "head.")  # lcpp.patch, LLM_ARCH_WAN


def tiny_wan_gguf_name(num_layers=2, dim=256, seed=0) -> str:
    return f"tcs_tiny_wan_l{num_layers}_d{dim}_s{seed}-Q8_0.gguf"


def qtype_for(key, shape):
    """The GGML type ComfyUI-GGUF's convert + llama-quantize (Q8_0) give a float32 tensor."""
    import gguf
    T = gguf.GGMLQuantizationType
    n_params = 1
    for d in shape:
        n_params *= d
    if len(shape) > 4:  # fix_5d_tensors.py adds these back as F32
        return T.F32
    if len(shape) == 1 or n_params <= QUANTIZATION_THRESHOLD or any(h in key for h in HIPREC):
        return T.F32
    if (len(shape) == 2 and key.startswith("blocks.") and shape[-1] % 32 == 0
            and not any(n in key for n in NOT_QUANTIZED)):
        return T.Q8_0
    return T.F16


def make_tiny_wan_gguf(num_layers=2, dim=256, seed=0) -> Path:
    """Return the GGUF twin of ``make_tiny_wan(num_layers, dim, seed)``, generated once into
    ``.host/models/<host version>/`` (from that cached safetensors file)."""
    cached = MODEL_CACHE / tiny_wan_gguf_name(num_layers, dim, seed)
    if cached.exists():
        return cached
    import gguf
    import safetensors.torch

    sd = safetensors.torch.load_file(str(make_tiny_wan(num_layers=num_layers, dim=dim, seed=seed)))
    writer = gguf.GGUFWriter(path=None, arch="wan")
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    for key, tensor in sd.items():
        data = tensor.float().numpy()
        qtype = qtype_for(key, tuple(data.shape))
        writer.add_tensor(key, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    tmp = cached.with_suffix(f".tmp{os.getpid()}")
    writer.write_header_to_file(path=str(tmp))
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, cached)
    return cached


def gguf_qtypes(path) -> dict:
    """``{type name: count}`` of a GGUF file's tensors (what UnetLoaderGGUF logs as qtypes)."""
    import gguf
    counts = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return counts
