"""Model calls while the whole-graph stage compiles in the background: on the regional graphs
(``compile_core/beside.py``) against eagerly on a thread fewer (what every such call did before).

One tiny WAN 2.1 (ComfyUI's own ``WanModel``, 8 blocks, dim 256, text_dim 4096, a CFG batch of
2), the settings node's defaults (mode speed) with ``TORCH_COMPILE_SPEED_WHOLE_GRAPH=1``, a
scratch inductor cache. Once the regional compile has settled and the stage's compile has
started on the worker, one path's model calls run until it is done; then both paths run
with no compile beside them. Each path runs in fresh processes, the two taking turns
(``--reps``); the machine is shared, so compare the rows of one run.

    .venv/bin/python benchmarks/beside_benchmark.py

Writes ``benchmarks/results/beside_cpu.json`` and ``.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from run_benchmarks import _comfy_import_setup, machine_info  # noqa: E402
from background_benchmark import heading, in_scratch, report  # noqa: E402
from overhead_benchmark import load_pack  # noqa: E402
from regional_cost import build  # noqa: E402

PATHS = ("regional graphs", "eager, a thread fewer")


def _measure(path: str, rounds_after: int) -> dict:
    """In this (fresh) process: ``path``'s calls beside the stage's compile, then both paths alone."""
    import torch
    pack = load_pack()
    engine, settings, beside = pack("compile_core.engine"), pack("compile_core.settings"), pack("compile_core.beside")
    background = pack("compile_core.background")
    model = build(256, 8)
    x, t, ctx = torch.randn(2, 16, 2, 16, 16), torch.tensor([500.0, 500.0]), torch.randn(2, 512, 4096)
    s = settings.CompileSettings.from_args(settings.build_compile_args(mode="speed"))
    os.environ["TORCH_COMPILE_SPEED_WHOLE_GRAPH"] = "1"
    cm = engine.prepare(model, s, pack("compile_core.registry").ReuseRegistry())
    ref = model(x, t, ctx, transformer_options={})
    real_why = beside.why_not
    forced = {"on": False}
    beside.why_not = lambda cm_, device: "eager (this benchmark)" if forced["on"] else real_why(cm_, device)

    def call(path: str) -> float:
        forced["on"] = path != PATHS[0]
        start = time.perf_counter()
        out = cm.run(model, lambda: model(x, t, ctx, transformer_options={}), x.device)
        took = time.perf_counter() - start
        torch.testing.assert_close(out, ref, rtol=1e-3, atol=1e-3)
        return took

    with torch.no_grad():
        ref = model(x, t, ctx, transformer_options={})
        for _ in range(3):  # compile the regions, settle, capture the stage's inputs
            call(PATHS[0])
        deadline = time.monotonic() + 600
        while not background.optional_running() and time.monotonic() < deadline:
            time.sleep(0.05)
        during, started = [], time.perf_counter()
        while background.optional_running():
            during.append(call(path))
        compile_s = time.perf_counter() - started
        background.wait_idle()
        cm.whole.state = "off"  # (ready now: kept out of the calls below, which run regional)
        alone = {p: [] for p in PATHS}
        for _ in range(rounds_after):
            alone[PATHS[0]].append(call(PATHS[0]))
            start = time.perf_counter()
            model(x, t, ctx, transformer_options={})
            alone[PATHS[1]].append(time.perf_counter() - start)
    return {"path": path, "compile_s": compile_s, "during": during, "alone": alone,
            "threads": torch.get_num_threads()}


def _children(reps: int, rounds_after: int) -> list[dict]:
    """Each path in fresh processes (a cold stage compile each), taking turns: ABAB..."""
    runs = []
    for _ in range(reps):
        for path in PATHS:
            done = subprocess.run([sys.executable, __file__, "--child", path, "--rounds-after", str(rounds_after)],
                                  capture_output=True, text=True, timeout=1800)
            line = [ln for ln in done.stdout.splitlines() if ln.startswith("CHILD ")]
            if not line:
                raise RuntimeError(f"{path}: no result\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
            runs.append(json.loads(line[-1][6:]))
    return runs


def _row(runs: list[dict], path: str) -> dict:
    mine = [r for r in runs if r["path"] == path]
    return {"during_ms": [round(statistics.median(r["during"]) * 1e3, 1) for r in mine],
            "calls_during": [len(r["during"]) for r in mine],
            "compile_s": [round(r["compile_s"], 1) for r in mine],
            "alone_ms": round(statistics.median([x for r in runs for x in r["alone"][path]]) * 1e3, 1)}


def markdown(result: dict) -> str:
    m, rows = result["machine"], result["rows"]
    lines = heading("Model calls while the whole-graph stage compiles (CPU)", m) + [
             "Tiny WAN 2.1, 8 blocks, dim 256, batch 2 (CFG), the settings node's defaults with the stage "
             "on. Each run is a fresh process with a cold stage compile and one path's calls beside it, the "
             "paths taking turns; per run, the median ms per model call beside the compile.", "",
             "| path | ms per call beside the compile, per run | calls beside it | the compile took, s "
             "| ms per call, no compile running |", "|---|---|---|---|---|"]
    for p in PATHS:
        r = rows[p]
        lines.append(f"| {p} | {', '.join(map(str, r['during_ms']))} | {', '.join(map(str, r['calls_during']))} "
                     f"| {', '.join(map(str, r['compile_s']))} | {r['alone_ms']} |")
    ratio = statistics.median(rows[PATHS[0]]["during_ms"]) / statistics.median(rows[PATHS[1]]["during_ms"])
    lines += ["", f"Beside the compile, regional graphs / eager on a thread fewer (medians of the runs): "
              f"**{ratio:.3f}**. The eager row's \"no compile running\" is the model called directly, "
              f"every thread.", ""]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--rounds-after", type=int, default=15)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        def child(scratch):
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(scratch)  # a cold compile, nothing left behind
            _comfy_import_setup("--use-pytorch-cross-attention")
            print("CHILD " + json.dumps(_measure(args.child, args.rounds_after)))
        in_scratch("tcs-beside-", child)
        return 0
    info = machine_info(sys.argv)
    runs = _children(args.reps, args.rounds_after)
    result = {"rows": {p: _row(runs, p) for p in PATHS}, "runs": runs, "machine": info}
    report("beside_cpu", result, markdown(result), args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
