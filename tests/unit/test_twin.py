"""``compile_core.twin``: the private module tree the whole-graph stage traces, so the shared
model is never changed while that compile runs."""
import torch
from torch import nn

from compile_core import twin


def _never_ours(name, value):
    return False


def test_the_twin_shares_weights_and_leaves_and_copies_only_the_path_to_the_blocks(wan):
    model = wan.Model(n_blocks=3)
    blocks = list(model.blocks)
    root, twins = twin.twin(model, blocks, _never_ours)
    assert root is not model and type(root) is type(model)
    assert [type(b) for b in twins] == [type(b) for b in blocks]
    assert all(t is not b for t, b in zip(twins, blocks))
    assert root.blocks is not model.blocks and list(root.blocks) == twins  # the path: twinned
    assert root.head is model.head  # off the path: the original object
    assert all(list(t.children()) == list(b.children()) for t, b in zip(twins, blocks))  # a block's layers
    assert dict(root.named_parameters()).keys() == dict(model.named_parameters()).keys()
    assert all(p is q for p, q in zip(root.parameters(), model.parameters()))
    assert list(model.blocks) == blocks  # the original tree is as it was


def test_a_weight_replaced_on_the_original_after_the_twin_is_made_is_the_twins_too(wan, wan_inputs):
    model = wan.Model(n_blocks=2).eval()
    root, twins = twin.twin(model, list(model.blocks), _never_ours)
    block = model.blocks[1]
    name, param = next(iter(block._parameters.items()))
    block._parameters[name] = nn.Parameter(param.detach() + 1.0)  # as a patch sets a weight
    assert twins[1]._parameters[name] is block._parameters[name]
    x, t = wan_inputs()
    with torch.no_grad():
        torch.testing.assert_close(root(x, t), model(x, t))


def test_attributes_a_call_of_ours_attached_are_left_out_and_others_kept(wan):
    model = wan.Model(n_blocks=2)
    mine, theirs = (lambda *a: None), (lambda *a: None)
    model.blocks[0].__dict__["forward"] = mine
    model.blocks[1].__dict__["forward"] = theirs
    model.__dict__["_compiled_call_impl"] = mine
    root, twins = twin.twin(model, list(model.blocks), lambda name, value: value is mine)
    assert "forward" not in twins[0].__dict__ and twins[1].__dict__["forward"] is theirs
    assert "_compiled_call_impl" not in root.__dict__
    assert model.blocks[0].__dict__["forward"] is mine  # the original keeps what it had
