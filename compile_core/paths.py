"""Cache directories named by a workflow must stay inside the roots the server allows."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

# A server operator may allow one more root (os.pathsep-separated list).
EXTRA_ROOTS_ENV = "TORCH_COMPILE_SPEED_ALLOWED_ROOTS"


class UnsafePathError(ValueError):
    """A cache path from a workflow points outside the allowed roots."""


def allowed_roots(*roots: str | os.PathLike) -> list[Path]:
    extra = [r for r in os.environ.get(EXTRA_ROOTS_ENV, "").split(os.pathsep) if r]
    return [Path(r).resolve() for r in [*roots, *extra]]


def resolve_cache_dir(value: str, base: str | os.PathLike, roots: Iterable[Path],
                      key: str = "ptx_cache_dir") -> Path:
    """A relative ``value`` lives under ``base``; the resolved path (symlinks followed) must be
    inside one of ``roots``. ``..`` and absolute paths are allowed only if they stay inside."""
    value = (value or "").strip()
    raw = Path(value).expanduser() if value else Path("torch_compile_speed") / "triton"
    candidate = raw if raw.is_absolute() else Path(base) / raw
    resolved = candidate.resolve()
    roots = list(roots)
    if not any(resolved == r or r in resolved.parents for r in roots):
        shown = ", ".join(str(r) for r in roots)
        raise UnsafePathError(
            f"{key} {value!r} resolves to {resolved}, outside the allowed cache roots ({shown}). "
            f"Use a relative path, or ask the server operator to add a root via {EXTRA_ROOTS_ENV}.")
    return resolved
