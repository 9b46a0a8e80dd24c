"""The helpers every probe of ``torch_compat`` (and its sibling probe modules) shares: a probe is
a tiny compile run traceless (dynamo's counters, compilation records, cache-dir variables and
log levels restored afterwards), and any exception in it means the feature does not work here.
"""
from __future__ import annotations

import contextlib
import copy
import logging
import os
import re
import types
import warnings
from typing import Callable, Iterator

import torch


def version() -> tuple[int, int]:
    """This torch's (major, minor) version, (0, 0) when it does not parse."""
    m = re.match(r"(\d+)\.(\d+)", torch.__version__)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


class _Counter:
    """A dynamo backend that counts the graphs it is given and runs them as plain FX code."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return gm.forward


def _fresh(fn: Callable) -> Callable:
    """``fn`` with a code object of its own: no cache entry, recompile count or size history
    of another compile applies to it, and its cache entries die with it."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__,
                              fn.__defaults__, fn.__closure__)


_CACHE_DIR_VARS = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
# where a failing probe logs (a fake-tensor error is logged at ERROR before it is raised)
_TORCH_LOGGERS = ("torch._dynamo", "torch._subclasses", "torch._inductor", "torch.fx",
                  "torch._functorch", "torch._guards")


@contextlib.contextmanager
def _traceless() -> Iterator[None]:
    """Quiet (a probe that hits a recompile limit on purpose warns) and uncounted: dynamo's
    counters and compilation records, and the cache-dir variables, are restored on exit.
    Holds dynamo's compile lock throughout (``convert_frame.compile_lock``, an RLock in torch
    2.8-2.14): the start-up warm-up probes on a thread of its own, and another thread's
    compile meanwhile (core's TorchCompileModel, say) would count into what is then restored,
    and lose its counts."""
    from torch._dynamo import convert_frame, utils as dutils
    with getattr(convert_frame, "compile_lock", None) or contextlib.nullcontext():
        saved_counters = copy.deepcopy(dutils.counters)
        metrics = getattr(dutils, "_compilation_metrics", None)
        saved_metrics = list(metrics) if metrics is not None else None
        env = {k: os.environ.get(k) for k in _CACHE_DIR_VARS}  # torch 2.9 sets them on first compile
        loggers = [logging.getLogger(n) for n in _TORCH_LOGGERS]
        levels = [lg.level for lg in loggers]
        for lg in loggers:
            lg.setLevel(logging.CRITICAL)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                yield
        finally:
            for lg, level in zip(loggers, levels):
                lg.setLevel(level)
            for k, v in env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            dutils.counters.clear()
            dutils.counters.update(saved_counters)
            if saved_metrics is not None:
                metrics.clear()
                metrics.extend(saved_metrics)


def _probe(fn: Callable[[], bool]) -> bool:
    """``fn()`` is True, run traceless; any exception means the feature does not work here."""
    try:
        with _traceless():
            return bool(fn())
    except Exception:  # noqa: BLE001 - a probe failing in any way is the answer
        return False


def _sin2(x):
    return x.sin() * 2
