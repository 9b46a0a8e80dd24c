"""Warm torch's compiler stack in the background once the ComfyUI server has started (see
``compile_core.cache.prewarm``), and hold prompts back while its start-up probes run."""
from __future__ import annotations

import comfy.model_management

from ..compile_core.cache import prewarm
from ..compile_core.cache.fleet import Fleet
from ..compile_core.cache.persist import PersistentCache
from ..compile_core.report import log
from .comfy_paths import user_directory

PROBE_WAIT_S = 20.0  # normally 1-2 s, once, right after start-up
_probe_wait = [PROBE_WAIT_S]  # 0 once a wait timed out: no prompt waits again


def prewarm_when_server_starts() -> bool:
    """Warm torch's compiler stack in the background once the server is up (after every custom
    node has loaded, so no other pack's imports race ours); see compile_core.cache.prewarm."""
    try:
        from server import PromptServer
        app, on_prompt = PromptServer.instance.app, PromptServer.instance.add_on_prompt_handler
    except Exception:  # noqa: BLE001 - not inside a ComfyUI server (tests, tooling), or one
        return False  # without the on-prompt hook: the first compile probes, on the prompt thread

    async def torch_compile_speed_prewarm(_app):
        try:
            _start_prewarm()
        except Exception as exc:  # noqa: BLE001 - an optimisation: ComfyUI must always start
            log.warning("background warm-up not started (%s: %s)", type(exc).__name__, exc)

    on_prompt(after_startup_probes)  # the probes run beside no prompt: see compile_core.cache.prewarm
    app.on_startup.append(torch_compile_speed_prewarm)
    return True


def after_startup_probes(json_data):
    """ComfyUI's on-prompt hook: a prompt posted while the start-up warm-up still probes
    torch's features waits for the probes (they must not run beside compiled code; see
    compile_core.cache.prewarm), so it runs after them; never longer than ``PROBE_WAIT_S``, and
    after one wait that timed out, no prompt waits again (it blocks ComfyUI's event loop)."""
    try:
        wait = _probe_wait[0]
        if wait and not prewarm.probes_done(wait):
            _probe_wait[0] = 0.0
            log.warning("the start-up feature probes still run after %.0f s: prompts no longer "
                        "wait for them", wait)
    except Exception as exc:  # noqa: BLE001 - a prompt must always be taken
        log.warn_once("probes-wait", "could not wait for the start-up probes: %s", exc)
    return json_data


def _start_prewarm() -> None:
    """Replay the prewarm manifest (ours, or a new worker's from the fleet) in the background."""
    cache, fleet = PersistentCache.default(user_directory()), Fleet.from_env()

    def from_fleet():  # a new worker: the fleet's manifest, and its latest entries
        manifest = prewarm.clean(fleet.fetch_manifest())
        if manifest:
            device = comfy.model_management.get_torch_device()
            filled = fleet.prefetch(manifest["fingerprints"], device, cache)
            manifest["isa_dir"] = str(filled[0]) if filled and device.type == "cpu" else None
        return manifest

    prewarm.start(cache.root if cache else None, from_fleet if fleet and cache else None,
                  quiet=lambda: not comfy.model_management.current_loaded_models,
                  device=comfy.model_management.get_torch_device())
