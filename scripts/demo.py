"""Demo: a real local ComfyUI, a tiny random-weight WAN 2.1 model, one workflow run eagerly and
with Apply Torch Compile, and the timings side by side.

Run it with ``./scripts/demo.sh`` (builds the environment on first use).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "host"))
from harness import ComfyHost, make_tiny_wan, wan_t2v_prompt  # noqa: E402


def timed(host, prompt):
    t = time.perf_counter()
    hist = host.run(prompt, timeout=900)
    return time.perf_counter() - t, host.latent(hist)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--blocks", type=int, default=8, help="transformer blocks in the tiny WAN")
    ap.add_argument("--dim", type=int, default=512, help="model width (multiple of 128)")
    ap.add_argument("--runs", type=int, default=3, help="timed runs per variant")
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()

    model = make_tiny_wan(num_layers=args.blocks, dim=args.dim)
    settings = {"backend": "inductor", "mode": "default", "compile_transformer_blocks_only": True}
    with tempfile.TemporaryDirectory(prefix="tcs_demo_") as base:
        print(f"starting ComfyUI (CPU) in {base} ...", flush=True)
        with ComfyHost(base, models=[model]) as host:
            name = model.name
            eager, compiled = [], []
            for i in range(args.runs + 1):  # run 0 loads the model
                eager.append(timed(host, wan_t2v_prompt(name, apply=False, steps=args.steps,
                                                        prefix=f"eager{i}")))
            for i in range(args.runs + 1):  # run 0 compiles
                compiled.append(timed(host, wan_t2v_prompt(name, compile_settings=settings,
                                                           steps=args.steps, prefix=f"compiled{i}")))
            ref = eager[-1][1]
            err = max(((c[1] - ref).norm() / ref.norm()).item() for c in compiled)
            e_steady = min(t for t, _ in eager[1:])
            c_steady = min(t for t, _ in compiled[1:])
            print()
            print(f"tiny WAN 2.1: {args.blocks} blocks, dim {args.dim}, {args.steps} steps, "
                  f"latent 128x128x5, CPU")
            print(f"{'variant':<28}{'first run':>12}{'steady run':>12}")
            print(f"{'eager':<28}{eager[0][0]:>11.2f}s{e_steady:>11.3f}s")
            print(f"{'Apply Torch Compile':<28}{compiled[0][0]:>11.2f}s{c_steady:>11.3f}s")
            print(f"steady compiled/eager: {c_steady / e_steady:.2f}x   "
                  f"max relative L2 vs eager: {err:.1e}")
            for line in host.log_text().splitlines():
                if "[TorchCompileSpeed]" in line:
                    print("  log:", line.strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
