"""Shape policy ``auto``: which input dims get marked dynamic (compile_core.plan.shapes)."""
from __future__ import annotations

import torch
from torch import nn

from compile_core.plan import shapes


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


@torch.no_grad()  # (as ComfyUI samples: a view is then detached, not copied)
def test_keyword_tensors_every_block_receives_are_taken_from_the_previous_block_call():
    block = _WanBlockLike()
    shaper = shapes.InputShaper(block, "WanModel", "auto")
    e = torch.randn(2, 1, 6, 8)[:, :]  # a view: detached, not copied
    kwargs = {"freqs": torch.randn(2, 12, 1, 4), "context": torch.randn(2, 5, 8), "e": e}
    memo: dict = {}
    _, k1, m1 = shaper(block, (torch.randn(2, 12, 8),), kwargs, memo)
    _, k2, m2 = shaper(block, (torch.randn(2, 12, 8),), dict(kwargs), memo)
    assert k2 is not k1 and all(k2[n] is k1[n] for n in kwargs)  # the first call's prepared tensors
    assert k1["e"] is not e and k1["e"]._base is None  # the view was detached
    assert _marked(m2) == _marked(m1)  # not applied yet: the second call still carries the marks
    shapes.mark(m1)
    prepared = []
    shaper._prepare = lambda t, *a, f=shaper._prepare: prepared.append(t) or f(t, *a)
    x = torch.randn(2, 12, 8)
    _, k3, m3 = shaper(block, (x,), dict(kwargs), memo)
    assert prepared == [x]  # the keyword tensors were not looked at one by one
    assert k3["e"] is k1["e"] and _marked(m3) == {(2, 12, 8): {0, 1}}  # only the new x
    other = {**kwargs, "context": torch.randn(2, 7, 8)}  # another object: prepared anew
    _, k4, m4 = shaper(block, (torch.randn(2, 12, 8),), other, memo)
    assert k4["context"] is other["context"] and (2, 7, 8) in _marked(m4)


def test_a_copied_keyword_tensor_changed_in_place_between_blocks_is_copied_again():
    block = _WanBlockLike()
    shaper = shapes.InputShaper(block, "WanModel", "auto")
    e_nc = torch.randn(2, 8, 6, 1).permute(0, 3, 2, 1)  # [2, 1, 6, 8], not contiguous: copied
    memo: dict = {}
    _, k1, _ = shaper(block, (torch.randn(2, 12, 8),), {"e": e_nc}, memo)
    e_nc.mul_(2)
    _, k2, _ = shaper(block, (torch.randn(2, 12, 8),), {"e": e_nc}, memo)
    assert k2["e"] is not k1["e"] and torch.equal(k2["e"], e_nc)


def _dynamic_dims(t: torch.Tensor) -> set[int]:
    return set(getattr(t, "_dynamo_weak_dynamic_indices", ()))


def test_marks_stop_once_a_block_call_compiles_nothing_and_go_on_while_blocks_trace():
    """``shaped_call`` in one model call (one memo): the first block's inputs are marked; once a
    call of the class compiles nothing, later blocks' ``x`` are not marked. FAKE compiled
    callables stand in for dynamo: one that 'traces' bumps dynamo's graph counter."""
    from torch._dynamo.utils import counters

    def tracing(module, *args, **kwargs):  # FAKE: a call that compiled a graph
        counters["stats"]["unique_graphs"] += 1
        return args[0]

    def hitting(module, *args, **kwargs):  # FAKE: a call a cached graph took
        return args[0]
    shaper = shapes.InputShaper(_WanBlockLike(), "WanModel", "auto")
    for compiled, expect in ((hitting, [{0, 1}, set(), set()]), (tracing, [{0, 1}] * 3)):
        memo: dict = {}
        xs = [torch.randn(2, 12, 8) for _ in range(3)]
        context = torch.randn(2, 5, 8)
        for x in xs:
            block = _WanBlockLike()
            shapes.shaped_call(compiled, block, shaper, memo=memo)(x, torch.randn(2, 1, 6, 8), context=context)
        assert [_dynamic_dims(x) for x in xs] == expect
        assert _dynamic_dims(context) == {0, 1}  # shared: marked at the first block
