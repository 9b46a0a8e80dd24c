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
set (the same secret on every worker), each published entry and the prewarm manifest is signed
with HMAC-SHA256 over its sealed bytes, and a worker loads only entries whose HMAC verifies with
its key (constant-time compare); anything else is refused with one warning and compiled locally.
Without the key, entries are trusted unsigned (the store itself must then be trusted), which a
worker says once; ``TORCH_COMPILE_SPEED_SHARED_REQUIRE_SIGNED=1`` makes a worker without the key
not use the store at all. The store's URL is never logged with its user or password.
"""
from __future__ import annotations

import functools
import hashlib
import hmac
import io
import math
import json
import os
import platform
import tarfile
import time
from pathlib import Path, PurePosixPath

import torch

from ..report import log
from ..torch_support import longpaths
from ..plan import switches
from .persist import write_atomic
from ..plan.preflight import compiler_banner

STORE_ENV = "TORCH_COMPILE_SPEED_SHARED_CACHE"
MAX_MB_ENV = "TORCH_COMPILE_SPEED_SHARED_MAX_MB"
TTL_ENV = "TORCH_COMPILE_SPEED_SHARED_TTL_S"
TIMEOUT_ENV = "TORCH_COMPILE_SPEED_SHARED_TIMEOUT_S"
KEY_ENV = "TORCH_COMPILE_SPEED_SHARED_KEY"  # operator secret: sign and verify entries (HMAC)
REQUIRE_SIGNED_ENV = "TORCH_COMPILE_SPEED_SHARED_REQUIRE_SIGNED"  # operator: no key, no store
DEFAULT_MAX_MB, DEFAULT_TIMEOUT_S, DEFAULT_TTL_S = 2048.0, 3.0, 7 * 24 * 3600
MAGIC = b"TCSFLEET1\n"
SIGNED_MAGIC = b"TCSFLEET1-HMAC-SHA256\n"  # then the hex HMAC, a newline, and a sealed entry
KEY_PREFIX = "tcs:compile:"
MANIFEST_MAX_BYTES = 1 << 20  # the shared prewarm manifest (a list of module and file names)
PREFETCH_MAX = 4  # entries a new worker fetches at start-up
TMP_SUFFIX = ".fleet-tmp"  # an unpacked file is written beside its target, then renamed


class FleetError(RuntimeError):
    """A shared entry is missing, incompatible, corrupt or unsafe."""


class FleetAuthError(FleetError):
    """A shared entry is not signed with this worker's TORCH_COMPILE_SPEED_SHARED_KEY."""


def _env_number(name: str, default: float, cast=float):
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


def key_from_env() -> bytes | None:
    """The operator's shared key (``TORCH_COMPILE_SPEED_SHARED_KEY``), or None when unset/empty."""
    raw = os.environ.get(KEY_ENV, "").strip()
    return raw.encode() if raw else None


# --------------------------------------------------------------------------- artifact identity

@functools.lru_cache(maxsize=None)
def _cpu_identity() -> str:
    """CPU flags, C++ compiler version and -march: what a CPU-built kernel depends on."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line.split(":", 1)[1].strip()
                break
    except OSError:
        flags = platform.processor()
    try:
        from torch._inductor import cpp_builder
        version = compiler_banner(cpp_builder.get_cpp_compiler()) or "no-cxx"
    except Exception:  # noqa: BLE001 - no compiler: the key still differs from one that has it
        version = "no-cxx"
    march = os.environ.get("TORCHINDUCTOR_CPP_MARCH", "native")
    return "cpu:" + hashlib.sha256(f"{flags}|{version}|{march}".encode()).hexdigest()[:16]


def _triton_version() -> str:
    """The installed Triton's version, whichever distribution ships it (PyPI's ``triton``, or
    ``triton-windows`` on Windows, ``pytorch-triton`` / ``pytorch-triton-rocm`` next to nightly and ROCm builds)."""
    from importlib.metadata import PackageNotFoundError, version
    for dist in ("triton", "triton-windows", "pytorch-triton", "pytorch-triton-rocm"):
        try:
            return f"{dist}=={version(dist)}"
        except PackageNotFoundError:
            continue
    return "none"


def artifact_identity(device: torch.device) -> dict[str, str]:
    """Everything besides the fingerprint that makes a compiled artifact valid on a worker."""
    ident = {"torch": torch.__version__, "triton": _triton_version(),
             "cuda": str(torch.version.cuda), "python": platform.python_version()}
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        ident["target"] = f"sm_{major}{minor}"
    else:
        ident["target"] = _cpu_identity()
    return ident


def artifact_key(fingerprint: str, device: torch.device) -> str:
    ident = json.dumps(artifact_identity(device), sort_keys=True)
    return hashlib.sha256(f"{fingerprint}|{ident}".encode()).hexdigest()[:32]


# --------------------------------------------------------------------------- archives

def pack_dir(src: Path) -> bytes:
    """A gzip tar of the regular files under ``src`` with relative names (links are skipped)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=3) as tar:
        for path in sorted(src.rglob("*")):
            if path.is_file() and not path.is_symlink() and not path.name.endswith((".lock", ".tmp")):
                tar.add(path, arcname=path.relative_to(src).as_posix(), recursive=False)
    return buf.getvalue()


