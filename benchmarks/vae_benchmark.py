"""CPU benchmark: WAN VAE decode, eager vs Apply Torch Compile (VAE), side by side in one run.

A real ComfyUI server (``tests/host/harness.py``: ``main.py --cpu``, OMP_NUM_THREADS=1) runs
VAELoader -> [Apply Torch Compile (VAE) <- Torch Compile Speed Settings at its defaults, mode
'speed'] -> VAEDecode on a tiny random-weight WAN 2.1 VAE (``tests/host/vae_models.py``), over
the HTTP API. Times are ComfyUI's own execution timestamps of each prompt (execution_start to
execution_success), so they include the node overheads around the decode.

- cold: the first compiled prompt (compile + one decode), against an eager decode;
- steady: eager and compiled decodes alternated, ``--runs`` each, a fresh latent every time
  (median);
- second size: one compiled decode at another latent size: new graphs (should be 0).

    .venv/bin/python benchmarks/vae_benchmark.py            # ~5-10 min on 2 busy cores
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "tests" / "host"))
from harness import (HOST_VERSION, ComfyHost, counters_delta, new_graphs, rel_l2,  # noqa: E402
                     settings_inputs)
from vae_models import make_tiny_vae  # noqa: E402

import safetensors.torch  # noqa: E402

RESULTS = REPO_ROOT / "benchmarks" / "results"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def prompt(vae_name, latent, seed, compiled, label):
    """VAELoader -> [ApplyTorchCompileVAE] -> VAEDecode -> TCSTestVAEProbe."""
    frames, h, w = latent
    p = {"vae": {"class_type": "VAELoader", "inputs": {"vae_name": vae_name}},
         "latent": {"class_type": "TCSTestRandomLatent", "inputs": {
             "channels": 16, "frames": frames, "height": h, "width": w, "seed": seed}},
         "settings": {"class_type": "TorchCompileSpeedSettings",
                      "inputs": settings_inputs(mode="speed")},  # the node's defaults
         "cvae": {"class_type": "ApplyTorchCompileVAE", "inputs": {
             "vae": ["vae", 0], "compile_args": ["settings", 0], "compile": "decode"}}}
    vae_ref = ["cvae" if compiled else "vae", 0]
    p["dec"] = {"class_type": "VAEDecode", "inputs": {"samples": ["latent", 0], "vae": vae_ref}}
    p["probe"] = {"class_type": "TCSTestVAEProbe", "inputs": {
        "images": ["dec", 0], "vae": vae_ref, "label": label}}
    return p


def timed(host, p) -> tuple[float, dict]:
    """(seconds from execution_start to execution_success, the probe report)."""
    hist = host.run(p, timeout=1800)
    stamps = {m[0]: m[1].get("timestamp") for m in hist["status"]["messages"]}
    return (stamps["execution_success"] - stamps["execution_start"]) / 1000.0, host.probe(hist)


def images(report):
    return safetensors.torch.load_file(report["file"])["images"]


def run(args) -> dict:
    vae_file = make_tiny_vae("wan", args.width)
    latent, second = tuple(args.latent), tuple(args.second)
    out = {"host": HOST_VERSION, "vae": f"WAN 2.1 VAE, base width {args.width} (real: 96)",
           "latent": [1, 16, *latent], "second_latent": [1, 16, *second], "runs": args.runs,
           "settings": "TorchCompileSpeedSettings defaults (mode speed: inductor, "
                       "max-autotune-no-cudagraphs, regional, shape policy auto)"}
    with tempfile.TemporaryDirectory(prefix="tcs_vae_bench_") as base:
        host = ComfyHost(Path(base))
        (host.base_dir / "models" / "vae").mkdir(parents=True, exist_ok=True)
        (host.base_dir / "models" / "vae" / vae_file.name).symlink_to(vae_file)
        with host:
            seed = iter(range(1000, 2000))
            log("eager: load + first decode (not timed)")
            timed(host, prompt(vae_file.name, latent, next(seed), False, "warm"))
            s = next(seed)
            out["eager_first_s"], ref = timed(host, prompt(vae_file.name, latent, s, False, "ref"))
            log(f"eager decode {out['eager_first_s']:.2f} s; compiled cold ...")
            out["cold_s"], cold = timed(host, prompt(vae_file.name, latent, s, True, "cold"))
            out["cold_graphs"] = cold["compiled"]["graphs"]
            out["cold_failed"] = cold["compiled"]["failed"]
            out["cold_rel_l2"] = rel_l2(images(cold), images(ref))
            log(f"cold {out['cold_s']:.1f} s, {out['cold_graphs']} graphs; steady ...")
            eager, comp = [], []
            for i in range(args.runs):
                s = next(seed)
                eager.append(timed(host, prompt(vae_file.name, latent, s, False, f"e{i}"))[0])
                comp.append(timed(host, prompt(vae_file.name, latent, s, True, f"c{i}"))[0])
            out.update(eager_steady_s=eager, compiled_steady_s=comp,
                       eager_median_s=statistics.median(eager), compiled_median_s=statistics.median(comp))
            out["steady_compiled_vs_eager"] = round(out["compiled_median_s"] / out["eager_median_s"], 3)
            log(f"steady eager {eager} compiled {comp}; second size ...")
            out["second_s"], rep = timed(host, prompt(vae_file.name, second, next(seed), True, "second"))
            out["second_size_new_graphs"] = new_graphs(counters_delta(cold["counters"], rep["counters"]))
    return out


def write(result, cmd):
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "vae_cpu.json").write_text(json.dumps(result, indent=1) + "\n")
    r = result
    md = [
        "# VAE decode benchmark (CPU, real ComfyUI host)", "",
        f"- ComfyUI {r['host']}; {r['vae']}; latent {r['latent']} (second size {r['second_latent']})",
        f"- {r['settings']}", f"- date {r['date']}, commit `{r['commit']}`, load average at start "
        f"{r['load_average']}: a shared 2-core machine (other jobs ran beside it), so "
        "absolute times are noisy; eager and compiled steady runs are alternated",
        f"- command: `{cmd}`", "",
        "| figure | value |", "|---|---|",
        f"| eager decode s | {r['eager_first_s']:.2f} |",
        f"| compiled cold (compile + decode) s | {r['cold_s']:.1f} |",
        f"| graphs compiled | {r['cold_graphs']} |",
        f"| fallback | {r['cold_failed'] or 'none'} |",
        f"| compiled vs eager rel L2 | {r['cold_rel_l2']:.2e} |",
        f"| steady eager median s ({r['runs']} runs) | {r['eager_median_s']:.2f} |",
        f"| steady compiled median s ({r['runs']} runs) | {r['compiled_median_s']:.2f} |",
        f"| steady compiled / eager | {r['steady_compiled_vs_eager']} |",
        f"| second latent size: new graphs | {r['second_size_new_graphs']} |",
        f"| second latent size: compiled decode s | {r['second_s']:.2f} |", "",
    ]
    (RESULTS / "vae_cpu.md").write_text("\n".join(md))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=16, help="VAE base width (WAN 2.1: 96)")
    ap.add_argument("--latent", type=int, nargs=3, default=[3, 8, 8], metavar=("T", "H", "W"))
    ap.add_argument("--second", type=int, nargs=3, default=[3, 6, 10], metavar=("T", "H", "W"))
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "commit": subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO_ROOT,
                                       capture_output=True, text=True).stdout.strip(),
              "load_average": [round(x, 2) for x in os.getloadavg()]}
    result.update(run(args))
    write(result, "  ".join([".venv/bin/python benchmarks/vae_benchmark.py", *sys.argv[1:]]).strip())
    log(json.dumps(result))


if __name__ == "__main__":
    main()
