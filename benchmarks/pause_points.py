"""How long a background compile on the CPU runs between two of its pause points.

A background compile of a CPU model pauses while a prompt runs, but only at its pause points
(``compile_core/torch_support/hooks.py``); between two of them it keeps its core and the
interpreter lock, and a prompt that starts meanwhile runs beside it. This measures, for one
cold compile of the tiny WAN's blocks (8 blocks, dim 256, SDPA attention as the host tests'
servers, the settings node's defaults but in the foreground, so it runs on this thread, with a
fresh cache folder, so the blocks' region is traced, saved and loaded back as in the server),
the CPU time the compiling thread spends between consecutive pause points (``time.thread_time``:
waits for the C++ compiler do not count).

Variants, each in a fresh process with a fresh inductor cache, after what the server's start-up
warm-up does (this torch's feature probes, torch's compile entry, the start-up objects frozen):
- ``dynamo/inductor/fx points``: only the first pause points (dynamo's bytecode steps,
  inductor's lowering and fx's node interpreting), no graph-pass warm-up;
- ``without the dict-key and after-guard points``: the pack's points but dynamo's wrapping of
  dict keys and the steps after a frame's guards are built (their check function, timing,
  pickling and loading back);
- ``the pack's points``: every point of ``_PAUSE_POINTS``, and inductor's graph passes set up
  in the warm-up (``hooks.warm_inductor_passes``), as the pack runs now.

    .venv/bin/python benchmarks/pause_points.py [--rounds 2] [--out PATH]

Writes ``benchmarks/results/pause_points_cpu.json`` and ``.md`` (``--out``: another name, e.g.
one per ComfyUI host).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from run_benchmarks import REPO_ROOT, _comfy_import_setup, machine_info  # noqa: E402
from background_benchmark import heading, write_out  # noqa: E402

VARIANTS = ("dynamo/inductor/fx points", "without the dict-key and after-guard points", "the pack's points")
FIRST_POINTS = (("InstructionTranslatorBase", "step"), ("GraphLowering", "run_node"),
                ("Interpreter", "run_node"))  # dynamo's steps, inductor's lowering, fx's nodes
LATER_POINTS = (("HashableTracker", "__init__"), ("CheckFunctionManager", "compile_check_fn"),
                (None, "profile_guard_manager"), ("CheckFunctionManager", "serialize_guards"),
                (None, "load_guards_state"), (None, "load_guard_manager"))  # dict keys, after guards


def compile_once(variant: str) -> dict:
    """One cold compile in this process: the CPU time between consecutive pause points."""
    import gc
    # SDPA as the servers: ComfyUI's CPU default (sub-quadratic attention) breaks the graph
    _comfy_import_setup("--use-pytorch-cross-attention")
    import torch
    from overhead_benchmark import load_pack
    from regional_cost import build
    pack = load_pack()
    hooks, prewarm = pack("compile_core.torch_support.hooks"), pack("compile_core.cache.prewarm")
    engine, s = pack("compile_core.run.engine"), pack("compile_core.plan.settings")
    prewarm.warm_probes(torch.device("cpu"))
    prewarm.warm_base()
    if variant == VARIANTS[0]:
        hooks._PAUSE_POINTS = tuple(p for p in hooks._PAUSE_POINTS if p[1:] in FIRST_POINTS)
    else:
        if variant == VARIANTS[1]:
            hooks._PAUSE_POINTS = tuple(p for p in hooks._PAUSE_POINTS if p[1:] not in LATER_POINTS)
        hooks.warm_inductor_passes(torch.device("cpu"))
    gc.collect()
    gc.freeze()
    model = build(256, 8)
    x, t, ctx = torch.randn(2, 16, 2, 16, 16), torch.tensor([500.0, 500.0]), torch.randn(2, 512, 4096)
    settings = s.CompileSettings.from_args(s.build_compile_args(background_compile=False))
    folder = os.path.join(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or tempfile.mkdtemp(), "pack")
    persistent = pack("compile_core.cache.persist").PersistentCache(folder)  # (``child``'s temporary)
    cm = engine.prepare(model, settings, pack("compile_core.cache.registry").ReuseRegistry(),
                        persistent=persistent)
    marks = [time.thread_time()]
    start = time.perf_counter()
    with torch.no_grad(), hooks.pause_points(lambda: marks.append(time.thread_time())):
        cm.run(model, lambda: model(x, t, ctx, transformer_options={}), x.device)
    wall = time.perf_counter() - start
    marks.append(time.thread_time())
    if not (cm.entry.precompiled and cm.entry.precompiled.captured):
        raise RuntimeError("no region was traced for saving: not the server's compile")
    gaps = sorted((b - a for a, b in zip(marks, marks[1:])), reverse=True)
    return {"variant": variant, "compile_s": round(wall, 2), "checks": len(marks) - 2,
            "thread_cpu_s": round(marks[-1] - marks[0], 2),
            "longest_ms": round(1000 * gaps[0], 1), "top5_ms": [round(1000 * g, 1) for g in gaps[:5]],
            "over_50ms": sum(g > 0.05 for g in gaps), "over_100ms": sum(g > 0.1 for g in gaps)}


def child(variant: str, script: str = __file__, *extra: str) -> dict:
    """The row that ``script --child variant`` prints, run in a fresh process and inductor cache."""
    with tempfile.TemporaryDirectory(prefix="tcs_child_") as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        proc = subprocess.run([sys.executable, script, "--child", variant, *extra], env=env,
                              capture_output=True, text=True, timeout=1200)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("ROW ")]
    return json.loads(line[-1][4:]) if line else {"variant": variant, "error": proc.stderr[-800:]}


def table(header: list[str], rows: list[dict], cells) -> list[str]:
    """A Markdown table: ``cells(row)`` for each row, or the error of a row whose child failed."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['variant']} | error: {r['error'][-120:]!r} |" + " |" * (len(header) - 2))
        else:
            lines.append("| " + " | ".join(str(c) for c in cells(r)) + " |")
    return lines


def markdown(info: dict, rows: list[dict]) -> str:
    lines = heading("Pause points of a background compile: CPU time between two of them", info)
    lines += ["", "One cold compile of the tiny WAN's blocks (8 blocks, dim 256, SDPA attention, "
              "the blocks' region traced, saved and loaded back) per row, each in a "
              "fresh process and inductor cache, variants taking turns. A prompt that starts while "
              "the compile is between two pause points runs beside it until the next one.", ""]
    lines += table(["variant", "compile s", "pause-point calls", "compile thread CPU s", "longest ms",
                    "next four ms", "over 50 ms", "over 100 ms"], rows,
                   lambda r: (r["variant"], r["compile_s"], r["checks"], r["thread_cpu_s"], r["longest_ms"],
                              ", ".join(map(str, r["top5_ms"][1:])), r["over_50ms"], r["over_100ms"]))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--child", choices=VARIANTS)
    ap.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "pause_points_cpu"))
    args = ap.parse_args(argv)
    if args.child:
        print("ROW " + json.dumps(compile_once(args.child)))
        return 0
    info = machine_info(sys.argv)
    rows = [child(v) for _ in range(args.rounds) for v in VARIANTS]
    data = {"machine": info, "rows": rows}
    md = markdown(info, rows)
    write_out(args.out, data, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
