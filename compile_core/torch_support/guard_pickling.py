"""Fixes for torch's guard pickler while a region is traced for the AOT API: torch's dtype,
layout and memory-format singletons pickled by value, and the instance attributes of a tensor
subclass (ComfyUI-GGUF's ``GGMLTensor``) kept on what torch rebuilds at load.
"""
from __future__ import annotations

import torch
from torch import nn


class _Reduced:
    """Stands for one reduction (callable, args) inside another object's reduction."""
    __slots__ = ("reduction",)

    def __init__(self, reduction: tuple):
        self.reduction = reduction


def reduce_tensor_attributes(obj: object, reduction: object) -> object:
    """torch's reduction of a guarded tensor, with the instance attributes of a plain tensor
    subclass put back on what it rebuilds. torch rebuilds every guarded tensor as a FakeTensor
    with only its Python type recorded (``pytype``); a subclass that keeps its data in instance
    attributes (ComfyUI-GGUF's ``GGMLTensor``: ``tensor_type``, ``tensor_shape``, ``patches``)
    lost them, so rebuilding the guards on them failed at load (``'FakeTensor' object has no
    attribute 'patches'``). The rebuilt guards then read the same values as the traced ones.
    Only torch's own functions are named in the file (``torch._utils._set_obj_state``)."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass
    if (type(obj) in (torch.Tensor, nn.Parameter) or isinstance(obj, torch._subclasses.FakeTensor)
            or is_traceable_wrapper_subclass(obj) or not getattr(obj, "__dict__", None)
            or not isinstance(reduction, tuple) or reduction[0] != _unpickle_tensor()):
        return reduction
    from torch._utils import _set_obj_state
    return _set_obj_state, (_Reduced(reduction), dict(obj.__dict__))


def _unpickle_tensor():
    from torch._dynamo.guards import GuardsStatePickler
    return GuardsStatePickler._unpickle_tensor


class ValuePickler:
    """While tracing for the AOT API, fix two things in torch's guard pickler (the method is
    swapped on torch's own class: a subclass would be pickled by name into the file):

    - pickle torch's dtype/layout/memory-format singletons by value. torch's guard pickler
      marks every unguarded plain attribute of a module as missing *by id*; ComfyUI 0.12+
      stores ``<param>_comfy_model_dtype = torch.float32`` on modules, so without this every
      tensor dtype in the saved guards became ``_Missing`` and no saved region could be loaded
      (``empty_strided(): argument 'dtype' must be torch.dtype``);
    - keep a tensor subclass's instance attributes (``reduce_tensor_attributes``: GGUF)."""
    _SINGLETONS = (torch.dtype, torch.layout, torch.memory_format)

    def __enter__(self):
        import torch._dynamo.guards as guards
        self._cls = getattr(guards, "GuardsStatePickler", None)
        if self._cls is not None:
            singletons, orig = self._SINGLETONS, self._cls.reducer_override

            def reducer_override(pickler, obj):
                if isinstance(obj, singletons):
                    return NotImplemented  # torch.float32 etc. pickle by name
                if isinstance(obj, _Reduced):
                    return obj.reduction
                reduction = orig(pickler, obj)
                return reduce_tensor_attributes(obj, reduction) if isinstance(obj, torch.Tensor) else reduction

            self._orig = orig
            self._cls.reducer_override = reducer_override
        return self

    def __exit__(self, *exc):
        if self._cls is not None:
            self._cls.reducer_override = self._orig
