"""torch_support.other_compiles on real torch objects: a torch that renames what it sets on a
compiled module or a dynamo-disabled function fails here."""
import torch
from torch import nn

from compile_core.torch_support import other_compiles, scoped


def test_a_module_torch_compile_wrapped_is_told_from_a_plain_one():
    lin = nn.Linear(2, 2)
    with scoped.scoped_state():  # torch 2.8's torch.compile() sets TORCHINDUCTOR_CACHE_DIR
        wrapped = torch.compile(lin, backend="eager")
    assert other_compiles.compiled_module(wrapped)
    assert not other_compiles.compiled_module(lin)
    assert not other_compiles.compiled_module(None)


def test_a_dynamo_disabled_function_is_told_from_a_plain_one():
    def cast(x):
        return x

    assert other_compiles.dynamo_disabled(torch._dynamo.disable(cast))
    assert not other_compiles.dynamo_disabled(cast)
    assert not other_compiles.dynamo_disabled(None)
