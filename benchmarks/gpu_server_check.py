"""A ComfyUI 0.33 server on the GPU, with dynamic VRAM (its default on NVIDIA: the pack reloads the
compiled clone without it), with dynamic VRAM fetched in the graph
(``TORCH_COMPILE_SPEED_DYNAMIC_VRAM_FETCH=1``) and with ``--disable-dynamic-vram``, each running the same tiny WAN text-to-video prompt three ways:
eager, core's ``TorchCompileModel``, and Apply Torch Compile with the settings node's defaults as a
user meets them: the first prompt runs eagerly while the background compile runs, the pack's
"finished" line is waited for, and the next prompt runs the compiled graphs.

For each memory path it records whether each prompt completed (and the error where not), the
seconds each took (``defaults_first_s`` for the node's first, eager prompt), whether the pack
compiled (its log says so, and no eager fallback line), and the relative L2 distance of the
compiled latents to eager's. The servers run side by side.

    python benchmarks/gpu_server_check.py --out results.json [--device cpu]

``--device cpu`` runs the same prompts on ``--cpu`` servers (no dynamic VRAM there), to check
the script itself on a machine without a GPU.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "tests" / "host"))
from harness import (BACKGROUND_DONE, BACKGROUND_QUEUED, NODE_DEFAULTS, ComfyHost, PromptError,  # noqa: E402
                     fallback_lines, make_tiny_wan, pack_lines, rel_l2, wan_t2v_prompt)

# memory path -> (ComfyUI's arguments, the server's environment)
MEMORY_PATHS = {"dynamic_vram": ([], {}),
                "dynamic_vram_fetch": ([], {"TORCH_COMPILE_SPEED_DYNAMIC_VRAM_FETCH": "1"}),
                "no_dynamic_vram": (["--disable-dynamic-vram"], {})}
DYNAMIC_VRAM_ON = "DynamicVRAM support detected and enabled"  # ComfyUI's start-up line
COMPILED = "compiled WanAttentionBlock"


def core_prompt(model_name: str) -> dict:
    """The eager prompt with core's TorchCompileModel between the loader and the sampler."""
    p = wan_t2v_prompt(model_name, apply=False, prefix="core")
    p["core"] = {"class_type": "TorchCompileModel", "inputs": {"model": ["loader", 0], "backend": "inductor"}}
    p["sampler"]["inputs"]["model"] = ["core", 0]
    p["probe"]["inputs"]["model"] = ["core", 0]
    return p


# an installed file's path up to its package or ComfyUI folder (no machine's folders in results)
_INSTALL_PREFIX = re.compile(r"/[^\s\"']*/(?:site-packages|dist-packages|comfyui-[0-9.]+|ComfyUI|torchinductor_[^/\s]*)/")


def error_text(exc) -> str:
    """The exception ComfyUI reported for a failed prompt (type, message, last frames), with
    paths relative to their package or ComfyUI folder."""
    try:
        err = ComfyHost.execution_error(exc)
    except (AssertionError, ValueError, IndexError):
        return _INSTALL_PREFIX.sub("", str(exc)[-1500:])
    frames = "".join(err.get("traceback") or [])[-1200:]
    return _INSTALL_PREFIX.sub("", f"{err.get('exception_type')}: {err.get('exception_message', '').strip()}\n{frames}")


def timed_run(host: ComfyHost, prompt: dict, timeout: float) -> dict:
    start = time.perf_counter()
    try:
        hist = host.run(prompt, timeout=timeout)
    except (PromptError, TimeoutError) as exc:
        return {"ok": False, "seconds": round(time.perf_counter() - start, 2), "error": error_text(exc)}
    return {"ok": True, "seconds": round(time.perf_counter() - start, 2), "history": hist}


def defaults_runs(host: ComfyHost, name: str, timeout: float) -> tuple[dict, dict]:
    """``(first, compiled)``: the node's defaults' first prompt and, once its background compile
    has finished, the next one (the same run when nothing was compiled in the background)."""
    offset = host.log_offset()
    first = timed_run(host, wan_t2v_prompt(name, compile_settings=NODE_DEFAULTS, prefix="defaults"), timeout)
    if not first["ok"] or not any(pack_lines(host.log_text(since=offset), n) for n in BACKGROUND_QUEUED):
        return first, first
    try:
        host.wait_for_pack_line(BACKGROUND_DONE, since=offset, timeout=timeout)
    except TimeoutError as exc:
        return first, {"ok": False, "seconds": timeout, "error": str(exc)[-1500:]}
    return first, timed_run(host, wan_t2v_prompt(name, compile_settings=NODE_DEFAULTS, prefix="defaults"), timeout)


def check_path(base: Path, model: Path, extra_args: list, env: dict, cpu: bool, timeout: float) -> dict:
    """One server: eager, core, the node's defaults."""
    out: dict = {}
    with ComfyHost(base, cpu=cpu, extra_args=extra_args, env=env or None) as host:
        name = host.add_model(model)
        out["dynamic_vram_enabled"] = DYNAMIC_VRAM_ON in host.log_text()
        eager = timed_run(host, wan_t2v_prompt(name, apply=False, prefix="eager"), timeout)
        core = timed_run(host, core_prompt(name), timeout)
        offset = host.log_offset()
        first, defaults = defaults_runs(host, name, timeout)
        out["defaults_first_ok"], out["defaults_first_s"] = first["ok"], first["seconds"]
        if not first["ok"]:
            out["defaults_first_error"] = first["error"]
        log = host.log_text(since=offset)
        reference = host.latent(eager["history"]) if eager["ok"] else None
        for name, run in (("eager", eager), ("core", core), ("defaults", defaults)):
            out[f"{name}_ok"] = run["ok"]
            out[f"{name}_s"] = run["seconds"]
            if run["ok"]:  # the server's memory after the prompt (peak VRAM during it)
                out[f"{name}_memory"] = host.probe(run["history"]).get("memory")
            if not run["ok"]:
                out[f"{name}_error"] = run["error"]
            elif reference is not None and name != "eager":
                out[f"{name}_rel_l2"] = rel_l2(host.latent(run["history"]), reference)
        took = re.search(r"background compile of .*? finished in ([0-9.]+) s", log)
        out["defaults_compile_s"] = float(took.group(1)) if took else None
        out["defaults_compiled"] = bool(defaults["ok"] and pack_lines(log, COMPILED) and not fallback_lines(log))
        print(f"[{base.name}] the pack's lines during the defaults prompt:", *pack_lines(log)[:20], sep="\n")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per prompt")
    args = ap.parse_args()
    cpu = args.device == "cpu"
    base = Path(tempfile.mkdtemp(prefix="tcs_gpu_server_"))
    model = make_tiny_wan()
    results: dict = {}

    def run(name, how):
        try:
            results[name] = check_path(base / name, model, *how, cpu, args.timeout)
        except Exception as exc:  # noqa: BLE001 - a server that did not start is a result too
            results[name] = {"error": f"{type(exc).__name__}: {exc}"[-3000:]}
        Path(args.out).write_text(json.dumps(results, indent=1))

    threads = [threading.Thread(target=run, args=item) for item in MEMORY_PATHS.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
