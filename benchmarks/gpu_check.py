"""The GPU check: everything the pack must show on an NVIDIA GPU, in one run of about 8 minutes,
each stage under its own time limit so that a stuck stage still leaves the others' results.

1. correctness (side by side): ``tests/gpu/test_gpu_paths.py`` (Triton kernels with the node's
   defaults, the PTX warm-up, a background compile) and ``gpu_server_check.py`` (a ComfyUI 0.33
   server with and without dynamic VRAM: eager, core's TorchCompileModel, the node's defaults);
2. speed: ``gpu_wan_bf16.py`` at the real size (WAN 2.1 1.3B dims, latent 21x60x104): eager,
   core's whole-model compile and the node's defaults (the regional graphs), each cold and after
   a restart on the same caches.

Writes ``gpu_check.json`` and ``.md`` into ``--out-dir`` (default ``benchmarks/results``), after
every stage. Run it with ``bash scripts/gpu_session.sh check`` on a machine with an NVIDIA GPU.

``--device cpu --out-dir DIR`` runs every stage on the CPU at a toy size (the GPU tests that can
run there, CPU servers, two blocks at a tiny latent): a dry run that checks the check itself before
a GPU is at hand. Its figures say nothing about a GPU.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from gpu_wan_bf16 import swap_text

REPO_ROOT = Path(__file__).resolve().parents[1]
BENCH_VARIANTS = "eager,torch-compile-whole,ours-regional,ours-background"
LIMITS = {"correctness": 170, "bench": 290, "bench_process": 140}
CPU_LIMITS = {name: 2 * seconds for name, seconds in LIMITS.items()}  # a dry run: 2 cores do the GPU's work
CPU_DRY_RUN = ["--device", "cpu", "--blocks", "2", "--latent", "1", "8", "8", "--warmup", "1", "--iters", "2"]


def run_stage(name: str, commands: list[list[str]], limit: int, logs: Path, env: dict | None = None) -> dict:
    """Start ``commands`` side by side; kill what still runs after ``limit`` seconds."""
    start = time.monotonic()
    procs = []
    for i, cmd in enumerate(commands):
        log = open(logs / f"{name}_{i}.log", "w")
        procs.append((subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True, env=env), log))
    codes = []
    for proc, log in procs:
        left = max(1.0, limit - (time.monotonic() - start))
        try:
            codes.append(proc.wait(timeout=left))
        except subprocess.TimeoutExpired:
            subprocess.run(["kill", "-9", f"-{proc.pid}"], check=False)
            proc.wait()
            codes.append("timed out")
        log.close()
    print(f"[gpu_check] {name}: {codes} in {time.monotonic() - start:.0f} s", flush=True)
    return {"returncodes": codes, "seconds": round(time.monotonic() - start, 1)}


def test_counts(junit: Path) -> dict:
    if not junit.is_file():
        return {"passed": 0, "failed": 0, "error": "no test report (the stage did not finish)"}
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    total, failed = int(suite.get("tests", 0)), int(suite.get("failures", 0)) + int(suite.get("errors", 0))
    skipped = int(suite.get("skipped", 0))
    failures = [f"{c.get('name')}: {(c.find('failure') if c.find('failure') is not None else c.find('error')).get('message', '')[:300]}"
                for c in suite.iter("testcase") if c.find("failure") is not None or c.find("error") is not None]
    return {"passed": total - failed - skipped, "failed": failed, "skipped": skipped, "failures": failures}


def bench_summary(raw: dict) -> dict:
    """The figures the targets need, from gpu_wan_bf16's result."""
    variants = raw.get("variants", {})

    def row(name):
        r = variants.get(name)
        if r is None:
            return {"error": "not reached"}
        cold, restart = r.get("cold", {}), r.get("restart", {})
        if "error" in cold:
            return {"error": cold["error"][-600:]}
        out = {"cold_s": cold.get("first_call_s"), "restart_s": restart.get("first_call_s"),
               "restart_error": restart.get("error", "")[-600:] or None,
               "steady_ms": (cold.get("steady_ms") or {}).get("median"),
               "peak_vram_gb": cold.get("peak_gb_steady"), "peak_vram_gb_first_call": cold.get("peak_gb_first_call"),
               "rel_l2_vs_eager": r.get("rel_l2_vs_eager")}
        return {k: v for k, v in out.items() if v is not None}

    cfg = raw.get("config", {})
    return {"latent": cfg.get("latent"), "tokens": cfg.get("tokens"), "blocks": cfg.get("blocks"),
            "model": cfg.get("model_desc"), "eager": row("eager"), "core": row("torch-compile-whole"),
            "defaults": row("ours-regional"), "defaults_background": background_row(variants),
            "defaults_restart_lines": variants.get("ours-regional", {}).get("restart", {}).get("pack_lines")}


