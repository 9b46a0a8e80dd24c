"""Finding a diffusion model's repeated transformer blocks from the model itself.

A block list is an ``nn.ModuleList`` / ``nn.ModuleDict`` / plain ``nn.Sequential`` held as an attribute of the
diffusion model (or of one of its direct children: ``transformer.blocks``) whose children all
share one class, at least two of them, each a real block (a module with submodules of its own,
not a bare ``Linear``), and whose attribute name the model's code uses outside ``__init__``
(a list that ``forward`` never reaches is not compiled). Identical blocks run the same
``forward`` code object, so one compiled graph serves all of them.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import re

from torch import nn


@dataclasses.dataclass(frozen=True)
class Discovery:
    paths: tuple[str, ...]  # dotted paths of the blocks, in model order
    why_not: str = ""       # when no block was found: why, in a few words


def discover(diffusion_model: nn.Module) -> Discovery:
    """The repeated blocks of ``diffusion_model`` (see the module docstring)."""
    lists, unused = [], []
    for path, owner_chain, holder in _candidate_lists(diffusion_model):
        attr = path.rsplit(".", 1)[-1]
        if any(_uses(type(o), attr) for o in owner_chain):
            lists.append((path, holder))
        else:
            unused.append(path)
    paths = tuple(f"{p}.{name}" for p, holder in lists for name, _ in holder.named_children())
    if paths:
        return Discovery(paths)
    if unused:
        return Discovery((), f"its block list(s) {', '.join(unused)} are not used by its forward code")
    return Discovery((), "no list of at least 2 blocks of one class among its attributes")


def _candidate_lists(model: nn.Module):
    """(path, modules whose code may use it, list) for each block list, top level first."""
    for name, child in model.named_children():
        if _is_block_list(child):
            yield name, (model,), child
    for name, child in model.named_children():
        if _is_list(child):
            continue
        for sub, grandchild in child.named_children():
            if _is_block_list(grandchild):
                yield f"{name}.{sub}", (model, child), grandchild


def _is_list(m: nn.Module) -> bool:
    return type(m) in (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def _is_block_list(m: nn.Module) -> bool:
    if not _is_list(m) or len(m) < 2:
        return False
    classes = {type(c) for c in m.children()}
    if len(classes) != 1:
        return False
    block = next(iter(m.children()))
    return type(block) not in (nn.ModuleList, nn.Sequential, nn.ModuleDict) \
        and any(True for _ in block.children())


@functools.lru_cache(maxsize=None)
def _code(cls: type) -> str:
    """Source of ``cls`` and its bases below ``nn.Module``, without ``__init__`` bodies."""
    parts = []
    for klass in cls.__mro__:
        if klass is nn.Module or not issubclass(klass, nn.Module) or klass.__module__.startswith("torch."):
            continue
        for name, fn in vars(klass).items():
            if name == "__init__" or not callable(fn) and not isinstance(fn, (staticmethod, classmethod)):
                continue
            try:
                parts.append(inspect.getsource(fn))
            except (OSError, TypeError):
                parts.append("<no source>")
    return "\n".join(parts)


def _uses(cls: type, attr: str) -> bool:
    code = _code(cls)
    if "<no source>" in code and not code.replace("<no source>", "").strip():
        return True  # no source to read (a compiled or generated class): trust the structure
    return re.search(rf"\.{re.escape(attr)}\b|[\"']{re.escape(attr)}[\"']", code) is not None
