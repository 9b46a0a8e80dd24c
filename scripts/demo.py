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
from harness import HOST_VERSION, NODE_DEFAULTS, ComfyHost, make_tiny_wan, pack_lines, wan_t2v_prompt  # noqa: E402


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
    name = model.name
    settings = NODE_DEFAULTS  # the settings node as it comes (mode speed, regional, reuse on)
    with tempfile.TemporaryDirectory(prefix="tcs_demo_") as base:
        print(f"starting ComfyUI (CPU) in {base} ...", flush=True)
        with ComfyHost(base, models=[model]) as host:
            eager, compiled = [], []
            for i in range(args.runs + 1):  # run 0 loads the model
                eager.append(timed(host, wan_t2v_prompt(name, apply=False, steps=args.steps,
                                                        prefix=f"eager{i}")))
            for i in range(args.runs + 1):  # run 0 compiles
                compiled.append(timed(host, wan_t2v_prompt(name, compile_settings=settings,
                                                           steps=args.steps, prefix=f"compiled{i}")))
            new_size, _ = timed(host, wan_t2v_prompt(name, compile_settings=settings, steps=args.steps,
                                                     width=160, height=96, length=9, prefix="size"))
        print("restarting ComfyUI on the same directory ...", flush=True)
        with ComfyHost(base, models=[model]) as host:
            timed(host, wan_t2v_prompt(name, apply=False, steps=args.steps, prefix="reload"))
            restart, _ = timed(host, wan_t2v_prompt(name, compile_settings=settings, steps=args.steps,
                                                    prefix="restart"))
            log = host.log_text()  # the log file is appended to, so it holds both servers
    ref = eager[-1][1]
    err = max(((c[1] - ref).norm() / ref.norm()).item() for c in compiled)
    e_steady = min(t for t, _ in eager[1:])
    c_steady = min(t for t, _ in compiled[1:])
    print()
    print(f"ComfyUI {HOST_VERSION}, tiny WAN 2.1: {args.blocks} blocks, dim {args.dim}, {args.steps} "
          f"steps, latent 128x128x5, CPU, settings node defaults (timings per prompt over HTTP)")
    print(f"{'':<44}{'seconds':>9}")
    print(f"{'eager, first run (model load)':<44}{eager[0][0]:>9.2f}")
    print(f"{'eager, steady':<44}{e_steady:>9.3f}")
    print(f"{'Apply Torch Compile, first run (cold compile)':<44}{compiled[0][0]:>9.2f}")
    print(f"{'Apply Torch Compile, steady':<44}{c_steady:>9.3f}")
    print(f"{'compiled, new size 160x96x9 (no recompile)':<44}{new_size:>9.2f}")
    print(f"{'compiled, first run after a server restart':<44}{restart:>9.2f}")
    print(f"steady compiled/eager: {c_steady / e_steady:.2f}x   "
          f"max relative L2 vs eager: {err:.1e}")
    for line in log.splitlines():
        if "[TorchCompileSpeed]" in line:
            print("  log:", line.split("[TorchCompileSpeed]", 1)[1].strip())
    return verdict(log, err)


def verdict(log: str, err: float) -> int:
    """Exit status: 0 only when the regions really compiled (no fallback to eager), the restart
    loaded the saved regions without a trace, and the output matched eager."""
    problems = []
    if pack_lines(log, "runs eagerly") or pack_lines(log, "stays eager"):
        problems.append("compile fell back to eager")
    if not pack_lines(log, "compiled WanAttentionBlock"):
        problems.append("no region was compiled")
    if not pack_lines(log, "saved region(s), no trace"):
        problems.append("the restart did not load the saved regions")
    if err > 1e-3:
        problems.append(f"output differs from eager (relative L2 {err:.1e})")
    print("demo " + ("FAILED: " + "; ".join(problems) if problems else "OK: regions compiled, "
                     "restart loaded them without a trace, output equals eager"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
