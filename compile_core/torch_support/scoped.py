"""The one place that changes global torch state, and only for the duration of a ``with`` block.

Dynamo/inductor knobs go through torch's own ``config.patch`` (which restores on exit);
environment variables are set and restored here. A knob this torch does not have gets
one warning and is skipped. Inductor ``freezing`` is forced off inside every scope: it
bakes weights into the graph, so LoRA patches would be silently ignored.
"""
from __future__ import annotations

import functools
import os
from typing import Mapping

import torch
import torch._dynamo.config as dynamo_config
import torch._inductor.config as inductor_config
import torch.fx.experimental._config as fx_config

from ..report import log

ALWAYS_INDUCTOR = {"freezing": False}
# Environment variables the pack may set during a run (snapshot() covers them).
PACK_ENV_VARS = ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "TORCHINDUCTOR_FX_GRAPH_CACHE")


@functools.lru_cache(maxsize=None)
def _names(config_module) -> frozenset[str]:
    """A config module's knob names (fixed once torch is imported; copying the whole config on
    every model call to read them cost about a millisecond per call)."""
    return frozenset(config_module.get_config_copy())


def _known(config_module, knobs: Mapping[str, object], label: str) -> dict:
    have = _names(config_module)
    out = {}
    for name, value in knobs.items():
        if name in have:
            out[name] = value
        else:
            log.warn_once(f"knob:{label}.{name}",
                          "this torch has no %s.%s; ignoring it", label, name)
    return out


def scoped_state(dynamo: Mapping[str, object] | None = None,
                 inductor: Mapping[str, object] | None = None,
                 env: Mapping[str, str] | None = None,
                 fx: Mapping[str, object] | None = None) -> "_Active":
    """Apply dynamo/inductor/fx knobs and env vars inside the block; restore all of them after."""
    return Scope(dynamo, inductor, env, fx).active()


class Scope:
    """``scoped_state``'s arguments worked out once: the knobs this torch has (one warning
    for each it lacks) and the environment. A model's scope is entered on
    every model call (``active``), and working these out each time cost about a fifth of
    the scope's time. Holds no per-entry state, so threads may enter one scope at once."""

    __slots__ = ("knobs", "env", "env_keys")

    def __init__(self, dynamo: Mapping[str, object] | None = None,
                 inductor: Mapping[str, object] | None = None,
                 env: Mapping[str, str] | None = None,
                 fx: Mapping[str, object] | None = None):
        self.knobs = tuple((module, name, value) for module, values in (
            (dynamo_config, _known(dynamo_config, dynamo or {}, "torch._dynamo.config")),
            (fx_config, _known(fx_config, fx or {}, "torch.fx.experimental._config")),
            (inductor_config, _known(inductor_config, {**(inductor or {}), **ALWAYS_INDUCTOR},
                                     "torch._inductor.config"))) for name, value in values.items())
        self.env = dict(env or {})
        # torch itself sets the cache-dir variables when they are unset (inductor's cache_dir(),
        # Triton's autotuner), so they are restored even when this scope does not set them
        self.env_keys = tuple({*self.env, *_CACHE_DIR_VARS})

    def active(self) -> "_Active":
        """A context manager that applies this scope for one ``with`` block."""
        return _Active(self)


class _Active:
    """One entry of a ``Scope``: what it changed, put back on exit (also after an error)."""

    __slots__ = ("scope", "saved_env", "moves_cache", "prior")

    def __init__(self, scope: Scope):
        self.scope = scope

    def __enter__(self) -> None:
        scope, environ = self.scope, os.environ
        self.saved_env = saved = {k: environ.get(k) for k in scope.env_keys}
        self.moves_cache = any(saved.get(k) != v for k, v in scope.env.items() if k in _CACHE_DIR_VARS)
        self.prior = []
        try:
            environ.update(scope.env)
            if self.moves_cache:
                _clear_inductor_caches()
            _set_knobs(scope.knobs, self.prior)
        except BaseException:
            self._restore()
            raise

    def __exit__(self, *exc) -> bool:
        self._restore()
        return False

    def _restore(self) -> None:
        for config_module, name, value in reversed(self.prior):
            setattr(config_module, name, value)
        _restore_env(self.saved_env)
        if self.moves_cache:
            _clear_inductor_caches()


def _set_knobs(knobs, prior: list) -> None:
    """Set the knobs whose value differs, recording (module, name, old value) in ``prior`` as it
    goes. This is what torch's ``config.patch`` does on enter and exit, without the class it
    builds per call (about 30 us each, three per model call)."""
    for config_module, name, value in knobs:
        old = getattr(config_module, name)
        if old is value or (type(old) is type(value) and old == value):
            continue
        prior.append((config_module, name, old))
        setattr(config_module, name, value)


def _restore_env(saved: Mapping[str, str | None]) -> None:
    for k, v in saved.items():
        if os.environ.get(k) == v:
            continue
        if v is None:
            del os.environ[k]
        else:
            os.environ[k] = v


_CACHE_DIR_VARS = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")


def _clear_inductor_caches() -> None:
    """What torch's own ``temporary_cache_dir`` does on a cache-dir switch: drop the in-memory
    lookups that remember the previous directory."""
    try:
        from torch._inductor.utils import clear_caches
        clear_caches()
    except ImportError:
        pass


def snapshot() -> dict:
    """Global state a compile could leak: configs, the pack's env vars, matmul precision flags."""
    return {
        "dynamo": dynamo_config.get_config_copy(),
        "inductor": inductor_config.get_config_copy(),
        "fx": fx_config.get_config_copy(),
        "env": {k: os.environ.get(k) for k in PACK_ENV_VARS},
        "tf32": (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
                 torch.get_float32_matmul_precision()),
    }
