"""Fleet benchmark in the real ComfyUI host: worker 1 compiles cold and publishes to a
shared store; worker 2 (its own base directory, empty local caches) warm-starts from it. Both
variants, Redis and a shared directory, run side by side in one run.

    .venv/bin/python benchmarks/fleet_benchmark.py [--blocks 8] [--dim 256]

Writes benchmarks/results/fleet_cpu.json and fleet_cpu.md.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "host"))
sys.path.insert(0, str(ROOT / "tests"))
from harness import HOST_VERSION, NODE_DEFAULTS, ComfyHost, make_tiny_wan, wan_t2v_prompt  # noqa: E402
from redis_server import RedisServer  # noqa: E402

SETTINGS = NODE_DEFAULTS  # the settings node as it comes (mode speed, regional)


def first_compiled_run(work: Path, name: str, model: Path, store: str) -> dict:
    host = ComfyHost(work / name, models=[model],
                     env={"TORCH_COMPILE_SPEED_SHARED_CACHE": store,
                          "TORCHINDUCTOR_CACHE_DIR": str(work / f"{name}_default_inductor")},
                     new_container=True)  # each worker: empty TMPDIR and HOME
    with host:
        eager = host.latent(host.run(wan_t2v_prompt(model.name, apply=False, prefix="e")))
        offset = host.log_offset()
        start = time.perf_counter()
        hist, _ = host.run_compiled(lambda: wan_t2v_prompt(model.name, compile_settings=SETTINGS, prefix="c"),
                                    timeout=1200)
        seconds = time.perf_counter() - start
        out = host.latent(hist)
        log = host.log_text(since=offset)
        full = host.log_text()
    return {"seconds": round(seconds, 2),
            "shared_hit": "shared cache hit" in full, "published": "published" in log,
            "saved_regions_loaded_no_trace": "saved region(s), no trace" in log,
            "rel_l2_vs_eager": float((out - eager).norm() / eager.norm())}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--dim", type=int, default=256)
    args = ap.parse_args()
    model = make_tiny_wan(num_layers=args.blocks, dim=args.dim)
    results = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "commit": subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT,
                                        capture_output=True, text=True).stdout.strip(),
               "model": f"tiny WAN 2.1, {args.blocks} blocks, dim {args.dim}",
               "comfyui": HOST_VERSION, "settings": SETTINGS,
               "load_average_start": os.getloadavg(), "command": " ".join(sys.argv), "stores": {}}
    with tempfile.TemporaryDirectory(prefix="tcs_fleet_bench_") as tmp:
        work = Path(tmp)
        redis = RedisServer(work)
        try:
            for kind, store in (("redis", redis.url), ("directory", str(work / "volume"))):
                w1 = first_compiled_run(work / kind, "worker1", model, store)
                w2 = first_compiled_run(work / kind, "worker2", model, store)
                results["stores"][kind] = {"worker1_cold": w1, "worker2_warm": w2,
                                           "ratio": round(w2["seconds"] / w1["seconds"], 3)}
                print(kind, results["stores"][kind], flush=True)
        finally:
            redis.stop()
    results["load_average_end"] = os.getloadavg()
    out = ROOT / "benchmarks" / "results"
    (out / "fleet_cpu.json").write_text(json.dumps(results, indent=1))
    lines = ["# Fleet benchmark (CPU, real ComfyUI host)", "",
             f"- ComfyUI {HOST_VERSION}; {results['model']}; the settings node's defaults "
             f"({SETTINGS}: regional inductor, compiled in mode default); 4-step prompt over HTTP",
             f"- date {results['date']}, commit `{results['commit']}`, load average at start "
             f"{[round(x, 2) for x in results['load_average_start']]}",
             f"- command: `.venv/bin/python benchmarks/fleet_benchmark.py --blocks {args.blocks} "
             f"--dim {args.dim}`",
             "- each worker: server start, one eager prompt (loads the model), then the timed "
             "compiled prompt, which with the settings node's defaults runs eagerly and compiles in the "
             "background, and then that prompt again on the compiled blocks (the time covers both: "
             "until the compiled blocks ran); worker 2's compile fetches the entry from the shared cache", "",
             "| store | worker 1 cold, until compiled s | worker 2, until compiled s | worker 2 / worker 1 | target | "
             "worker 2 hit shared entry | "
             "worker 2 loaded saved regions, no trace |",
             "|---|---|---|---|---|---|---|"]
    for kind, r in results["stores"].items():
        verdict = "MET" if r["ratio"] <= 0.15 else "missed"
        lines.append(f"| {kind} | {r['worker1_cold']['seconds']} | {r['worker2_warm']['seconds']} | "
                     f"{r['ratio']} | <= 0.15 ({verdict}) | {r['worker2_warm']['shared_hit']} | "
                     f"{r['worker2_warm']['saved_regions_loaded_no_trace']} |")
    (out / "fleet_cpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
