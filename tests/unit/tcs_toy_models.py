"""Toy WAN-like models for the unit tests, in a module with a unique name.

(Functions defined in a ``conftest.py`` live in a module called ``conftest``; when the host
tests' conftest is imported later in the same run, dynamo would resolve these functions'
globals through the wrong ``conftest`` module.) See ``conftest.py`` for why every call gives
the classes fresh code objects.
"""
from __future__ import annotations

import types
import uuid

import torch
import torch.nn.functional as F
from torch import nn


def own_code(*classes):
    """Give each method defined on ``classes`` a code object of its own (see the module doc).

    The copy also gets a unique name: dynamo keeps automatic-dynamic ("PGO") size history per
    source location (file hash, first line, *name*), not per code object, so a copy that kept
    its name would inherit the sizes earlier tests saw and compile with dynamic dims."""
    tag = uuid.uuid4().hex[:8]
    for cls in classes:
        for attr in vars(cls).values():
            if isinstance(attr, types.FunctionType):
                code = attr.__code__
                attr.__code__ = code.replace(co_name=f"{code.co_name}_{tag}",
                                             co_qualname=f"{code.co_qualname}_{tag}")
    return classes


def make_wan_classes(name: str = "WanModel"):
    """A WAN-like DiT (modulated attention + MLP blocks) with fresh classes on every call.

    Returns a namespace with ``Block``, ``VaceBlock`` and the model class (named ``name``)."""

    class Block(nn.Module):
        def __init__(self, dim: int, heads: int):
            super().__init__()
            self.heads = heads
            self.norm1 = nn.LayerNorm(dim, elementwise_affine=False)
            self.qkv = nn.Linear(dim, 3 * dim)
            self.proj = nn.Linear(dim, dim)
            self.norm2 = nn.LayerNorm(dim)
            self.ffn = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(approximate="tanh"),
                                     nn.Linear(2 * dim, dim))
            self.modulation = nn.Parameter(torch.randn(1, 3, dim) / dim ** 0.5)

        def forward(self, x, e):
            b, n, d = x.shape
            shift, scale, gate = (self.modulation + e).chunk(3, dim=1)
            h = self.norm1(x) * (1 + scale) + shift
            q, k, v = self.qkv(h).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d)
            x = x + gate * self.proj(a)
            return x + self.ffn(self.norm2(x))

    class VaceBlock(Block):
        def __init__(self, dim: int, heads: int):
            super().__init__(dim, heads)
            self.after_proj = nn.Linear(dim, dim)

        def forward(self, x, e):
            return self.after_proj(super().forward(x, e))

    class Model(nn.Module):
        def __init__(self, n_blocks=4, n_vace=0, dim=32, heads=2, in_dim=8):
            super().__init__()
            self.dim = dim
            self.patch_embedding = nn.Linear(in_dim, dim)
            self.time_embedding = nn.Linear(1, 3 * dim)
            self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(n_blocks))
            if n_vace:
                self.vace_blocks = nn.ModuleList(VaceBlock(dim, heads) for _ in range(n_vace))
            self.head = nn.Linear(dim, in_dim)

        def forward(self, x, t):
            e = self.time_embedding(t[:, None]).view(x.shape[0], 3, self.dim)
            x = self.patch_embedding(x)
            for block in self.blocks:
                x = block(x, e)
            for block in getattr(self, "vace_blocks", ()):
                x = block(x, e)
            return self.head(x)

    Model.__name__ = Model.__qualname__ = name
    own_code(Block, VaceBlock, Model)
    return types.SimpleNamespace(Block=Block, VaceBlock=VaceBlock, Model=Model)
