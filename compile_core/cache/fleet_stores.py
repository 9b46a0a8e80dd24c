"""Where a fleet's shared entries are kept: a directory (a network volume, say) or Redis,
chosen by the operator's ``TORCH_COMPILE_SPEED_SHARED_CACHE``. A store only gets and puts
bytes under a key (``fleet_entries`` seals, signs and checks them)."""
from __future__ import annotations

import math
import os
from pathlib import Path

from ..report import log
from .persist import write_atomic

STORE_ENV = "TORCH_COMPILE_SPEED_SHARED_CACHE"
TTL_ENV = "TORCH_COMPILE_SPEED_SHARED_TTL_S"
TIMEOUT_ENV = "TORCH_COMPILE_SPEED_SHARED_TIMEOUT_S"
DEFAULT_TIMEOUT_S, DEFAULT_TTL_S = 3.0, 7 * 24 * 3600
KEY_PREFIX = "tcs:compile:"


def env_number(name: str, default: float, cast=float):
    """``cast`` of the operator's setting ``name``; the default, with one warning naming the
    variable and its value, when it is not a positive finite number."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return cast(default)
    try:
        value = float(raw)
        if not math.isfinite(value) or value <= 0:
            raise ValueError(raw)
        return cast(value)
    except (ValueError, OverflowError):
        log.warn_once(f"fleet-env:{name}:{raw}", "%s=%r is not a positive number; using the "
                      "default %s", name, raw, cast(default))
        return cast(default)


class DirStore:
    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    def describe(self) -> str:
        return f"directory {self.root}"

    def get(self, key: str) -> bytes | None:
        path = self.root / f"{key}.tcs"
        return path.read_bytes() if path.is_file() else None

    def put(self, key: str, blob: bytes) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        write_atomic(self.root / f"{key}.tcs", blob)


class RedisStore:
    def __init__(self, url: str, timeout_s: float, ttl_s: int):
        import redis  # the optional dependency is only needed when an operator configures Redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry
        self.url, self.ttl_s = url, ttl_s
        # one attempt, bounded by timeout_s: a store that is down must cost little, once
        self.client = redis.Redis.from_url(url, socket_timeout=timeout_s,
                                           socket_connect_timeout=timeout_s,
                                           retry=Retry(NoBackoff(), 0))

    def describe(self) -> str:
        return f"redis {log.redact(self.url)}"

    def get(self, key: str) -> bytes | None:
        return self.client.get(KEY_PREFIX + key)

    def put(self, key: str, blob: bytes) -> None:
        self.client.set(KEY_PREFIX + key, blob, ex=self.ttl_s)


def store_from_env() -> DirStore | RedisStore | None:
    spec = os.environ.get(STORE_ENV, "").strip()
    if not spec:
        return None
    if spec.startswith(("redis://", "rediss://", "unix://")):
        return RedisStore(spec, env_number(TIMEOUT_ENV, DEFAULT_TIMEOUT_S),
                          env_number(TTL_ENV, DEFAULT_TTL_S, cast=lambda v: max(1, int(v))))
    return DirStore(spec)


