"""Shape policy: one compiled graph for every latent size a user tries.

Under ``auto``, before each compiled region call the latent-derived dims of its inputs
(batch and tokens = frames x height x width, or batch/H/W for image UNets) are marked
dynamic, and inputs are made contiguous (a transposed first-block input otherwise costs a
second graph through a stride guard). Two traps are closed by scoped fx knobs:
duck sizing (two dims that happen to be equal get tied to one symbol) and 0/1
specialisation (a batch of 1 at the first call would pin the batch to 1). The knobs are
chosen per torch (``torch_compat.auto_fx_knobs``): on torch 2.8/2.9 ``backed_size_oblivious``
breaks WAN's size-1 modulation dim, so there it is left off and a batch of 1 at the first
call costs one recompile at the first batch of 2.
"""
from __future__ import annotations

import inspect
import operator
from typing import Callable

import torch
from torch import nn

from ..torch_support import dynamo_records, torch_compat

POLICIES = ("auto", "static", "dynamic")

# Region forward argument name -> latent-derived dims, per model family (RegionPlan.family: a
# regions.BLOCK_ATTRS key, or a discovered model's class, or the nearest base class listed here).
# Families not listed get the generic rule (``generic_layout_dims``).
FAMILY_DYNAMIC_DIMS: dict[str, dict[str, tuple[int, ...]]] = {
    # context: WAN's text encoder pads to >= 512 tokens; longer prompts give longer contexts
    # c: a VACE block's control tokens (as many as x's)
    "WanModel": {"x": (0, 1), "e": (0, 1), "freqs": (1,), "context": (0, 1), "c": (0, 1)},
    # Cosmos blocks take channels-last video, which the generic rule ([B, C, T, H, W]) gets wrong:
    # GeneralDIT's x is [T, H, W, B, D] (block_x_format THWBD), Predict2's [B, T, H, W, D]
    "GeneralDIT": {"x": (0, 1, 2, 3), "emb_B_D": (0,), "crossattn_emb": (0, 1), "crossattn_mask": (0, 1),
                   "rope_emb_L_1_1_D": (0,), "adaln_lora_B_3D": (0,)},
    "MiniTrainDIT": {"x_B_T_H_W_D": (0, 1, 2, 3), "emb_B_T_D": (0, 1), "crossattn_emb": (0, 1),
                     "rope_emb_L_1_1_D": (1,), "adaln_lora_B_T_3D": (0, 1),  # rope: [1, L, 1, 1, D]
                     "extra_per_block_pos_emb": (0, 1, 2, 3)},
}
FAMILY_DYNAMIC_DIMS["Anima"] = FAMILY_DYNAMIC_DIMS["MiniTrainDIT"]  # a MiniTrainDIT (regions.BLOCK_ATTRS)
# Stable Cascade: blocks and attention take [B, C, H, W] images (x, a ResBlock's x_skip) and
# [B, ...] conditioning (kv: CLIP tokens, t: the timestep embedding)
FAMILY_DYNAMIC_DIMS["StageC"] = FAMILY_DYNAMIC_DIMS["StageB"] = {"x": (0, 2, 3), "x_skip": (0, 2, 3),
                                                                 "kv": (0,), "t": (0,)}


def fx_knobs(policy: str) -> dict[str, object]:
    """``torch.fx.experimental._config`` knobs for the run (see module docstring)."""
    if policy != "auto":
        return {}
    return torch_compat.auto_fx_knobs()


def torch_dynamic(policy: str) -> bool | None:
    """What ``torch.compile(dynamic=)`` gets. Under ``auto`` our marks decide (the settings'
    ``dynamic`` toggle is what WanVideoWrapper receives; here ``auto`` serves the same intent
    without making weights symbolic or tripping over size-1 dims)."""
    return {"auto": None, "static": False, "dynamic": True}[policy]


