"""A small JSON-able summary of what compile did for one Apply node (for logs and the UI badge)."""
from __future__ import annotations

MEASURED_KEYS = ("speedup", "eager_ms", "compiled_ms")


def remember_measurement(entry, fields: dict) -> None:
    """Keep the latest eager/compiled measurement (Torch Compile Diagnostics) with the compiled
    entry, so every later status of it (e.g. after a sampling run) still shows the speedup."""
    entry.measurement = {k: fields.get(k) for k in MEASURED_KEYS}


def status_payload(compiled, node_id: str | None = None) -> dict:
    """``state`` is one of: ``eager-fallback`` (compile failed), ``eager-slower`` (compiled
    steps measured not faster than eager on this card: ``verdict``), ``background-after-run`` (a CPU
    model runs eagerly; its compile waits for the server to be idle),
    ``compiling-background`` (the model runs eagerly while a worker thread compiles it),
    ``reused`` (compiled work found
    in this server), ``warm`` (compiled here from the persistent cache), ``cold`` (compiled from
    scratch), ``pending`` (not run yet)."""
    e = compiled.entry
    if e.failed:
        state = "eager-fallback"
    elif getattr(e, "slower", ""):
        state = "eager-slower"
    elif getattr(compiled, "compile_held", False):
        state = "background-after-run"
    elif getattr(compiled, "compiling_in_background", False):
        state = "compiling-background"
    elif compiled.reused:
        state = "reused"
    elif e.runs and e.cache_hits and not e.cache_misses:
        state = "warm"
    elif e.runs:
        state = "cold"
    else:
        state = "pending"
    return {
        "node": node_id,
        "state": state,
        "regions": compiled.description,
        "region_count": len(compiled.plan.paths),
        "regional": compiled.plan.regional,
        "backend": compiled.settings.backend,
        "mode": compiled.settings.mode,
        "graphs": e.graphs,
        "recompiles": max(0, e.graphs - e.first_run_graphs),
        "compile_seconds": round(e.compile_seconds, 3),
        "runs": e.runs,
        "fallback_reason": e.failed or getattr(e, "slower", ""),
        "fingerprint": e.fingerprint[:12],
        "cache": ("hit" if e.cache_hits and not e.cache_misses else
                  "miss" if e.cache_misses else "none"),
        "shared_cache": "hit" if e.fleet_hit else ("miss" if e.fleet_checked else "off"),
        "background": getattr(compiled.settings, "background_compile", False),
        "swapped_at": getattr(compiled, "swapped_at", None),  # model call a background compile began
        "memory": getattr(compiled, "memory_path", None),  # the dynamic VRAM path, where the model had it
        **e.measurement,
    }
