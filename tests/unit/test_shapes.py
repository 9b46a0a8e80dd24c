"""Shape policy ``auto``: which input dims get marked dynamic (compile_core.shapes)."""
from __future__ import annotations

import torch
from torch import nn

from compile_core import shapes


class _WanBlockLike(nn.Module):
    def forward(self, x, e, freqs=None, context=None):
        return x


def _marked(marks) -> dict[tuple, set[int]]:
    out: dict[tuple, set[int]] = {}
    for own in marks:
        for t, d in own:
            out.setdefault(tuple(t.shape), set()).add(d)
    return out


def test_a_size_1_broadcast_dim_is_never_marked_but_a_batch_of_1_is():
    """WAN 2.1's modulation ``e`` is [B, 1, 6, C]: its dim 1 broadcasts over the tokens. Marked
    dynamic under backed_size_oblivious it stopped broadcasting, and ComfyUI's WanModel with its
    sub-quadratic attention (a graph break inside the block) compiled to NaN output."""
    block = _WanBlockLike()
    shaper = shapes.InputShaper(block, "WanModel", "auto")
    x, e = torch.randn(1, 12, 8), torch.randn(1, 1, 6, 8)
    _, _, marks = shaper(block, (x, e), {"context": torch.randn(1, 5, 8)})
    got = _marked(marks)
    assert got[(1, 12, 8)] == {0, 1}
    assert got[(1, 1, 6, 8)] == {0}  # the batch, never the broadcast dim
    assert got[(1, 5, 8)] == {0, 1}


def test_a_tensor_every_block_receives_is_prepared_once_per_model_call():
    block = _WanBlockLike()
    shaper = shapes.InputShaper(block, "WanModel", "auto")
    e_nc = torch.randn(2, 8, 6, 12).permute(0, 3, 2, 1)  # not contiguous: copied
    memo: dict = {}
    a1, _, m1 = shaper(block, (torch.randn(2, 12, 8), e_nc), {}, memo)
    a2, _, m2 = shaper(block, (torch.randn(2, 12, 8), e_nc), {}, memo)
    assert a1[1] is a2[1] and a1[1].is_contiguous()  # one copy for both blocks
    shapes.mark(m1)
    assert all(not own for own in m1)  # applied, so the second block does not mark again
    assert m2[1] is m1[1]
    e_nc.mul_(2)  # changed in place: the memo's copy is stale and is not used
    a3, _, _ = shaper(block, (torch.randn(2, 12, 8), e_nc), {}, memo)
    assert a3[1] is not a1[1] and torch.equal(a3[1], e_nc)