def _generic_dims(t: torch.Tensor, whole_model: bool) -> tuple[int, ...]:
    if whole_model:
        # A whole diffusion model derives Python sizes from its latent (e.g. ComfyUI's WAN rope
        # ``linspace(steps=w // 2)``), which re-specialises spatial dims marked dynamic; torch 2.13's
        # FX graph cache then served a graph built for another size (wrong output). Only the
        # batch is dynamic there.
        return (0,) if t.ndim else ()
    # [B, S, C] tokens; [B, C, H, W] images; [B, C, T, H, W] video latents
    return {3: (0, 1), 4: (0, 2, 3), 5: (0, 2, 3, 4)}.get(t.ndim, (0,) if t.ndim else ())


def _token_counts(tensors: list[torch.Tensor], batch: int) -> set[int]:
    """Sizes that follow the latent in a block call whose first tensor is ``tensors[0]``: its
    token count (or spatial size), the token count of every other [B, S, C] input (text tokens
    of joint attention), and the first's count plus each other (a rope table over text + image)."""
    first = tensors[0]
    if first.ndim >= 4:
        spatial = first.shape[2:]
        own = {int(torch.Size(spatial).numel()), int(torch.Size(spatial[-2:]).numel())}
    else:
        own = {int(first.shape[1])} if first.ndim == 3 else set()
    others = {int(t.shape[1]) for t in tensors[1:] if t.ndim == 3 and t.shape[0] == batch}
    # a size-1 dim is a broadcast dim ([B, 1, C] modulation), never a token count: marked dynamic
    # under backed_size_oblivious it would stop broadcasting
    return {n for n in own | others | {a + b for a in own for b in others} if n > 1}


def _learned_dims(t: torch.Tensor, batch, tokens: set[int]) -> tuple[int, ...]:
    """A non-first tensor's latent-derived dims: a batch-sized dim 0, and any other dim whose size
    is one of the call's token counts, except the last (a feature dim; but the last L of a [B, L] /
    [B, 1, L] / [B, 1, 1, L] key mask and of an [.., L, L] mask count)."""
    lead = batch is not None and t.shape[0] == batch
    square = t.ndim >= 3 and t.shape[-1] == t.shape[-2]  # an [.., L, L] attention mask
    # a [B, L] / [B, 1, L] / [B, 1, 1, L] key mask (HunyuanVideo's over text + image tokens)
    key_mask = lead and all(int(s) == 1 for s in t.shape[1:-1])
    last = t.ndim if key_mask or square else t.ndim - 1
    return tuple(d for d in range(max(last, 1))
                 if (d == 0 and lead) or (d < last and int(t.shape[d]) in tokens))


def tensor_slots(args: tuple, kwargs: dict) -> list[tuple[object, torch.Tensor]]:
    """A call's tensors with their slots: an argument index or name, or (slot, i) for the i-th
    tensor of a tuple/list argument (e.g. a (cos, sin) rope pair)."""
    out = []
    for k, v in [*enumerate(args), *kwargs.items()]:
        if isinstance(v, torch.Tensor):
            out.append((k, v))
        elif isinstance(v, (tuple, list)) and len(v) <= 8:
            out.extend(((k, j), x) for j, x in enumerate(v) if isinstance(x, torch.Tensor))
    return out