def background_row(variants: dict) -> dict:
    """The node's defaults with background compile as they are: the first call (eager while the
    worker compiles), when the compiled graphs took over, and the steady step after that."""
    cold = variants.get("ours-background", {}).get("cold")
    if cold is None:
        return {"error": "not reached"}
    if "error" in cold:
        return {"error": cold["error"][-600:]}
    return {"first_call_s": cold.get("first_call_s"), "compiled_from_s": cold.get("compiled_from_s"),
            "swapped_at_call": cold.get("swapped_at_call"), "calls_until_swapped": cold.get("calls_until_swapped"),
            "failed": cold.get("failed") or None,
            "steady_ms": (cold.get("steady_ms") or {}).get("median"), "peak_vram_gb": cold.get("peak_gb_steady"),
            "beside_ms": cold.get("beside_ms")}


def _beside(bg: dict) -> str:
    """The calls beside the compile against the steady compiled step (target: every later
    prompt <= 1.05x the steady compiled one)."""
    beside, steady = bg.get("beside_ms") or {}, bg.get("steady_ms")
    if not beside or not steady:
        return ""
    return (f"; the {beside['n']} calls beside the compile: median {fmt(beside['median'])} ms, slowest "
            f"{fmt(beside['max'])} ms ({fmt(beside['max'] / steady)}x the steady compiled step)")


def environment() -> dict:
    import torch
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": None}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env["device"] = f"{p.name}, {p.total_memory / 1024 ** 3:.0f} GiB, capability {p.major}.{p.minor}"
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    return env


def fmt(v, spec=".2f"):
    return "n/a" if v is None else format(v, spec)


