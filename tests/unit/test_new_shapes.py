"""In background mode, a region call no compiled graph takes runs eagerly."""
import functools
import types

import pytest
import torch
from torch import nn

from compile_core.run import new_shapes
from compile_core.torch_support import guards

pytestmark = pytest.mark.skipif(not guards.guard_check(),
                                reason="this torch's cache entries do not say their backend")


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, scale=1.0):
        return self.lin(x).relu() * scale


def _fresh_block_class():
    """A Block whose forward is a new code object: dynamo keeps its graphs per code object,
    so no graph from another test (or another torch.compile) is on it."""
    f = Block.forward
    forward = types.FunctionType(f.__code__.replace(), f.__globals__, f.__name__, f.__defaults__,
                                 f.__closure__)
    return type("FreshBlock", (Block,), {"forward": forward})


def _compiled_once(block, x, dynamic=False):
    c = torch.compile(nn.Module._call_impl, backend="eager", dynamic=dynamic)
    c(block, x)
    return c


def test_cached_graph_accepts_answers_as_dynamos_guards(graph_count):
    cls = _fresh_block_class()
    a, b = cls(), cls()
    x = torch.randn(2, 4)
    c = torch.compile(nn.Module._call_impl, backend="eager", dynamic=False)
    assert guards.cached_graph_accepts(c, a, (x,), {}) is None  # nothing compiled yet
    dynamic = _compiled_once(a, torch.randn(7, 4), dynamic=True)  # another compiled function
    assert guards.cached_graph_accepts(c, a, (x,), {}) is None  # its graphs are not c's
    c(a, x)
    accepts = functools.partial(guards.cached_graph_accepts, c)
    assert accepts(a, (x,), {}) is True
    assert accepts(b, (torch.randn(2, 4),), {"scale": 1.0}) is True
    assert accepts(a, (torch.randn(3, 4),), {}) is False  # only the dynamic graph would take it
    assert guards.cached_graph_accepts(dynamic, a, (torch.randn(3, 4),), {}) is True
    assert accepts(a, (x,), {"scale": 2.0}) is False  # a guarded float
    assert accepts(a, (x, 1.0, "extra"), {}) is None  # does not bind


def test_a_call_no_graph_takes_runs_eagerly_and_is_kept(graph_count):
    cls = _fresh_block_class()
    block, x = cls(), torch.randn(2, 4)
    c = _compiled_once(block, x)
    g0 = graph_count()
    miss = new_shapes.EagerOnMiss(c, type)
    assert miss.run(block, (x,), {}, (x,), {}) is None  # the compiled region runs it
    big = torch.randn(5, 4)
    out = miss.run(block, (big,), {}, (big,), {})
    torch.testing.assert_close(out[0], block.lin(big).relu())
    assert graph_count() == g0  # eager: nothing compiled
    assert list(miss.captured) == [cls] and miss.eager_regions == 1
    kept = miss.captured[cls]
    big.add_(1)  # a later in-place op on the input does not change what was kept
    assert not torch.equal(kept.args[0], big)


def test_two_compiles_with_the_same_settings_share_their_graphs_as_dynamo_does(graph_count):
    cls = _fresh_block_class()
    block, x = cls(), torch.randn(2, 4)
    _compiled_once(block, x)
    again = torch.compile(nn.Module._call_impl, backend="eager", dynamic=False)
    assert guards.cached_graph_accepts(again, block, (x,), {}) is True
    g0 = graph_count()
    again(block, x)
    assert graph_count() == g0  # dynamo agrees: no compile
