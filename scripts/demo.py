"""Demo: a real local ComfyUI, a tiny random-weight WAN 2.1 model, one workflow run eagerly and
with Apply Torch Compile, and the timings side by side.

Run it with ``./scripts/demo.sh`` (builds the environment on first use).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "host"))
from harness import (BACKGROUND_DONE, HOST_VERSION, NODE_DEFAULTS, ComfyHost, fallback_lines, make_tiny_wan,  # noqa: E402
                     pack_lines, wan_t2v_prompt)


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
    ap.add_argument("--json", metavar="FILE",
                    help="also write the result as JSON (scripts/torch_matrix.py reads it)")
    args = ap.parse_args()

    model = make_tiny_wan(num_layers=args.blocks, dim=args.dim)
    name = model.name
    settings = NODE_DEFAULTS  # the settings node as it comes (mode speed, regional, background compile)
    with tempfile.TemporaryDirectory(prefix="tcs_demo_") as base:
        print(f"starting ComfyUI (CPU) in {base} ...", flush=True)
        with ComfyHost(base, models=[model]) as host:
            eager, compiled = [], []
            for i in range(args.runs + 1):  # run 0 loads the model
                eager.append(timed(host, wan_t2v_prompt(name, apply=False, steps=args.steps,
                                                        prefix=f"eager{i}")))
            for i in range(args.runs + 1):  # run 0 runs eagerly and queues the compile
                compiled.append(timed(host, wan_t2v_prompt(name, compile_settings=settings,
                                                           steps=args.steps, prefix=f"compiled{i}")))
                if i == 0:  # the compile runs once the server is idle: wait for it
                    host.wait_for_pack_line(BACKGROUND_DONE)
            new_size, _ = timed(host, wan_t2v_prompt(name, compile_settings=settings, steps=args.steps,
                                                     width=160, height=96, length=9, prefix="size"))
        print("restarting ComfyUI on the same directory ...", flush=True)
        with ComfyHost(base, models=[model]) as host:
            timed(host, wan_t2v_prompt(name, apply=False, steps=args.steps, prefix="reload"))
            since = host.log_offset()
            restart, _ = timed(host, wan_t2v_prompt(name, compile_settings=settings, steps=args.steps,
                                                    prefix="restart"))
            # its saved regions load on the background worker meanwhile (a second or two in a
            # fresh process): the model call after that takes them
            host.wait_for_pack_line(BACKGROUND_DONE, since=since, timeout=300)
            restarted, _ = timed(host, wan_t2v_prompt(name, compile_settings=settings,
                                                      steps=args.steps, prefix="restarted"))
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
    print(f"{'Apply Torch Compile, first run (no wait)':<44}{compiled[0][0]:>9.2f}")
    print(f"{'  its compile, in the background afterwards':<44}{background_seconds(log):>9.2f}")
    print(f"{'Apply Torch Compile, steady':<44}{c_steady:>9.3f}")
    print(f"{'compiled, new size 160x96x9 (no recompile)':<44}{new_size:>9.2f}")
    print(f"{'first run after a server restart (loading)':<44}{restart:>9.2f}")
    print(f"{'compiled, once the restart loaded them':<44}{restarted:>9.3f}")
    print(f"steady compiled/eager: {c_steady / e_steady:.2f}x   "
          f"max relative L2 vs eager: {err:.1e}")
    for line in log.splitlines():
        if "[TorchCompileSpeed]" in line:
            print("  log:", line.split("[TorchCompileSpeed]", 1)[1].strip())
    saved = saved_regions_available()
    if not saved:
        import torch
        print(f"saved regions are unavailable on torch {torch.__version__} (it cannot save and load "
              "a compiled function): the restart must compile from the persistent FX-graph cache")
    status = verdict(log, err, saved)
    if args.json:
        import torch

        timings = {"eager_first_s": eager[0][0], "eager_steady_s": e_steady, "cold_s": compiled[0][0],
                   "background_compile_s": background_seconds(log),
                   "compiled_steady_s": c_steady, "new_size_s": new_size, "restart_s": restart,
                   "restarted_s": restarted}
        result = {"torch": torch.__version__, "host": HOST_VERSION, "ok": status == 0,
                  "problems": problems(log, err, saved), "rel_l2": err,
                  "saved_regions_available": saved,
                  **{k: round(v, 3) for k, v in timings.items()}, **log_facts(log),
                  "args": vars(args)}
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return status


def background_seconds(log: str) -> float:
    """How long the first server's background compile took (the pack's "finished in" line)."""
    m = re.search(r"background compile of .* finished in ([\d.]+) s", log)
    return float(m.group(1)) if m else float("nan")


def saved_regions_available() -> bool:
    """Whether this torch can save and load a compiled function (``torch_compat``'s probe), i.e.
    whether a restarted server can load saved regions at all (the server runs this torch:
    ``harness.PYTHON``)."""
    sys.path.insert(0, str(ROOT))
    from compile_core.torch_support import aot
    return bool(aot.load_compiled_function())


def _restart_part(log: str) -> str:
    """The restarted server's part of the log (the log file holds both servers; ComfyUI prints
    its torch version once per start)."""
    lines = log.splitlines()
    starts = [i for i, ln in enumerate(lines) if "pytorch version:" in ln]
    return "\n".join(lines[starts[1]:]) if len(starts) > 1 else ""


def _msg(line: str) -> str:
    return line.split("[TorchCompileSpeed]", 1)[1].strip()


def log_facts(log: str) -> dict:
    """What the pack's log says: compiled or not, graphs (first server, restarted server),
    saved regions used or why not."""
    compiled = [_msg(ln) for ln in pack_lines(log, "compiled WanAttentionBlock")
                if "graph(s)" in ln]  # (in the background, or in a prompt)
    loaded = [_msg(ln) for ln in pack_lines(log, "saved region(s), no trace")]
    fallback = [_msg(ln) for ln in fallback_lines(log)]
    why_not = [_msg(ln) for ln in log.splitlines() if "[TorchCompileSpeed]" in ln
               and re.search(r"not used|not saved|not possible|none of its|guards reject", ln)]
    if not loaded and not why_not and not pack_lines(log, "saved region"):
        why_not = ["the log has no saved-region line: the pack did not try saved regions here"]
    restart = _restart_part(log)

    def count(lines, pattern):
        return sum(int(m.group(1)) for ln in lines for m in [re.search(pattern, ln)] if m)

    restart_compiled = [ln for ln in pack_lines(restart, "compiled WanAttentionBlock") if "graph(s)" in ln]
    graphs = count(compiled, r"(\d+) graph\(s\)")
    restart_graphs = count(restart_compiled, r"(\d+) graph\(s\)")
    return {"compiled": bool(compiled) and not fallback,
            "graphs": graphs - restart_graphs, "restart_graphs": restart_graphs,
            "saved_regions_used": bool(loaded),
            "saved_regions_loaded": count(loaded, r"(\d+) saved region\(s\)"),
            "saved_regions_why_not": why_not[:10], "fallback": fallback[:5],
            "compile_log": compiled[:5]}


def problems(log: str, err: float, saved: bool = True) -> list[str]:
    """Why the demo fails (empty when it passes). ``saved``: this torch has saved regions, so the
    restart must load them; without them it must compile from the persistent FX-graph cache."""
    found = []
    if fallback_lines(log):
        found.append("compile fell back to eager")
    if not pack_lines(log, "compiled WanAttentionBlock"):
        found.append("no region was compiled")
    if saved and not pack_lines(log, "saved region(s), no trace"):
        found.append("the restart did not load the saved regions")
    restart = _restart_part(log)
    if not saved and (not pack_lines(restart, "persistent cache hit")
                      or pack_lines(restart, "persistent cache miss")):
        found.append("the restart did not compile from the persistent FX-graph cache")
    if err > 1e-3:
        found.append(f"output differs from eager (relative L2 {err:.1e})")
    return found


def verdict(log: str, err: float, saved: bool = True) -> int:
    """Exit status: 0 only when the regions really compiled (no fallback to eager), the restart
    loaded the saved regions without a trace (without saved regions on this torch: compiled
    from the persistent FX-graph cache), and the output matched eager."""
    problems_ = problems(log, err, saved)
    restart = ("restart loaded them without a trace" if saved else "restart compiled them from the "
               "persistent FX-graph cache (saved regions are unavailable on this torch)")
    print("demo " + ("FAILED: " + "; ".join(problems_) if problems_ else
                     f"OK: regions compiled, {restart}, output equals eager"))
    return 1 if problems_ else 0


if __name__ == "__main__":
    sys.exit(main())
