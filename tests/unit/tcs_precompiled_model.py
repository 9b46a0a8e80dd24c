"""A small DiT at module level, for the precompiled (torch AOT) tests: a saved region is
loaded by another process, which needs classes it can import. ``gate`` is a global the
block calls, so a test can patch it the way a ComfyUI node patches attention."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def gate(x: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(x)


class Block(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ffn = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(approximate="tanh"), nn.Linear(2 * dim, dim))

    def forward(self, x, emb):  # (not WAN's ``e``, whose dim 1 the WAN policy marks dynamic)
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm(x) * (1 + emb)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d)
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

    def forward(self, x, t):
        h = self.embed(x)
        e = self.time(t[:, None])[:, None, :]
        for block in self.blocks:
            h = block(h, e)
        return self.head(h)


def build(seed: int = 0) -> WanModel:
    torch.manual_seed(seed)
    return WanModel().eval().requires_grad_(False)


def inputs(batch: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(batch * 1000 + tokens)
    return torch.randn(batch, tokens, 8, generator=g), torch.full((batch,), 0.5)
