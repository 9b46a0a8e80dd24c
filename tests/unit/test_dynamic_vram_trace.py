"""Why the compiled clone turns ComfyUI's dynamic VRAM off (``nodes/comfy_bridge.py``
``compile_clone``): what dynamo does with the calls ComfyUI 0.33's ops make for every weight
under dynamic VRAM.

``comfy/ops.py`` ``cast_modules_with_vbar`` runs, per comfy op and per call,
``comfy_aimdo.model_vbar.vbar_fault(s._v)`` (``ModelVBAR.fault``: a new ctypes ``c_uint32``
array, then the foreign call ``lib.vbar_fault``) and ``vbar_signature_compare`` (``len()`` and
a memoryview compare of two such arrays). The real foreign calls need a GPU and the native
library, so ``libc.getpid`` stands in for ``lib.vbar_fault`` here (a FAKE: same ctypes
``_FuncPtr`` type); the array type and ``vbar_signature_compare`` are comfy-aimdo's own.
If a torch release learns to trace these, this test fails and the decision is worth a look.
"""
from __future__ import annotations

import ctypes

import pytest
import torch

model_vbar = pytest.importorskip("comfy_aimdo.model_vbar")

_libc = ctypes.CDLL(None)
FAKE_VBAR_FAULT = _libc.getpid  # FAKE stand-in for comfy-aimdo's lib.vbar_fault (a _FuncPtr)


def _linear_like_comfy_op_under_dynamic_vram(x, w):
    """The per-weight calls of ``cast_modules_with_vbar`` between two ops, in their order."""
    x = x.sin()
    signature = (ctypes.c_uint32 * 3)()          # ModelVBAR.fault builds the signature array
    x = x.cos()
    FAKE_VBAR_FAULT()                             # ... and calls lib.vbar_fault
    x = x.exp()
    resident = model_vbar.vbar_signature_compare(signature, signature)  # ops.py: resident?
    y = torch.nn.functional.linear(x, w)
    return y * 2 if resident else y


def test_the_per_weight_aimdo_calls_are_graph_breaks():
    from torch._dynamo.utils import counters
    before = dict(counters["unimplemented"])
    explained = torch._dynamo.explain(_linear_like_comfy_op_under_dynamic_vram)(
        torch.randn(2, 4), torch.randn(3, 4))
    reasons = [str(b.reason) for b in explained.break_reasons]
    if explained.graph_break_count == -1:
        # torch 2.8/2.9: dynamo gives up on the whole frame at the first call, the ctypes array
        # (explain's -1: no graph, no break); nothing of the op is compiled at all
        new = [k for k, n in counters["unimplemented"].items() if n > before.get(k, 0)]
        assert explained.graph_count == 0 and not reasons, explained
        assert len(new) == 1 and "PyCSimpleType" in new[0] and "c_uint" in new[0], new
        return
    assert explained.graph_break_count == 3, reasons
    assert explained.graph_count == 4
    assert "c_uint_Array_3" in reasons[0]               # the ctypes array
    assert "_FuncPtr" in reasons[1]                     # the foreign call
    assert "__len__" in reasons[2] and "c_uint_Array_3" in reasons[2]  # vbar_signature_compare
