"""What one shared compile-cache entry is: the identity a compiled artifact is valid for (torch,
Triton, CUDA, Python, GPU or CPU and C++ compiler), the archive of an inductor cache directory
(every member checked before anything is unpacked), and the sealed and optionally signed
bytes stored for it (``fleet`` describes the safety and authenticity rules).
"""
from __future__ import annotations

import functools
import hashlib
import hmac
import io
import json
import os
import platform
import tarfile
import time
from pathlib import Path, PurePosixPath

import torch

from ..torch_support import inductor_names, longpaths
from ..plan.preflight import compiler_banner

KEY_ENV = "TORCH_COMPILE_SPEED_SHARED_KEY"  # operator secret: sign and verify entries (HMAC)
MAGIC = b"TCSFLEET1\n"
SIGNED_MAGIC = b"TCSFLEET1-HMAC-SHA256\n"  # then the hex HMAC, a newline, and a sealed entry
TMP_SUFFIX = ".fleet-tmp"  # an unpacked file is written beside its target, then renamed


class FleetError(RuntimeError):
    """A shared entry is missing, incompatible, corrupt or unsafe."""


class FleetAuthError(FleetError):
    """A shared entry is not signed with this worker's TORCH_COMPILE_SPEED_SHARED_KEY."""


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
        version = compiler_banner(inductor_names.cpp_compiler()) or "no-cxx"
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


