"""A saved region's C++ kernels on the CPU: built once, without inductor's precompiled header.

Whether inductor's precompiled C++ header is on is part of each CPU kernel's cache key. A
saved region is loaded without it (torch builds the header before it looks for a built kernel,
and a fleet worker or a new container has none), so a region captured with the header had
every kernel built twice: at the capture, and again when the pack loads the file it just saved
to check it.

For one cold compile of the tiny WAN's blocks (8 blocks, dim 256, SDPA attention, the settings
node's defaults but in the foreground) in a fresh process, inductor cache and cache folder,
then a second process on the same folders (a restart), variants taking turns:
- ``header at capture``: the region captured with the header, loaded without it (the pack before);
- ``no header``: captured and loaded without it (the pack now).

    .venv/bin/python benchmarks/region_kernels.py [--rounds 2] [--out PATH]

Writes ``benchmarks/results/region_kernels_cpu.json`` and ``.md``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from run_benchmarks import REPO_ROOT, _comfy_import_setup, machine_info  # noqa: E402
from background_benchmark import heading, write_out  # noqa: E402

VARIANTS = ("header at capture", "no header")


def run_once(variant: str, folder: str) -> dict:
    """One process: the first model call through the pack on ``folder`` (cold or a restart)."""
    _comfy_import_setup("--use-pytorch-cross-attention")
    import torch
    from torch._dynamo.utils import counters
    from overhead_benchmark import load_pack
    from regional_cost import build
    pack = load_pack()
    engine, s = pack("compile_core.run.engine"), pack("compile_core.plan.settings")
    if variant == VARIANTS[0]:
        _header_at_capture(pack("compile_core.cache.saved_region"), pack("compile_core.torch_support.hooks"))
    model = build(256, 8)
    x, t, ctx = torch.randn(2, 16, 2, 16, 16), torch.tensor([500.0, 500.0]), torch.randn(2, 512, 4096)
    settings = s.CompileSettings.from_args(s.build_compile_args(background_compile=False))
    cm = engine.prepare(model, settings, pack("compile_core.cache.registry").ReuseRegistry(),
                        persistent=pack("compile_core.cache.persist").PersistentCache(folder))
    start = time.perf_counter()
    with torch.no_grad():
        cm.run(model, lambda: model(x, t, ctx, transformer_options={}), x.device)
    fast = cm.entry.precompiled
    return {"variant": variant, "first_call_s": round(time.perf_counter() - start, 2),
            "captured": fast.captured if fast else 0, "loaded": fast.loaded if fast else 0,
            "traced": counters["stats"]["unique_graphs"], "kernels": len(list(Path(folder).rglob("*.so"))),
            "header": bool(list(Path(folder).rglob("*.gch")))}


def _header_at_capture(saved_region, hooks) -> None:
    """The pack before: its capture builds the kernels with the header (loads stay without it)."""
    capture, without = saved_region.capture, hooks.without_precompiled_header

    def with_header(*args, **kwargs):
        hooks.without_precompiled_header = contextlib.nullcontext
        try:
            return capture(*args, **kwargs)
        finally:
            hooks.without_precompiled_header = without
    saved_region.capture = with_header


def pair(variant: str) -> list[dict]:
    """A cold process and a restart on the same fresh folders."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="tcs_rk_") as tmp:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(tmp, "inductor"),
               "TMPDIR": tmp}  # (a new container: torch's own header folder empty too)
        for phase in ("cold", "restart"):
            proc = subprocess.run([sys.executable, __file__, "--child", variant, os.path.join(tmp, "cache")],
                                  env=env, capture_output=True, text=True, timeout=1200)
            line = [ln for ln in proc.stdout.splitlines() if ln.startswith("ROW ")]
            row = json.loads(line[-1][4:]) if line else {"variant": variant, "error": proc.stderr[-800:]}
            rows.append({**row, "phase": phase})
    return rows


ABOUT = ("One cold compile of the tiny WAN's blocks (8 blocks, dim 256, SDPA attention) in the foreground, "
         "in a fresh process, inductor cache and cache folder, then a restart on the same folders; "
         "variants taking turns. kernels: the built kernel libraries in the cache folder after the "
         "process; header: a precompiled header was built there.")
COLUMNS = ["variant", "process", "first model call s", "regions traced / loaded", "dynamo graphs",
           "kernels", "header"]


def _cells(r: dict) -> tuple:
    return (r["variant"], r["phase"], r["first_call_s"], f"{r['captured']} / {r['loaded']}",
            r["traced"], r["kernels"], r["header"])


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
    lines = heading("A saved region's C++ kernels, with and without the precompiled header", info)
    lines += ["", ABOUT, "", *table(COLUMNS, rows, _cells)]
    cold = {v: [r["first_call_s"] for r in rows if r.get("variant") == v and r["phase"] == "cold"
                and "error" not in r] for v in VARIANTS}
    if all(cold.values()):
        ratio = statistics.mean(cold[VARIANTS[1]]) / statistics.mean(cold[VARIANTS[0]])
        lines += ["", f"Cold first model call, mean: {ratio:.3f}x with no header against the header at capture."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--child", nargs=2, metavar=("VARIANT", "FOLDER"))
    ap.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "region_kernels_cpu"))
    args = ap.parse_args(argv)
    if args.child:
        print("ROW " + json.dumps(run_once(*args.child)))
        return 0
    info = machine_info(sys.argv)
    rows = [r for _ in range(args.rounds) for v in VARIANTS for r in pair(v)]
    write_out(args.out, {"machine": info, "rows": rows}, markdown(info, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