def write_md(res: dict, path: Path) -> None:
    L = ["# GPU check", "",
         f"- {res['date']}; {res.get('device')}; torch {res.get('torch')} (CUDA {res.get('cuda')}), "
         f"Triton {res.get('triton')}", f"- command: `{res['command']}`", ""]
    t = res.get("tests", {})
    L += [f"## tests/gpu/test_gpu_paths.py: {t.get('passed')} passed, {t.get('failed')} failed", ""]
    L += [f"- {f}" for f in t.get("failures", [])] + ([""] if t.get("failures") else [])
    L += ["## ComfyUI 0.33 server, tiny WAN, the node's defaults", "",
          "| memory path | eager | core TorchCompileModel | node defaults: first prompt | background compile s "
          "| next prompt (compiled) | defaults compiled | defaults rel L2 | core rel L2 |",
          "|---|---|---|---|---|---|---|---|---|"]
    for name, s in res.get("server", {}).items():
        if "error" in s and "eager_ok" not in s:
            L.append(f"| {name} | error: {s['error'][-200:]} | | | | | | | |")
            continue

        def ok(k):
            error = (s.get(k + "_error") or "").strip().splitlines()
            return f"ok, {s.get(k + '_s')} s" if s.get(k + "_ok") else f"FAILED: {error[0][:120] if error else ''}"
        L.append(f"| {name} | {ok('eager')} | {ok('core')} | {ok('defaults_first')} | "
                 f"{fmt(s.get('defaults_compile_s'))} | {ok('defaults')} | "
                 f"{s.get('defaults_compiled')} | "
                 f"{fmt(s.get('defaults_rel_l2'), '.1e')} | {fmt(s.get('core_rel_l2'), '.1e')} |")
    L += ["", "Server memory after each prompt (peak VRAM torch allocated during it; device VRAM in use "
          "and the server's resident RAM after it):", "",
          "| memory path | prompt | peak VRAM GB | VRAM in use GB | RAM GB |", "|---|---|---|---|---|"]
    for name, s in res.get("server", {}).items():
        for prompt in ("eager", "core", "defaults"):
            m = s.get(f"{prompt}_memory") or {}
            if m:
                L.append(f"| {name} | {prompt} | {fmt(m.get('cuda_peak_gb'))} | {fmt(m.get('cuda_used_gb'))} | "
                         f"{fmt(m.get('rss_gb'))} |")
    b = res.get("bench", {})
    L += ["", f"## Speed: {b.get('model')}, {b.get('blocks')} blocks, bf16, latent {b.get('latent')} "
          f"({b.get('tokens')} tokens)", "",
          "| variant | cold first call s | first call after restart s | steady ms | steady / core | "
          "peak VRAM GB (steady) | rel L2 vs eager |", "|---|---|---|---|---|---|---|"]
    core_ms = b.get("core", {}).get("steady_ms")
    for name in ("eager", "core", "defaults"):
        r = b.get(name, {})
        if "error" in r:
            L.append(f"| {name} | error: {r['error'].strip().splitlines()[-1][:200] if r['error'].strip() else ''} | | | | | |")
            continue
        ratio = r["steady_ms"] / core_ms if r.get("steady_ms") and core_ms else None
        L.append(f"| {name} | {fmt(r.get('cold_s'))} | {fmt(r.get('restart_s'))} | {fmt(r.get('steady_ms'))} | "
                 f"{fmt(ratio, '.3f')} | {fmt(r.get('peak_vram_gb'))} | {fmt(r.get('rel_l2_vs_eager'), '.1e')} |")
    L += ["", "core = `torch.compile(model)` as ComfyUI's TorchCompileModel (mode default); defaults = the "
          "settings node's defaults through the pack's engine (the regional graphs), the compile timed in "
          "the first call. Stage timings in `stages`."]
    bg = b.get("defaults_background") or {}
    if "error" in bg:
        L += ["", f"Background compile (the node's defaults as they are): error: {bg['error'][-200:]}"]
    elif bg:
        L += ["", f"Background compile (the node's defaults as they are): first call {fmt(bg.get('first_call_s'))} s "
              f"(eager while the worker compiles), compiled graphs {swap_text(bg)}; steady "
              f"{fmt(bg.get('steady_ms'))} ms" + _beside(bg) + (f"; failed: {bg['failed']}" if bg.get("failed") else "")]
    if b.get("defaults_restart_lines"):
        L += ["", "The defaults' first call after a restart, the pack's lines (seconds from the call's start):", ""]
        L += [f"    {line}" for line in b["defaults_restart_lines"]]
    path.write_text("\n".join(L) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default=None, help="where the results go (default benchmarks/results)")
    ap.add_argument("--small", action="store_true", help="the benchmark at latent 9x30x52 (a quick look)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: a dry run of the check at a toy size (needs --out-dir)")
    args = ap.parse_args()
    cpu = args.device == "cpu"
    if cpu and args.out_dir is None:
        ap.error("--device cpu needs --out-dir: a dry run's figures must not replace the GPU results")
    out_dir = Path(args.out_dir or REPO_ROOT / "benchmarks" / "results")
    limits = CPU_LIMITS if cpu else LIMITS
    logs = out_dir / "gpu_check_logs"
    logs.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    res = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
           "command": ("bash scripts/gpu_session.sh check" + (" --small" if args.small else "")
                       if not cpu else "python benchmarks/gpu_check.py --device cpu (a dry run on the CPU)"),
           **environment(), "limits_s": limits, "stages": {}}

    def save():
        (out_dir / "gpu_check.json").write_text(json.dumps(res, indent=1) + "\n")
        write_md(res, out_dir / "gpu_check.md")

    junit, server = logs / "gpu_tests.xml", logs / "server.json"
    res["stages"]["correctness"] = run_stage("correctness", [
        [py, "-m", "pytest", "tests/gpu/test_gpu_paths.py", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}"],
        [py, "benchmarks/gpu_server_check.py", "--out", str(server), "--device", args.device]],
        limits["correctness"], logs, env={**os.environ, "TCS_GPU_TEST_DEVICE": args.device})
    res["tests"] = test_counts(junit)
    res["server"] = json.loads(server.read_text()) if server.is_file() else {"error": "the stage did not finish"}
    save()
    bench = logs / "bench"
    res["stages"]["bench"] = run_stage("bench", [
        [py, "benchmarks/gpu_wan_bf16.py", "--variants", BENCH_VARIANTS, "--timeout", str(limits["bench_process"]),
         "--out", str(bench), *(["--small"] if args.small else []), *(CPU_DRY_RUN if cpu else [])]],
        limits["bench"], logs)
    raw = json.loads(bench.with_suffix(".json").read_text()) if bench.with_suffix(".json").is_file() else {}
    res["bench"] = bench_summary(raw)
    save()
    print((out_dir / "gpu_check.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
