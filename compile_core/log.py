"""The pack's logger: every line carries the ``[TorchCompileSpeed]`` prefix."""
from __future__ import annotations

import logging
import threading

PREFIX = "[TorchCompileSpeed]"
logger = logging.getLogger("TorchCompileSpeed")

_said: set[str] = set()
_said_lock = threading.Lock()


def info(msg: str, *args) -> None:
    logger.info(f"{PREFIX} {msg}", *args)


def warning(msg: str, *args) -> None:
    logger.warning(f"{PREFIX} {msg}", *args)


def _first_time(key: str) -> bool:
    with _said_lock:
        if key in _said:
            return False
        _said.add(key)
        return True


def warn_once(key: str, msg: str, *args) -> bool:
    """Log ``msg`` as a warning the first time ``key`` is seen in this process."""
    if _first_time(key):
        warning(msg, *args)
        return True
    return False


def info_once(key: str, msg: str, *args) -> bool:
    if _first_time(key):
        info(msg, *args)
        return True
    return False
