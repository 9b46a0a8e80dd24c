"""Background mode: a region call that would compile runs eagerly, and its compile is queued.

Once a model in background mode runs compiled, a new input (a new resolution or batch the
graphs do not cover) would make dynamo compile on the calling thread and hold up the step.
``EagerOnMiss`` sits in front of each region call of such a model: before the compiled
region is called it asks whether a graph already takes the call, exactly as dynamo would
(its guards, ``guards.cached_graph_accepts``; for a saved region, the saved region's
own guards). A call no graph takes runs the module's eager forward instead, and its inputs
are kept so the engine can queue their compile on the worker (``background``).

When the answer cannot be told (a forward dynamo never compiled, a graph break's resume
function, a torch whose guards cannot be run this way), the call takes the regular path
and may compile on the calling thread, as in the foreground mode: never a wrong output.
"""
from __future__ import annotations

from typing import Callable

from torch import nn

from ..torch_support import guards
from .background import MAX_CAPTURED, Captured


class EagerOnMiss:
    """For one model call: regions no compiled graph takes run eagerly; their inputs are kept
    (``captured``, one per region variant ``key``)."""

    def __init__(self, compiled: Callable, key: Callable[[nn.Module], object]):
        self.compiled, self.key = compiled, key
        self.captured: dict[object, Captured] = {}
        self.eager_regions = 0

    @staticmethod
    def available() -> bool:
        return guards.guard_check()

    def run(self, module: nn.Module, args: tuple, kwargs: dict, shaped: tuple, shaped_kwargs: dict,
            fast=None) -> tuple | None:
        """``(eager output,)`` when no graph takes this call (``shaped``: the inputs as the
        compiled region gets them), else None: the caller runs the compiled region."""
        if not self._would_compile(module, shaped, shaped_kwargs, fast):
            return None
        k = self.key(module)
        if k not in self.captured and len(self.captured) < MAX_CAPTURED:
            self.captured[k] = Captured(module, args, kwargs)
        self.eager_regions += 1
        return (nn.Module._call_impl(module, *args, **kwargs),)

    def _would_compile(self, module: nn.Module, args: tuple, kwargs: dict, fast) -> bool:
        if fast is not None:
            taken = fast.takes(module, args, kwargs)
            if taken is not None:
                return not taken
        return guards.cached_graph_accepts(self.compiled, module, args, kwargs) is False
