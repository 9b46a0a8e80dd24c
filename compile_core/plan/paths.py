"""Cache directories named by a workflow must stay inside the roots the server allows.

A workflow may name a folder only under the pack's own folder in ComfyUI's user directory
(``<user dir>/torch_compile_speed/``) or under a root the server operator allowed through
``TORCH_COMPILE_SPEED_ALLOWED_ROOTS``. ComfyUI's ``temp/``, ``input/`` and ``output/`` are
never allowed by default: anyone who can reach the server writes there (``/upload/image``),
and Triton loads any ``.so`` it finds under its cache key, so a cache folder there would let
an upload plus a workflow load native code.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

# The server operator may allow more roots (os.pathsep-separated list of directories).
EXTRA_ROOTS_ENV = "TORCH_COMPILE_SPEED_ALLOWED_ROOTS"
OPERATOR_ROOTS_ENV = EXTRA_ROOTS_ENV
# The pack's own folder in ComfyUI's user directory: the only default root for workflow paths.
PACK_DIR_NAME = "torch_compile_speed"
DEFAULT_SUBDIR = "triton"


class UnsafePathError(ValueError):
    """A cache path from a workflow points outside the allowed roots."""


def operator_roots() -> list[Path]:
    """The roots the operator allowed via ``TORCH_COMPILE_SPEED_ALLOWED_ROOTS`` (resolved)."""
    raw = os.environ.get(EXTRA_ROOTS_ENV, "").split(os.pathsep)
    return [Path(r.strip()).expanduser().resolve() for r in raw if r.strip()]


def allowed_roots(*roots: str | os.PathLike) -> list[Path]:
    """``roots`` plus the operator's roots, resolved (symlinks followed)."""
    return [*(Path(r).resolve() for r in roots), *operator_roots()]


def pack_root(user_dir: str | os.PathLike) -> Path:
    """``<user dir>/torch_compile_speed``: the folder this pack owns."""
    return Path(user_dir) / PACK_DIR_NAME


def workflow_roots(user_dir: str | os.PathLike) -> list[Path]:
    """Where a path from a workflow may point: the pack's folder and the operator's roots."""
    return allowed_roots(pack_root(user_dir))


def resolve_cache_dir(value: str, base: str | os.PathLike, roots: Iterable[Path],
                      key: str = "ptx_cache_dir", default: str = DEFAULT_SUBDIR) -> Path:
    """A relative ``value`` lives under ``base`` (empty: ``base/default``); the resolved path
    (symlinks followed) must be inside one of ``roots``. ``..`` and absolute paths are allowed
    only if they stay inside."""
    value = (value or "").strip()
    roots = list(roots)
    shown = ", ".join(str(r) for r in roots) or "none"
    try:
        raw = Path(value).expanduser() if value else Path(default)
        candidate = raw if raw.is_absolute() else Path(base) / raw
        resolved = candidate.resolve()
    except (ValueError, OSError, RuntimeError) as exc:  # NUL byte, symlink loop, bad ~user
        raise UnsafePathError(f"{key} {value!r} cannot be used as a cache folder ({exc}); "
                              f"allowed cache roots: {shown}") from exc
    if not any(resolved == r or r in resolved.parents for r in roots):
        raise UnsafePathError(
            f"{key} {value!r} resolves to {resolved}, outside the allowed cache roots ({shown}). "
            f"Use a relative path (it lives under {Path(base)}); ComfyUI's temp, input and output "
            f"folders are never allowed, since uploads write there. The server operator can "
            f"allow more roots via {EXTRA_ROOTS_ENV}.")
    return resolved


def resolve_workflow_cache_dir(value: str, user_dir: str | os.PathLike,
                               key: str = "ptx_cache_dir") -> Path:
    """The cache folder a workflow named: relative paths live under ``<user dir>/torch_compile_speed``,
    and the result must be inside that folder or an operator root."""
    return resolve_cache_dir(value, pack_root(user_dir).resolve(), workflow_roots(user_dir), key=key)