def generic_layout_dims(slots: list[tuple[object, torch.Tensor]]) -> dict:
    """Unknown family: {slot: dims} for one call layout (``tensor_slots``). The first tensor is
    the hidden state (``_generic_dims``); the others follow ``_learned_dims``."""
    if not slots:
        return {}
    first = slots[0][1]
    batch = first.shape[0] if first.ndim else None
    tokens = _token_counts([v for _, v in slots if v.ndim], batch) if first.ndim else set()
    out = {slots[0][0]: _generic_dims(first, False)}
    out.update((k, _learned_dims(v, batch, tokens) if v.ndim else ()) for k, v in slots[1:])
    return out


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
        # the dims of each positional slot, looked up once (the per-call path indexes them)
        self.arg_dims = [self.dims.get(n, ()) for n in self.positional] if self.dims else []
        # unknown family: dims per argument slot, decided at the first call of each layout and
        # kept, so every later size gets the same marks
        self.layouts: dict[tuple, dict] = {}

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict,
                 memo: dict | None = None) -> tuple[tuple, dict, list]:
        """(args, kwargs, marks): the inputs made contiguous, and per tensor the (tensor, dim) pairs
        to mark dynamic (``mark``) before a call that may trace. ``memo`` (one per model call) keeps the
        prepared form of tensors every block receives (modulation, rope, text context), so they
        are prepared once per model call, not once per block."""
        marks: list[list[tuple[torch.Tensor, int]]] = []
        memo = {} if memo is None else memo
        if self.dims is not None:  # (the hot path: every block call of a known family)
            prepare, tensor, arg_dims, n = self._prepare, torch.Tensor, self.arg_dims, len(self.arg_dims)
            args = tuple([prepare(v, arg_dims[i] if i < n else (), marks, memo) if isinstance(v, tensor)
                          else v for i, v in enumerate(args)])
            return args, self._family_kwargs(kwargs, marks, memo), marks
        if self.whole_model:
            return self._whole_model(args, kwargs, marks, memo)
        slots = tensor_slots(args, kwargs)
        key = tuple((k, v.ndim) for k, v in slots)
        dims = self.layouts.get(key)
        if dims is None:
            dims = self.layouts[key] = generic_layout_dims(slots)
        args = tuple(self._prepare_arg(v, i, dims, marks, memo) for i, v in enumerate(args))
        kwargs = {k: self._prepare_arg(v, k, dims, marks, memo) for k, v in kwargs.items()}
        return args, kwargs, marks

    def _family_kwargs(self, kwargs: dict, marks: list, memo: dict) -> dict:
        """The prepared keyword arguments. A block given the very objects the previous block of
        this model call got (WAN's modulation, rope and text context go to every block) takes
        that block's result, unless one of them had to be copied (a copy is checked against
        in-place changes by ``_prepare``'s memo)."""
        keys, values = tuple(kwargs), tuple(kwargs.values())
        last = memo.get(_LAST_KWARGS)
        if last is not None and last[0] == keys and all(map(operator.is_, values, last[1])):
            marks.extend(own for own in last[3] if own)
            return dict(last[2])
        start, get, prepare, tensor = len(marks), self.dims.get, self._prepare, torch.Tensor
        out = {k: prepare(v, get(k, ()), marks, memo) if isinstance(v, tensor) else v
               for k, v in kwargs.items()}
        if all(p is v or p.data_ptr() == v.data_ptr() for p, v in zip(out.values(), values)
               if isinstance(v, tensor)):
            memo[_LAST_KWARGS] = (keys, values, out, marks[start:])
        return out

    def _prepare_arg(self, v, slot, dims: dict, marks: list, memo: dict):
        if isinstance(v, torch.Tensor):
            return self._prepare(v, dims.get(slot, ()), marks, memo)
        if isinstance(v, (tuple, list)) and any((slot, j) in dims for j in range(len(v))):
            items = [self._prepare(x, dims.get((slot, j), ()), marks, memo) if isinstance(x, torch.Tensor) else x
                     for j, x in enumerate(v)]
            if any(a is not b for a, b in zip(items, v)):
                return type(v)(items) if type(v) in (tuple, list) else v
        return v

    def _whole_model(self, args: tuple, kwargs: dict, marks: list, memo: dict) -> tuple[tuple, dict, list]:
        """Whole model: the first tensor's batch (``_generic_dims``), and the batch of every other
        tensor that shares it. Nothing else is guessed."""
        args = list(args)
        batch = None
        for i, value in enumerate(args):
            if isinstance(value, torch.Tensor):
                if batch is None:
                    batch = value.shape[0] if value.ndim else None
                    args[i] = self._prepare(value, _generic_dims(value, self.whole_model), marks, memo)
                else:
                    args[i] = self._prepare(value, self._batch_dim(value, batch), marks, memo)
        kwargs = {k: self._prepare(v, self._batch_dim(v, batch), marks, memo) if isinstance(v, torch.Tensor)
                  else v for k, v in kwargs.items()}
        return tuple(args), kwargs, marks

    @staticmethod
    def _batch_dim(t: torch.Tensor, batch) -> tuple[int, ...]:
        return (0,) if t.ndim and batch is not None and t.shape[0] == batch else ()

    def _prepare(self, t: torch.Tensor, dims: tuple[int, ...], marks: list, memo: dict) -> torch.Tensor:
        key = (id(t), dims)
        hit = memo.get(key)
        if hit is not None and hit[0] is t and (hit[3] is None or hit[3] == t._version):
            if hit[2]:  # (emptied once marked: see ``mark``)
                marks.append(hit[2])
            return hit[1]
        prepared, own = self._prepare_new(t, dims)
        if own:
            marks.append(own)
        if prepared is t or prepared.data_ptr() == t.data_ptr():  # t, or a view of its memory
            memo[key] = (t, prepared, own, None)  # (t kept alive: its id is not reused this call)
        elif not t.is_inference():  # a copy: stale once t changes in place (inference tensors
            memo[key] = (t, prepared, own, t._version)  # have no version counter: no memo)
        return prepared

    def _prepare_new(self, t: torch.Tensor, dims: tuple[int, ...]) -> tuple[torch.Tensor, list]:
        if not t.is_contiguous():
            t = t.contiguous()
        elif t._base is not None and not torch.is_grad_enabled():
            t = t.detach()  # a view brings guards on its base's (old) sizes; detach drops it, no copy
        if self.policy != "auto":
            return t, []
        # a size-1 dim other than the batch is a broadcast dim (WAN 2.1's modulation ``e`` is
        # [B, 1, 6, C]): marked dynamic under backed_size_oblivious it stops broadcasting, and a
        # block split by a graph break (ComfyUI's sub-quadratic attention) then gave NaN output
        shape = t.shape
        return t, [(t, d) for d in dims if d < len(shape) and (d == 0 or shape[d] != 1)]


