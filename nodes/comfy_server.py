"""ComfyUI's server (``PromptServer``): the node badge's status messages, whether the server
is idle.

``server`` is imported where it is used, so importing this module needs no server: the
benchmarks import the compiled-call path with ComfyUI's packages alone.
"""
from __future__ import annotations

from ..compile_core.report import log

STATUS_EVENT = "torch_compile_speed.status"  # web/js listens for it (the node badge)


def server_idle() -> bool:
    """No prompt running or queued on this ComfyUI server (a CPU model's background compile runs
    then, see ``compile_core.run.background``); True outside a server."""
    from server import PromptServer
    instance = getattr(PromptServer, "instance", None)
    return instance is None or instance.prompt_queue.get_tasks_remaining() == 0


def send_status(payload: dict) -> None:
    """Tell the frontend (all clients) what compile did; never fails the run."""
    try:
        from server import PromptServer
        PromptServer.instance.send_sync(STATUS_EVENT, payload)
    except Exception as exc:  # noqa: BLE001 - a UI message must not break sampling
        log.warn_once("status-send", "could not send the status to the UI: %s", exc)


def send_if_any(payload: dict | None) -> None:
    """``send_status`` for a payload that may be None (nothing to tell)."""
    if payload is not None:
        send_status(payload)
