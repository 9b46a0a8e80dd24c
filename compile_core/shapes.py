"""Shape policy: one compiled graph for every latent size a user tries.

Under ``auto``, before each compiled region call the latent-derived dims of its inputs
(batch and tokens = frames x height x width, or batch/H/W for image UNets) are marked
dynamic, and inputs are made contiguous (a transposed first-block input otherwise costs a
second graph through a stride guard). Two traps are closed by scoped fx knobs:
duck sizing (two dims that happen to be equal get tied to one symbol) and 0/1
specialisation (a batch of 1 at the first call would pin the batch to 1).
"""
from __future__ import annotations

import inspect
from typing import Callable

import torch
from torch import nn

POLICIES = ("auto", "static", "dynamic")

# Region forward argument name -> latent-derived dims, per model family (regions.BLOCK_ATTRS keys).
FAMILY_DYNAMIC_DIMS: dict[str, dict[str, tuple[int, ...]]] = {
    # context: WAN's text encoder pads to >= 512 tokens; longer prompts give longer contexts
    "WanModel": {"x": (0, 1), "e": (0, 1), "freqs": (1,), "context": (0, 1)},
}


def fx_knobs(policy: str) -> dict[str, object]:
    """``torch.fx.experimental._config`` knobs for the run (see module docstring)."""
    if policy != "auto":
        return {}
    return {"use_duck_shape": False, "backed_size_oblivious": True}


def torch_dynamic(policy: str) -> bool | None:
    """What ``torch.compile(dynamic=)`` gets. Under ``auto`` our marks decide (the settings'
    ``dynamic`` toggle is what WanVideoWrapper receives; here ``auto`` serves the same intent
    without making weights symbolic or tripping over size-1 dims)."""
    return {"auto": None, "static": False, "dynamic": True}[policy]


def _generic_dims(t: torch.Tensor, whole_model: bool) -> tuple[int, ...]:
    if whole_model:
        # A whole diffusion model derives Python sizes from its latent (e.g. ComfyUI's WAN rope
        # ``linspace(steps=w // 2)``), which re-specialises spatial dims marked dynamic; torch 2.13's
        # FX graph cache then served a graph built for another size (wrong output, see
        # benchmarks/repro_whole_model_fxcache.py). Only the batch is dynamic there.
        return (0,) if t.ndim else ()
    # [B, S, C] tokens; [B, C, H, W] images; [B, C, T, H, W] video latents
    return {3: (0, 1), 4: (0, 2, 3), 5: (0, 2, 3, 4)}.get(t.ndim, (0,) if t.ndim else ())


class InputShaper:
    """Prepares the arguments of one region type's calls (cheap: runs on every block call)."""

    def __init__(self, module: nn.Module, family: str, policy: str, whole_model: bool = False):
        self.policy = policy
        self.whole_model = whole_model
        self.dims = None if whole_model else FAMILY_DYNAMIC_DIMS.get(family)
        # names of forward's positional parameters (after self), computed once: the per-call
        # path maps a positional argument to its name by index, no Signature.bind per block call
        self.positional = [p.name for p in list(inspect.signature(type(module).forward)
                                                .parameters.values())[1:]
                           if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)] \
            if self.dims else []

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict, list]:
        """(args, kwargs, marks): the inputs made contiguous, and the (tensor, dim) pairs to mark
        dynamic (``mark``) before a call that may trace."""
        marks: list[tuple[torch.Tensor, int]] = []
        if self.dims is not None:
            names = self.positional
            args = tuple(self._prepare(v, self.dims.get(names[i] if i < len(names) else "", ()), marks)
                         if isinstance(v, torch.Tensor) else v for i, v in enumerate(args))
            kwargs = {k: self._prepare(v, self.dims.get(k, ()), marks) if isinstance(v, torch.Tensor)
                      else v for k, v in kwargs.items()}
            return args, kwargs, marks
        # Unknown family: the first tensor is the hidden state; other tensors that share its
        # batch size get a dynamic batch too. Nothing else is guessed.
        args = list(args)
        batch = None
        for i, value in enumerate(args):
            if isinstance(value, torch.Tensor):
                if batch is None:
                    batch = value.shape[0] if value.ndim else None
                    args[i] = self._prepare(value, _generic_dims(value, self.whole_model), marks)
                else:
                    args[i] = self._prepare(value, self._batch_dim(value, batch), marks)
        kwargs = {k: self._prepare(v, self._batch_dim(v, batch), marks) if isinstance(v, torch.Tensor)
                  else v for k, v in kwargs.items()}
        return tuple(args), kwargs, marks

    @staticmethod
    def _batch_dim(t: torch.Tensor, batch) -> tuple[int, ...]:
        return (0,) if t.ndim and batch is not None and t.shape[0] == batch else ()

    def _prepare(self, t: torch.Tensor, dims: tuple[int, ...], marks: list) -> torch.Tensor:
        if not t.is_contiguous():
            t = t.contiguous()
        elif t._base is not None and not torch.is_grad_enabled():
            t = t.detach()  # a view brings guards on its base's (old) sizes; detach drops it, no copy
        if self.policy == "auto":
            marks.extend((t, d) for d in dims if d < t.ndim)
        return t


def mark(marks: list[tuple[torch.Tensor, int]]) -> None:
    for t, d in marks:
        torch._dynamo.maybe_mark_dynamic(t, d)


def shaped_call(compiled: Callable, module: nn.Module, shaper: InputShaper, fast=None) -> Callable:
    """The ``_compiled_call_impl`` for one module: shape its inputs, then call ``compiled``, or
    ``fast`` (a ``precompiled.Precompiled``) when it has the region. Marks are applied only
    before a call that may trace: a function loaded by torch's AOT API rejects marked inputs."""
    def call(*args, **kwargs):
        args, kwargs, marks = shaper(module, args, kwargs)
        if fast is None:
            mark(marks)
            return compiled(module, *args, **kwargs)
        return fast.call(module, args, kwargs, lambda: mark(marks), compiled)
    return call