_LAST_KWARGS = object()  # memo key: the keyword arguments of the model call's last block call


def mark(marks: list[list[tuple[torch.Tensor, int]]]) -> None:
    """Mark each tensor's (tensor, dim) pairs; a list once applied is emptied, so a tensor that
    every block receives is marked once per model call (the mark stays on the tensor)."""
    for own in marks:
        for t, d in own:
            torch_compat.maybe_mark_dynamic(t, d)
        own.clear()


def shaped_call(compiled: Callable, module: nn.Module, shaper: InputShaper, fast=None,
                memo: dict | None = None) -> Callable:
    """The ``_compiled_call_impl`` for one module: shape its inputs, then call ``compiled``, or
    ``fast`` (a ``precompiled.Precompiled``) when it has the region. Marks are applied only
    before a call that may trace: a function loaded by torch's AOT API rejects marked inputs.
    ``memo``: shared by the modules of one model call (``InputShaper.__call__``)."""
    def call(*args, **kwargs):
        args, kwargs, marks = shaper(module, args, kwargs, memo)
        if fast is not None:
            return fast.call(module, args, kwargs, lambda: mark(marks), compiled)
        if memo is None:
            mark(marks)
            return compiled(module, *args, **kwargs)
        return _marked_until_a_hit(compiled, module, args, kwargs, marks, memo)
    return call


def _marked_until_a_hit(compiled: Callable, module: nn.Module, args: tuple, kwargs: dict,
                        marks: list, memo: dict):
    """Call ``compiled`` with the marks applied, until a call of this region class in this model
    call compiles nothing: its later blocks take the same graphs (one cache entry per forward),
    so they skip the marks, which only matter to a trace (each costs a few microseconds on a
    fresh tensor, every block's ``x``). A later block that still traces (a guard only it
    fails) is traced without its own ``x`` marks, so at worst it recompiles once when the size
    changes (dynamo's automatic dynamic shapes then); its output is the same either way."""
    hit = (_HIT, type(module))
    if hit in memo:
        return compiled(module, *args, **kwargs)
    mark(marks)
    before = dynamo_records.graph_count()
    out = compiled(module, *args, **kwargs)
    if dynamo_records.graph_count() == before:
        memo[hit] = True
    return out


_HIT = object()  # memo key prefix: a call of this region class compiled nothing
