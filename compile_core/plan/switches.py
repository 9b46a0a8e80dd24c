"""On/off switches an operator sets in the server's environment (``1``/``0``, ``on``/``off``,
``true``/``false``, ``yes``/``no``, any case). Unset or empty: the switch's default. Any other
value: the default too, with one warning that names the variable."""
from __future__ import annotations

import os

from ..report import log

ON = ("1", "on", "true", "yes")
OFF = ("0", "off", "false", "no")


def switch(name: str, default: bool) -> bool:
    raw = os.environ.get(name, "")
    value = raw.strip().lower()
    if not value:
        return default
    if value in ON or value in OFF:
        return value in ON
    log.warn_once(f"env-switch:{name}={value}", "%s=%r is not 1 or 0 (on/off, true/false, yes/no): it stays %s",
                  name, raw, "on" if default else "off")
    return default