def unpack_into(data: bytes, dest: Path) -> int:
    """Extract ``data`` under ``dest`` after checking every member; returns the file count."""
    dest = dest.resolve()
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        members = tar.getmembers()
        for m in members:
            name = PurePosixPath(m.name)
            if name.is_absolute() or ".." in name.parts or m.name.startswith(("/", "\\")):
                raise FleetError(f"unsafe archive member {m.name!r} (absolute or '..')")
            if not (m.isfile() or m.isdir()):
                raise FleetError(f"unsafe archive member {m.name!r} (link or special file)")
            if not (dest / m.name).resolve().is_relative_to(dest):
                raise FleetError(f"archive member {m.name!r} escapes {dest}")
            _check_length(dest / m.name)
        dest.mkdir(parents=True, exist_ok=True)
        for m in members:
            target = dest / m.name
            if m.isdir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            src = tar.extractfile(m)
            tmp = target.with_name(target.name + TMP_SUFFIX)
            with open(tmp, "wb") as out:
                out.write(src.read())
            os.chmod(tmp, 0o644 | (0o111 if m.mode & 0o111 else 0))
            os.replace(tmp, target)
    return sum(1 for m in members if m.isfile())


def _check_length(target: Path) -> None:
    """Windows without long paths cannot write a member this deep (nor its temp file)."""
    length = len(str(target)) + len(TMP_SUFFIX)
    if not longpaths.fits(length):
        raise FleetError(f"archive member {target} would be a {length}-character path here, "
                         f"past Windows' {longpaths.MAX_PATH}-character limit (long paths are "
                         "not enabled)")


def seal(key: str, identity: dict, payload: bytes) -> bytes:
    header = {"key": key, "identity": identity, "sha256": hashlib.sha256(payload).hexdigest(),
              "size": len(payload), "created": time.time(), "format": "inductor-dir.tar.gz"}
    return MAGIC + json.dumps(header).encode() + b"\n" + payload


def sign(blob: bytes, secret: bytes) -> bytes:
    """A sealed ``blob`` wrapped with its HMAC-SHA256 under ``secret``."""
    mac = hmac.new(secret, blob, hashlib.sha256).hexdigest().encode()
    return SIGNED_MAGIC + mac + b"\n" + blob


def verify(blob: bytes, secret: bytes | None) -> bytes:
    """The sealed entry inside ``blob``. With a ``secret`` the entry must be signed with it
    (FleetAuthError otherwise); without one, a signature is dropped unchecked and an unsigned
    entry is returned as it is (the behaviour before keys existed)."""
    if not blob.startswith(SIGNED_MAGIC):
        if secret is not None:
            raise FleetAuthError(f"entry is not signed; this worker has {KEY_ENV} set and loads "
                                 "only entries signed with it")
        return blob
    mac, sep, inner = blob[len(SIGNED_MAGIC):].partition(b"\n")
    if not sep:
        raise FleetError("unreadable entry signature")
    if secret is not None:
        expected = hmac.new(secret, inner, hashlib.sha256).hexdigest().encode()
        if not hmac.compare_digest(mac, expected):
            raise FleetAuthError(f"entry signature does not verify with this worker's {KEY_ENV} "
                                 "(another key, or written by someone without it)")
    return inner


