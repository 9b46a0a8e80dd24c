"""The pack's logger: every line carries the ``[TorchCompileSpeed]`` prefix, and no line carries
a URL's user or password (ComfyUI serves its log to every web user at ``/internal/logs``)."""
from __future__ import annotations

import logging
import re
import threading

PREFIX = "[TorchCompileSpeed]"
logger = logging.getLogger("TorchCompileSpeed")

_said: set[str] = set()
_said_lock = threading.Lock()


# scheme://userinfo@ : the userinfo (a password, a token) is replaced
_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)[^/\s]*@")


def redact(text: str) -> str:
    """``text`` with the userinfo of every URL in it replaced by ``***``."""
    return _USERINFO.sub(r"\g<scheme>***@", text)


def _line(msg: str, args: tuple) -> str:
    return redact(f"{PREFIX} {msg % args if args else msg}")


def info(msg: str, *args) -> None:
    if logger.isEnabledFor(logging.INFO):
        logger.info("%s", _line(msg, args))


def warning(msg: str, *args) -> None:
    if logger.isEnabledFor(logging.WARNING):
        logger.warning("%s", _line(msg, args))


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
