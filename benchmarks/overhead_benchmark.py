"""What the pack itself adds to every model call, with the compiled regions taken out.

A real ComfyUI WAN 2.1 model (tiny, random weights, CPU) runs through ``compile_core.engine`` with
the settings node's defaults (mode ``speed``), but every region's compiled callable is replaced by
the region's own eager forward (``nn.Module._call_impl``). What is left over a plain eager call is
the pack's work: scoped knobs, attaching and detaching the callables, shaping the inputs, the
saved-region lookups and checks, the bookkeeping after the call. Eager calls and pack calls
alternate, so machine noise hits both alike; the medians' difference is the figure. Times are
this thread's CPU time (torch runs on one thread here), so other processes on a shared machine
do not count; cache and memory contention still does. ComfyUI runs with PyTorch attention
(``--use-pytorch-cross-attention``, its NVIDIA default), not the CPU's sub-quadratic one.

Rows:
- ``regular``: the regular torch.compile path (persistent cache off).
- ``saved``: the saved-region path (persistent cache on) with every region "loaded"; the loaded
  function is a FAKE (``EagerRegion``: accepts every call, runs the eager forward), so only the
  pack's lookups and its own checks are measured, not torch's guard evaluation.
- ``scoped_state``, ``attached``: one part alone, per model call.

    .venv/bin/python benchmarks/overhead_benchmark.py [--blocks 8] [--calls 400]

Writes ``benchmarks/results/overhead_cpu.json`` and ``.md``. Target (issue #16): the pack's own
work per model call <= 0.5 ms.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
from run_benchmarks import _comfy_import_setup, machine_info  # noqa: E402 - same host and machine record

TARGET_MS = 0.5


def build(blocks: int):
    import torch
    from comfy.ldm.wan.model import WanModel
    import comfy.ops
    torch.manual_seed(0)
    model = WanModel(model_type="t2v", dim=64, ffn_dim=128, num_layers=blocks, num_heads=2, in_dim=16,
                     out_dim=16, text_dim=32, device="cpu", operations=comfy.ops.disable_weight_init).eval()
    for p in model.parameters():
        p.data.normal_(0, 0.05)
    x, t, ctx = torch.randn(1, 16, 2, 8, 8), torch.tensor([500.0]), torch.randn(1, 8, 32)
    return model, (lambda: model(x, t, ctx, transformer_options={}))


class EagerRegion:
    """FAKE loaded saved region: accepts every call and runs the module's eager forward."""
    def __init__(self):
        import torch.nn as nn
        self.fn = self
        self._call = nn.Module._call_impl

    def guard_check(self, *args, **kwargs) -> bool:
        return True

    def __call__(self, module, *args, **kwargs):
        return self._call(module, *args, **kwargs)


def compiled_model(model, persistent_root: Path | None):
    import torch.nn as nn
    from compile_core import engine, precompiled
    from compile_core.persist import PersistentCache
    from compile_core.registry import ReuseRegistry
    from compile_core.settings import CompileSettings, build_compile_args
    settings = CompileSettings.from_args(build_compile_args(mode="speed"))
    persistent = PersistentCache(persistent_root) if persistent_root else None
    cm = engine.prepare(model, settings, ReuseRegistry(), persistent=persistent)
    cm.entry.compiled = nn.Module._call_impl  # no compiled code: only the pack's work is left
    cm.entry.graphs = 1  # as after the first compile: no first-compile work on the measured calls
    if persistent_root:
        fake = EagerRegion()
        precompiled.capture = lambda *a, **k: precompiled._Region(  # FAKE capture, see EagerRegion
            fake, precompiled.GlobalChecks.capture([], {}), precompiled.LocalChecks([], []))
        precompiled.Precompiled._save_checked = lambda *a, **k: None
    return cm


def per_call(fn, calls: int) -> float:
    times = []
    for _ in range(calls):
        t0 = time.thread_time()
        fn()
        times.append(time.thread_time() - t0)
    return statistics.median(times)


def alternate(eager, packed, calls: int) -> tuple[float, float]:
    a, b = [], []
    for _ in range(calls):
        t0 = time.thread_time()
        eager()
        t1 = time.thread_time()
        packed()
        b.append(time.thread_time() - t1)
        a.append(t1 - t0)
    return statistics.median(a), statistics.median(b)


def measure(blocks: int, calls: int) -> dict:
    import torch
    from compile_core import engine, scoped
    torch.set_num_threads(1)
    model, call = build(blocks)
    cpu = torch.device("cpu")
    rows = {}
    with torch.no_grad(), tempfile.TemporaryDirectory() as tmp:
        for name, root in (("regular", None), ("saved", Path(tmp))):
            cm = compiled_model(model, root)
            packed = lambda: cm.run(model, call, cpu)  # noqa: E731
            for _ in range(20):
                packed(), call()
            eager_s, pack_s = alternate(call, packed, calls)
            rows[name] = {"eager_ms": eager_s * 1e3, "pack_ms": pack_s * 1e3,
                          "overhead_ms": (pack_s - eager_s) * 1e3}
        knobs = scoped.knobs_for(cm.settings, False)

        def scoped_only():
            with scoped.scoped_state(**knobs):
                pass

        def attached_only():
            with engine.attached(cm.plan.modules(model), cm.entry.compiled, cm.plan.family, "auto"):
                pass
        rows["scoped_state"] = {"overhead_ms": per_call(scoped_only, calls) * 1e3}
        rows["attached"] = {"overhead_ms": per_call(attached_only, calls) * 1e3}
    return rows


def write(result: dict) -> None:
    out = REPO / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "overhead_cpu.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"# The pack's own work per model call (CPU, ComfyUI {result['machine']['comfyui']})", "",
             f"Command: `{result['machine']['command']}`", "",
             f"Tiny WAN 2.1, {result['blocks']} blocks, the node's defaults (mode speed); compiled regions "
             "replaced by their eager forward. Median of alternating calls, CPU time of the calling thread. "
             f"Target: overhead <= {TARGET_MS} ms.", "",
             "| row | eager ms | with the pack ms | overhead ms |", "|---|---|---|---|"]
    for name, r in result["rows"].items():
        lines.append(f"| {name} | {r.get('eager_ms', float('nan')):.3f} | {r.get('pack_ms', float('nan')):.3f} "
                     f"| {r['overhead_ms']:.3f} |")
    m = result["machine"]
    lines += ["", f"Machine: {m['nproc']} cores, {m['cpu_model']}, torch {m['torch']}, "
              f"load average at start {m['loadavg_start']}, {m['date']}.", ""]
    (out / "overhead_cpu.md").write_text("\n".join(lines))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    info = machine_info(sys.argv)
    # PyTorch attention (what ComfyUI uses on NVIDIA): the CPU default, sub-quadratic attention,
    # reads free memory from /proc on every call, a syscall whose jitter swamped the figure
    _comfy_import_setup("--use-pytorch-cross-attention")
    rows = measure(args.blocks, args.calls)
    result = {"blocks": args.blocks, "calls": args.calls, "rows": rows, "machine": info,
              "target_ms": TARGET_MS}
    for name, r in rows.items():
        print(f"{name:13s} overhead {r['overhead_ms']:.3f} ms")
    if not args.no_write:
        write(result)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
