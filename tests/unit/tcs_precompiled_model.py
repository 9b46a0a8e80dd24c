"""A small DiT at module level, for the precompiled (torch AOT) tests: a saved region is
loaded by another process, which needs classes it can import. ``gate`` is a global the
block calls, so a test can patch it the way a ComfyUI node patches attention."""
from __future__ import annotations

import enum

import torch
import torch.nn.functional as F
from torch import nn


def gate(x: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(x)


def attention(q, k, v, transformer_options=None):
    """Like ComfyUI's attention: a patch node may put ``optimized_attention_override`` (a
    callable taking the default attention function first) into ``transformer_options``."""
    override = (transformer_options or {}).get("optimized_attention_override")
    if override is not None:
        return override(F.scaled_dot_product_attention, q, k, v)
    return F.scaled_dot_product_attention(q, k, v)


def halved(attn, q, k, v):
    """An attention override, as a patch node sets it."""
    return attn(q, k, v) * 0.5


def negated(attn, q, k, v):
    return -attn(q, k, v)


class Block(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ffn = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(approximate="tanh"), nn.Linear(2 * dim, dim))

    def forward(self, x, emb, transformer_options=None):  # (not WAN's ``e``: the WAN policy marks its dim 1)
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm(x) * (1 + emb)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = attention(q, k, v, transformer_options).transpose(1, 2).reshape(b, n, d)
        x = x + gate(emb) * self.proj(a)
        return x + self.ffn(x)


class WanModel(nn.Module):  # the name selects the WAN region plan and shape policy
    def __init__(self, n_blocks: int = 3, dim: int = 32):
        super().__init__()
        self.dim = dim
        self.embed = nn.Linear(8, dim)
        self.time = nn.Linear(1, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(n_blocks))
        self.head = nn.Linear(dim, 8)

    def forward(self, x, t, transformer_options=None):
        h = self.embed(x)
        e = self.time(t[:, None])[:, None, :]
        for block in self.blocks:
            h = block(h, e, transformer_options=transformer_options if transformer_options is not None else {})
        return self.head(h)


def build(seed: int = 0) -> WanModel:
    """The model, with the ``<param>_comfy_model_dtype`` attributes ComfyUI 0.12+ stores on
    every module (``archive_model_dtypes``): plain attributes no guard reads, which torch's
    guard pickler used to turn every saved tensor dtype into ``_Missing`` with."""
    torch.manual_seed(seed)
    model = WanModel().eval().requires_grad_(False)
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            setattr(module, f"{name}_comfy_model_dtype", param.dtype)
    return model


def inputs(batch: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(batch * 1000 + tokens)
    return torch.randn(batch, tokens, 8, generator=g), torch.full((batch,), 0.5)


# ------------------------------------------------------------- a GGUF-like quantized layer

class Kind(enum.Enum):
    """Like gguf's ``GGMLQuantizationType``."""
    Q8 = 8
    Q4 = 2


class QuantTensor(torch.Tensor):
    """Like ComfyUI-GGUF's ``GGMLTensor``: a plain tensor subclass (no ``__tensor_flatten__``)
    that keeps what its data means in instance attributes, a LoRA in ``patches``."""

    def __new__(cls, data, *, tensor_type, tensor_shape, patches=()):
        return super().__new__(cls, data)

    def __init__(self, data, *, tensor_type, tensor_shape, patches=()):
        super().__init__()
        self.tensor_type, self.tensor_shape, self.patches = tensor_type, tensor_shape, list(patches)

    def detach(self, *args, **kwargs):  # as GGMLTensor: nn.Parameter keeps this very object
        return self

    def to(self, *args, **kwargs):  # as GGMLTensor: the copy carries the attributes
        new = super().to(*args, **kwargs)
        new.tensor_type = getattr(self, "tensor_type", None)
        new.tensor_shape = getattr(self, "tensor_shape", new.data.shape)
        new.patches = getattr(self, "patches", []).copy()
        return new


class QuantLinear(nn.Module):
    """Dequantizes its weight in forward, as ComfyUI-GGUF's ops do; ``dequant_dtype`` is set on
    the class by a loader node (ComfyUI-GGUF's ``GGMLOps.Linear.dequant_dtype``)."""
    dequant_dtype = None

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        q = QuantTensor(weight.flatten(), tensor_type=Kind.Q8, tensor_shape=weight.shape)
        self.weight = nn.Parameter(q, requires_grad=False)

    def forward(self, x):
        w = self.weight.to(x.device)
        deq = torch.Tensor(w.data.reshape(w.tensor_shape)).to(self.dequant_dtype or x.dtype)
        if w.tensor_type is Kind.Q4:
            deq = deq * 2
        for patch in w.patches:
            deq = deq + patch
        return F.linear(x, deq.to(x.dtype))


def build_quant(seed: int = 0, dim: int = 32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(QuantLinear(torch.randn(dim, dim) / dim ** 0.5), nn.GELU()).eval()