def unseal(blob: bytes, key: str, identity: dict) -> bytes:
    if not blob.startswith(MAGIC):
        raise FleetError("not a TorchCompileSpeed fleet entry")
    try:
        head, payload = blob[len(MAGIC):].split(b"\n", 1)
        header = json.loads(head)
    except ValueError as exc:
        raise FleetError(f"unreadable entry header ({exc})") from exc
    if header.get("key") != key or header.get("identity") != identity:
        raise FleetError("entry was built for another torch/compiler/device (incompatible key)")
    if len(payload) != header.get("size") or hashlib.sha256(payload).hexdigest() != header.get("sha256"):
        raise FleetError("entry content does not match its SHA-256 (corrupt or truncated)")
    return payload


# --------------------------------------------------------------------------- stores

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
        return RedisStore(spec, _env_number(TIMEOUT_ENV, DEFAULT_TIMEOUT_S),
                          _env_number(TTL_ENV, DEFAULT_TTL_S, cast=lambda v: max(1, int(v))))
    return DirStore(spec)


# --------------------------------------------------------------------------- fetch / publish

_FROM_ENV = object()


class Fleet:
    def __init__(self, store, max_bytes: int | None = None, secret: bytes | str | None = _FROM_ENV):
        self.store = store
        self.max_bytes = max_bytes or int(_env_number(MAX_MB_ENV, DEFAULT_MAX_MB) * 1024 ** 2)
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

    # -- the prewarm manifest (compile_core.cache.prewarm): which compiler modules and source files a
    # worker's compile needed, so a new worker warms them at start-up, before any fingerprint
    def publish_manifest(self, manifest: dict) -> bool:
        shared = {k: v for k, v in manifest.items() if k != "isa_dir"}  # a local path
        return self._put_sealed(*_manifest_key(), json.dumps(shared).encode())

    def fetch_manifest(self) -> dict | None:
        try:
            payload = self._get_sealed(*_manifest_key(), MANIFEST_MAX_BYTES)
            data = None if payload is None else json.loads(payload)
        except FleetAuthError as exc:  # a hostile or misconfigured writer: say so, once
            log.warn_once("fleet-fetch:FleetAuthError", "shared prewarm manifest not used (%s)", exc)
            return None
        except Exception as exc:  # noqa: BLE001 - only an optimisation; a store that is down
            # gets its one warning from the first compile's fetch
            log.info_once(f"fleet-manifest:{type(exc).__name__}",
                          "shared prewarm manifest unavailable (%s: %s)", type(exc).__name__, exc)
            return None
        return data if isinstance(data, dict) else None

    def prefetch(self, fingerprints: list[str], device: torch.device, local) -> list[Path]:
        """A new worker, at start-up: fetch the entries other workers compiled most recently
        into the local persistent cache (``local``), so its first compile finds them there.
        Returns the inductor dirs filled."""
        filled = []
        for fp in fingerprints[:PREFETCH_MAX]:
            if local.is_complete(fp):
                continue
            if self.fetch_into(fp, device, local.inductor_dir(fp)):
                local.mark_complete(fp, {"regions": "fetched from the shared cache at start-up"})
                filled.append(local.inductor_dir(fp))
        return filled


def _manifest_key() -> tuple[str, dict]:
    ident = {"torch": torch.__version__, "python": platform.python_version(), "kind": "prewarm"}
    return "prewarm-" + hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:24], ident


def _publish_failed(exc: Exception) -> None:
    log.warn_once(f"fleet-publish:{type(exc).__name__}",
                  "could not publish to the shared cache (%s: %s)", type(exc).__name__, exc)


@functools.lru_cache(maxsize=4)
def _fleet_for(_spec: str, _secret: bytes | None = None) -> Fleet | None:
    return Fleet._build()
