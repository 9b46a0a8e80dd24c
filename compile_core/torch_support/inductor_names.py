"""Inductor's names the pack reads outside a compile (all private to torch): its C++ compiler
search, its table of what each ``torch.compile`` mode stands for, and the backend objects
``torch.compile`` builds."""
from __future__ import annotations

import torch


def cpp_compiler() -> str:
    """The C++ compiler inductor would build CPU kernels with (raises where it finds none)."""
    from torch._inductor import cpp_builder
    return cpp_builder.get_cpp_compiler()


def mode_options(mode: str | None = None, dynamic: bool | None = None) -> dict:
    """``torch.compile``'s modes (no ``mode``: every mode's name as a key), or the inductor
    options that ``mode`` stands for."""
    from torch._inductor import list_mode_options
    return dict(list_mode_options(mode, dynamic))


class OwnBackend:
    """The backend ``torch.compile`` would build, equal only to itself. Dynamo reuses a cache
    entry of the same code made by an *equal* backend; without ``isolate_recompiles`` (torch
    2.8-2.10) this is how reuse_if_similar off still compiles afresh (it shares the budget)."""

    def __init__(self, backend: str, mode: str | None, dynamic: bool | None):
        if backend == "inductor":
            self.inner = torch._TorchCompileInductorWrapper(mode, None, dynamic)
        else:
            self.inner = torch._TorchCompileWrapper(backend, mode, None, dynamic)
        self.__name__ = backend

    def __call__(self, gm, example_inputs):
        return self.inner(gm, example_inputs)

    def __getattr__(self, name):  # get_compiler_config, reset, ... of the inner backend
        return getattr(self.__dict__["inner"], name)
