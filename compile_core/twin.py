"""A private twin of a module tree, for a compile that must not touch the shared model.

The whole-graph stage (``whole_graph``) compiles the diffusion model with each block's forward
replaced by a nested compile region. Dynamo finds that forward as an instance attribute of the
block, so the compile needs it there for as long as it traces; on the shared model that would
last the whole background compile (minutes), beside every other graph branch that calls the
same blocks. The compile traces a twin instead:

- the root, every block, and every module on the way from the root to a block are new module
  objects of the same classes, each with a shallow copy of the original's ``__dict__``: the same
  parameter, buffer and hook dictionaries (a LoRA patch that replaces a parameter is seen by
  both), the same attribute values;
- their ``_modules`` map to the twins where the original maps to a twinned module; every other
  submodule (the layers inside a block, the embeddings) is the original object itself.

Dynamo's guards check what a graph depends on, not which object it was traced on (torch
2.8-2.14 treat these modules as unspecialized), so the original model, with the nested forwards
attached for the length of one call on the sampling thread, runs the twin's graph; where a
guard does not accept it, the caller runs the regional graphs. The twin lives only as long as
the compile that needs it.
"""
from __future__ import annotations

from typing import Callable

from torch import nn

# instance attributes a call of ours may have attached to the original for its own length
# (``whole_graph.NestedBlocks``, ``engine.attached``): never copied into a twin
TRANSIENT = ("forward", "_compiled_call_impl")


def twin(root: nn.Module, blocks: list[nn.Module],
         ours: Callable[[str, object], bool]) -> tuple[nn.Module, list[nn.Module]]:
    """``(root's twin, the blocks' twins in order)``. ``ours(name, value)``: whether an
    instance attribute in ``TRANSIENT`` is one of ours (left out) or someone else's (kept)."""
    wanted = {id(b) for b in blocks}
    on_path: dict[int, bool] = {}

    def leads(m: nn.Module) -> bool:
        got = on_path.get(id(m))
        if got is None:
            got = on_path[id(m)] = id(m) in wanted or any(
                leads(c) for c in m._modules.values() if c is not None)
        return got

    made: dict[int, nn.Module] = {}

    def copy(m: nn.Module) -> nn.Module:
        if id(m) in made:  # a module reachable twice (shared submodule) stays one object
            return made[id(m)]
        c = made[id(m)] = object.__new__(type(m))
        state = {k: v for k, v in m.__dict__.items() if not (k in TRANSIENT and ours(k, v))}
        state["_modules"] = {k: copy(v) if v is not None and leads(v) else v
                             for k, v in m._modules.items()}
        c.__dict__.update(state)
        return c

    return copy(root), [made[id(b)] for b in blocks]
