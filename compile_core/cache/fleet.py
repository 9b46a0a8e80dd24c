"""Shared compile cache for a fleet of ComfyUI workers: compile once, warm-start everywhere.

Configured by the server operator only, through ``TORCH_COMPILE_SPEED_SHARED_CACHE``
(``redis://host:port/db`` or a directory such as a network volume); a workflow can never
name a store. After a successful compile a worker publishes its per-fingerprint inductor
cache directory (FX-graph and AOTAutograd entries, plus the built ``.so`` files on CPU or
the Triton kernels and autotune results on GPU: the same entries torch's mega-cache bytes
would serialize) as one archive; a worker whose local cache lacks that fingerprint fetches
and unpacks it before compiling, so torch finds its caches warm.

Safety: entries are size-limited (and expire in Redis), carry a SHA-256 of their payload that
is checked before anything is unpacked (it catches damage, not a hostile writer), and archive
members that are absolute, contain ``..``, or are links/devices are rejected. Nothing from the
store is executed except what torch itself loads from its cache directory. Any store problem
costs at most a bounded timeout and one warning; the worker then compiles locally.

Authenticity: what torch loads from these entries includes pickles and native code, so anyone who
can write to the store could run code on every worker. With ``TORCH_COMPILE_SPEED_SHARED_KEY``
set (the same secret on every worker), each published entry is signed
with HMAC-SHA256 over its sealed bytes, and a worker loads only entries whose HMAC verifies with
its key (constant-time compare); anything else is refused with one warning and compiled locally.
Without the key, entries are trusted unsigned (the store itself must then be trusted), which a
worker says once; ``TORCH_COMPILE_SPEED_SHARED_REQUIRE_SIGNED=1`` makes a worker without the key
not use the store at all. The store's URL is never logged with its user or password.

An entry's identity, archive, seal and signature are in ``fleet_entries``; the stores that
keep entries in ``fleet_stores``.
"""
from __future__ import annotations

import functools
import json
import os
import time
from pathlib import Path

import torch

from ..report import log
from ..plan import switches
from .fleet_entries import (KEY_ENV, FleetError, artifact_identity, artifact_key,
                            pack_dir, seal, sign, unpack_into, unseal, verify)
from .fleet_stores import STORE_ENV, env_number, store_from_env

MAX_MB_ENV = "TORCH_COMPILE_SPEED_SHARED_MAX_MB"
REQUIRE_SIGNED_ENV = "TORCH_COMPILE_SPEED_SHARED_REQUIRE_SIGNED"  # operator: no key, no store
DEFAULT_MAX_MB = 2048.0


def key_from_env() -> bytes | None:
    """The operator's shared key (``TORCH_COMPILE_SPEED_SHARED_KEY``), or None when unset/empty."""
    raw = os.environ.get(KEY_ENV, "").strip()
    return raw.encode() if raw else None


# --------------------------------------------------------------------------- fetch / publish

_FROM_ENV = object()


