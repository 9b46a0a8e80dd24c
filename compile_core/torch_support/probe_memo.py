"""The feature probes' answers, kept on disk per torch build, so that a restarted server skips
the probes (tiny compiles, about 2 s on a 2-core CPU) at its first Apply Torch Compile.

An answer is bound to what could change it: torch's version and git revision, Python's
version, the platform, and the source of every probe (this package's files). Anything else
on disk is ignored, so a new torch, a new Python or an edited probe probes again. The file is
a cache: a damaged or unwritable one costs one line and the probes run as without it. Only
"yes" answers are kept: a "no" may come from a passing problem (a full disk under a probe's
save and load), and a feature must not stay off for good because of one.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import sys
import threading
from pathlib import Path
from typing import Callable

import torch

from ..report import log

FILE = "torch_features.json"
_root: list[Path | None] = [None]
_answers: dict | None = None
_lock = threading.Lock()


@functools.lru_cache(maxsize=None)
def build_key() -> str:
    """What the answers depend on, hashed."""
    h = hashlib.sha256()
    for part in (torch.__version__, getattr(torch.version, "git_version", ""), sys.version,
                 sys.platform, platform.machine()):
        h.update(str(part).encode() + b"\0")
    for path in sorted(Path(__file__).parent.glob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:32]


def use(root: Path | None) -> None:
    """Keep the answers in ``root`` (the persistent cache's folder) from now on; the first
    folder given wins for the process."""
    global _answers
    with _lock:
        if root is not None and _root[0] is None:
            _root[0], _answers = Path(root), None


def remembered(probe: Callable[[], bool]) -> Callable[[], bool]:
    """``probe`` (a feature probe answering True or False), answered from disk where this
    build's "yes" is there, else run once (a "yes" is kept)."""
    name = f"{probe.__module__.rsplit('.', 1)[-1]}.{probe.__name__}"

    @functools.lru_cache(maxsize=None)
    def answer() -> bool:
        if _load().get(name) is True:
            return True
        value = probe()
        if value is True:
            _store(name, value)
        return value
    answer.__name__, answer.__doc__, answer.probe = probe.__name__, probe.__doc__, probe
    return answer


def _path() -> Path | None:
    return None if _root[0] is None else _root[0] / FILE


def _load() -> dict:
    global _answers
    with _lock:
        if _answers is None:
            _answers = _read(_path())
        return dict(_answers)


def _read(path: Path | None) -> dict:
    if path is None or not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        log.info_once("probe-memo-read", "the kept torch feature answers in %s could not be read "
                      "(%s); the probes run again", path, type(exc).__name__)
        return {}
    answers = data.get(build_key()) if isinstance(data, dict) else None
    return {k: v for k, v in answers.items() if isinstance(v, bool)} if isinstance(answers, dict) else {}


def _store(name: str, value: bool) -> None:
    with _lock:
        path = _path()
        if path is None:
            return
        if _answers is not None:
            _answers[name] = value
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({build_key(): dict(_answers or {name: value})}), encoding="utf-8")
            os.replace(tmp, path)
        except OSError as exc:
            log.info_once("probe-memo-write", "the torch feature answers could not be kept in %s "
                          "(%s); a restart probes again", path, type(exc).__name__)