class Fleet:
    def __init__(self, store, max_bytes: int | None = None, secret: bytes | str | None = _FROM_ENV):
        self.store = store
        self.max_bytes = max_bytes or int(env_number(MAX_MB_ENV, DEFAULT_MAX_MB) * 1024 ** 2)
        if secret is _FROM_ENV:
            secret = key_from_env()
        self.secret = secret.encode() if isinstance(secret, str) else (secret or None)
        if self.secret is None:
            log.warn_once("fleet-unsigned", "shared cache %s: %s is not set, so its entries (pickles "
                          "and native kernels that torch loads) are trusted unsigned: anyone who can "
                          "write to it can run code on this worker. Set the same key on every worker "
                          "to sign and verify them, and %s=1 to refuse unsigned ones.",
                          store.describe(), KEY_ENV, REQUIRE_SIGNED_ENV)

    @classmethod
    def from_env(cls) -> "Fleet | None":
        """The operator-configured fleet (one per configuration and process), or None."""
        return _fleet_for(os.environ.get(STORE_ENV, "").strip(), key_from_env())

    @classmethod
    def _build(cls) -> "Fleet | None":
        try:
            store = store_from_env()
        except Exception as exc:  # noqa: BLE001 - e.g. redis package missing
            log.warn_once("fleet-config", "shared cache %s unusable (%s); compiling locally",
                          os.environ.get(STORE_ENV), exc)
            return None
        if store and key_from_env() is None and switches.switch(REQUIRE_SIGNED_ENV, False):
            log.warn_once("fleet-require-signed", "shared cache %s not used: %s=1 requires signed "
                          "entries and %s is not set on this worker; compiling locally",
                          store.describe(), REQUIRE_SIGNED_ENV, KEY_ENV)
            return None
        return cls(store) if store else None

    def fetch_into(self, fingerprint: str, device: torch.device, dest: Path) -> bool:
        """Fetch and unpack the shared entry into ``dest``; False (and one warning) on any problem."""
        key = artifact_key(fingerprint, device)
        start = time.perf_counter()
        try:
            payload = self._get_sealed(key, artifact_identity(device), self.max_bytes)
            if payload is None:
                log.info("shared cache miss for %s in %s", fingerprint[:12], self.store.describe())
                return False
            files = unpack_into(payload, dest)
        except Exception as exc:  # noqa: BLE001 - a store problem must never break the run
            log.warn_once(f"fleet-fetch:{type(exc).__name__}",
                          "shared cache entry for %s not used (%s: %s); compiling locally",
                          fingerprint[:12], type(exc).__name__, exc)
            return False
        log.info("shared cache hit: %d file(s) for %s from %s in %.2f s", files, fingerprint[:12],
                 self.store.describe(), time.perf_counter() - start)
        return True

    def _get_sealed(self, key: str, ident: dict, max_bytes: int) -> bytes | None:
        """The checked payload stored under ``key``; None when absent. FleetError when it is
        over ``max_bytes``, built for another identity, or corrupt."""
        blob = self.store.get(key)
        if blob is None:
            return None
        if len(blob) > max_bytes:
            raise FleetError(f"entry is {len(blob)} bytes, over the {max_bytes} limit")
        return unseal(verify(blob, self.secret), key, ident)

    def _put_sealed(self, key: str, ident: dict, payload: bytes) -> bool:
        """Store ``payload`` sealed; False (and one warning per kind of error) on a problem."""
        try:
            blob = seal(key, ident, payload)
            self.store.put(key, sign(blob, self.secret) if self.secret else blob)
        except Exception as exc:  # noqa: BLE001 - a store problem must never break the run
            _publish_failed(exc)
            return False
        return True

    def publish_from(self, fingerprint: str, device: torch.device, src: Path) -> bool:
        try:
            payload = pack_dir(src)
        except Exception as exc:  # noqa: BLE001
            _publish_failed(exc)
            return False
        if len(payload) > self.max_bytes:
            log.warn_once("fleet-size", "compiled cache is %d MB, over the shared limit %d MB; "
                          "not published", len(payload) >> 20, self.max_bytes >> 20)
            return False
        if not self._put_sealed(artifact_key(fingerprint, device), artifact_identity(device), payload):
            return False
        log.info("published %s (%.1f MB) to shared cache %s", fingerprint[:12], len(payload) / 2 ** 20,
                 self.store.describe())
        return True

    def publish_note(self, fingerprint: str, device: torch.device, name: str, note: dict) -> bool:
        """A small JSON record kept beside the entry (a verdict), under the same identity."""
        return self._put_sealed(f"{artifact_key(fingerprint, device)}-{name}", artifact_identity(device),
                                json.dumps(note).encode())

    def fetch_note(self, fingerprint: str, device: torch.device, name: str) -> dict | None:
        """The record ``publish_note`` kept, or None (absent, refused or unreadable: one warning)."""
        try:
            payload = self._get_sealed(f"{artifact_key(fingerprint, device)}-{name}",
                                       artifact_identity(device), 1 << 20)
            return None if payload is None else json.loads(payload)
        except Exception as exc:  # noqa: BLE001 - a store problem must never break the run
            log.warn_once(f"fleet-note:{type(exc).__name__}", "shared %s for %s not used (%s: %s)",
                          name, fingerprint[:12], type(exc).__name__, exc)
            return None


def _publish_failed(exc: Exception) -> None:
    log.warn_once(f"fleet-publish:{type(exc).__name__}",
                  "could not publish to the shared cache (%s: %s)", type(exc).__name__, exc)


@functools.lru_cache(maxsize=4)
def _fleet_for(_spec: str, _secret: bytes | None = None) -> Fleet | None:
    return Fleet._build()
