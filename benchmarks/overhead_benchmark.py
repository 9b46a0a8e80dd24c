"""What the pack itself adds to every model call.

A real ComfyUI WAN 2.1 model (tiny, random weights, CPU, one thread) runs through the bridge
(``nodes.comfy_model.run_compiled``: the LoRA weight routing, then ``compile_core.run.engine``) with the
settings node's defaults (mode ``speed``), every region running its eager forward instead of
compiled code. Three measurements:

- ``in a model call, regular|saved`` (the headline): clocks inside real model calls sum the
  bridge's time around the model call (routing, scoped knobs, attaching and detaching the
  callables, bookkeeping) and, for every block, the pack's block hook (shaping and marking the
  inputs, the saved-region lookups and checks) less the region call inside it. The model's own
  time and its noise are not part of the figure. The pack's code runs between the model's
  ops, as it does for a user, so with cold CPU caches: about 3x its cost in a warm loop.
  The two paths take turns, one model call each, so a noisy spell hits both alike.
- ``regular``, ``saved`` (replayed, warm): the block calls of one model call are replayed with
  every region an identity, against ``core``, the same block calls dispatched as a compiled
  module does (``_compiled_call_impl``). ``weight routing``, ``scoped_state``, ``attached``:
  one part alone, per model call.
- ``full model``: eager calls against calls through the engine, and eager against eager (the
  noise floor): the difference of two ~17 ms medians, which moves by +-0.3 ms between runs,
  kept as a cross-check.

``saved`` rows run the saved-region path (persistent cache on) with every region "loaded"; the
loaded function is a FAKE (``AcceptingRegion``: accepts every call, runs the region's work), so
only the pack's lookups and its own checks are measured, not torch's guard evaluation. All
rows run inside one sampling run (``CompiledModel.sampling_run``), as the bridge runs them.

    .venv/bin/python benchmarks/overhead_benchmark.py [--blocks 8] [--rounds 2000] [--full-rounds 300]

Writes ``benchmarks/results/overhead_cpu.json`` and ``.md``. Target: the pack's own work per
model call <= 0.5 ms.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
from run_benchmarks import _comfy_import_setup, machine_info  # noqa: E402 - same host and machine record
from background_benchmark import write_out  # noqa: E402 - one results writer

TARGET_MS = 0.5
PACK = "TorchCompileSpeed"


def load_pack():
    """The pack as ComfyUI loads it (a package, so the bridge's relative imports resolve)."""
    if PACK not in sys.modules:
        spec = importlib.util.spec_from_file_location(PACK, REPO / "__init__.py",
                                                      submodule_search_locations=[str(REPO)])
        sys.modules[PACK] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return lambda name: importlib.import_module(f"{PACK}.{name}")


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


def block_calls(model, call) -> list:
    """(block, args, kwargs) of every block call of one eager model call."""
    import torch
    seen = []
    hooks = [b.register_forward_pre_hook(lambda m, a, k: seen.append((m, a, dict(k))), with_kwargs=True)
             for b in model.blocks]
    try:
        with torch.no_grad():
            call()
    finally:
        for h in hooks:
            h.remove()
    return seen


def identity(module, *args, **kwargs):
    """A region's work taken out: the block returns its first input."""
    return args[0]


class AcceptingRegion:
    """FAKE loaded saved region: accepts every call and runs ``run`` (the identity, or the
    module's eager forward), so only the pack's lookups and checks are measured."""
    def __init__(self, run):
        self.fn, self.run = self, run

    def guard_check(self, *args, **kwargs) -> bool:
        return True

    def __call__(self, module, *args, **kwargs):
        return self.run(module, *args, **kwargs)


def compiled_model(pack, model, persistent_root: Path | None, compiled=identity):
    engine, precompiled = pack("compile_core.run.engine"), pack("compile_core.cache.precompiled")
    saved_region, saved_guards = pack("compile_core.cache.saved_region"), pack("compile_core.cache.saved_guards")
    settings_mod = pack("compile_core.plan.settings")
    settings = settings_mod.CompileSettings.from_args(settings_mod.build_compile_args(mode="speed"))
    persistent = pack("compile_core.cache.persist").PersistentCache(persistent_root) if persistent_root else None
    cm = engine.prepare(model, settings, pack("compile_core.cache.registry").ReuseRegistry(), persistent=persistent)
    cm.entry.compiled = compiled  # no compiled code: only the pack's work is left
    cm.entry.graphs = 1  # as after the first compile: no first-compile work on the measured calls
    if persistent_root:
        fake = AcceptingRegion(compiled)
        saved_region.capture = lambda *a, **k: saved_region._Region(  # FAKE capture, see AcceptingRegion
            fake, saved_guards.GlobalChecks.capture([], {}), saved_guards.LocalChecks([], []))
        precompiled.Precompiled._save_checked = lambda *a, **k: None
    return cm


def interleaved(variants: dict, rounds: int, warm: int = 30, clock=time.thread_time_ns) -> dict[str, float]:
    """Median time (s; by default this thread's CPU time) of each variant, all run once per
    round in a shuffled order."""
    times = {k: [] for k in variants}
    items = list(variants.items())
    for _ in range(warm):
        for _, fn in items:
            fn()
    for _ in range(rounds):
        random.shuffle(items)
        for name, fn in items:
            t0 = clock()
            fn()
            times[name].append(clock() - t0)
    return {k: statistics.median(v) / 1e9 for k, v in times.items()}


def replay_rows(pack, model, call, rounds: int, tmp: Path) -> dict:
    """The pack's work per model call, on replayed block calls with identity regions."""
    bridge, attach = pack("nodes.comfy_model"), pack("compile_core.run.attach")
    calls = block_calls(model, call)
    cpu = calls[0][1][0].device

    def replay():
        for m, a, k in calls:
            m(*a, **k)

    def first_arg(*args, **kwargs):
        return args[0]

    def core():
        for b in model.blocks:
            b.__dict__["_compiled_call_impl"] = first_arg
        try:
            replay()
        finally:
            for b in model.blocks:
                del b.__dict__["_compiled_call_impl"]
    regular, saved = compiled_model(pack, model, None), compiled_model(pack, model, tmp)
    scope = regular.state.scope(False)[0]  # (what the engine's run enters)

    def scoped_only():
        with scope.active():
            pass

    def attached_only():
        with attach.attached(regular.plan.modules(model), identity, regular.plan.family, "auto",
                             shapers=regular.state.shapers):
            pass

    def routing_only():
        with bridge.weight_routing.routed(model, regular.plan):
            pass
    with regular.sampling_run(), saved.sampling_run():  # as the bridge runs them: one long run
        med = interleaved({"core": core, "regular": lambda: bridge.run_compiled(regular, model, replay, cpu)}, rounds)
        med_saved = interleaved({"core": core, "saved": lambda: bridge.run_compiled(saved, model, replay, cpu)}, rounds)
    parts = interleaved({"weight routing": routing_only, "scoped_state": scoped_only,
                         "attached": attached_only}, rounds)
    rows = {"regular": _row(med["core"], med["regular"]), "saved": _row(med_saved["core"], med_saved["saved"])}
    rows.update({k: {"overhead_ms": v * 1e3} for k, v in parts.items()})
    return rows


def _row(base: float, with_pack: float) -> dict:
    return {"core_ms": base * 1e3, "pack_ms": with_pack * 1e3, "overhead_ms": (with_pack - base) * 1e3}


class _Clock:
    """This thread's CPU time spent inside the functions it wraps, summed."""
    def __init__(self):
        self.ns = 0

    def wrap(self, fn):
        clock = time.thread_time_ns

        def timed(*args, **kwargs):
            start = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.ns += clock() - start
        return timed


def in_model_call_rows(pack, model, call, calls: int, tmp: Path) -> dict:
    """The pack's own time inside real model calls (the regions run their eager forward):
    the bridge's whole call less the model call it wraps, plus, for every block, the pack's
    block hook less the region call inside it. Measured inside the call, so the model's own
    time and its noise are not part of the figure; the pack's code runs as it does for a
    user, between the model's ops (with cold CPU caches, which roughly triples its cost
    against a warm loop). The clocks add about 0.5 us per block. The paths take turns, one
    model call each in a shuffled order, so a noisy spell of the machine hits both."""
    import contextlib
    import torch.nn as nn
    shapes, bridge = pack("compile_core.plan.shapes"), pack("nodes.comfy_model")
    cpu = next(model.parameters()).device
    made = shapes.shaped_call
    paths = {name: _InCallPath(pack, bridge, model, call, cpu, root, nn.Module._call_impl)
             for name, root in (("in a model call, regular", None), ("in a model call, saved", tmp / "in-call"))}
    try:
        with contextlib.ExitStack() as runs:
            for path in paths.values():
                runs.enter_context(path.cm.sampling_run())
            order = list(paths.values())
            for i in range(calls + 20):
                random.shuffle(order)
                for path in order:
                    shapes.shaped_call = path.hooked(made)
                    path.measure(keep=i >= 20)  # (the first 20: warm-up calls)
    finally:
        shapes.shaped_call = made
    return {name: path.row() for name, path in paths.items()}


class _InCallPath:
    """One path of ``in_model_call_rows``: its compiled model and its four clocks."""

    def __init__(self, pack, bridge, model, call, cpu, root, region_call):
        self.inner, self.hooks, self.model_call, self.outer = _Clock(), _Clock(), _Clock(), _Clock()
        self.cm = compiled_model(pack, model, root, compiled=self.inner.wrap(region_call))
        wrapped = self.model_call.wrap(call)
        self.run = self.outer.wrap(lambda: bridge.run_compiled(self.cm, model, wrapped, cpu))
        self.per_call, self.around = [], []

    def hooked(self, made):
        hooks = self.hooks

        def shaped_call(*args, **kwargs):
            return hooks.wrap(made(*args, **kwargs))
        return shaped_call

    def measure(self, keep: bool) -> None:
        clocks = (self.outer, self.model_call, self.hooks, self.inner)
        before = [c.ns for c in clocks]
        self.run()
        d = [c.ns - b for c, b in zip(clocks, before)]
        if keep:
            self.per_call.append((d[0] - d[1]) + (d[2] - d[3]))
            self.around.append(d[0] - d[1])

    def row(self) -> dict:
        return {"overhead_ms": statistics.median(self.per_call) / 1e6,
                "around_the_call_ms": statistics.median(self.around) / 1e6,
                "p90_ms": sorted(self.per_call)[int(0.9 * len(self.per_call))] / 1e6}


def full_model_rows(pack, model, call, rounds: int, tmp: Path) -> dict:
    """Cross-check on real model calls (noise-limited): eager vs the pack with eager regions, and
    eager vs eager (the noise floor)."""
    import torch.nn as nn
    cm = compiled_model(pack, model, None, compiled=nn.Module._call_impl)
    cpu = next(model.parameters()).device
    med = interleaved({"eager": call, "eager again": lambda: call(),
                       "pack": lambda: cm.run(model, call, cpu)}, rounds, warm=10)
    return {"full model": _row(med["eager"], med["pack"]),
            "full model, noise floor": _row(med["eager"], med["eager again"])}


def measure(blocks: int, rounds: int, full_rounds: int) -> dict:
    import torch
    torch.set_num_threads(1)
    pack = load_pack()
    model, call = build(blocks)
    with torch.no_grad(), tempfile.TemporaryDirectory() as tmp:
        rows = in_model_call_rows(pack, model, call, full_rounds or 300, Path(tmp))
        rows.update(replay_rows(pack, model, call, rounds, Path(tmp)))
        if full_rounds:
            rows.update(full_model_rows(pack, model, call, full_rounds, Path(tmp)))
    return rows


def markdown(result: dict) -> list[str]:
    m, rows = result["machine"], result["rows"]
    in_call = {k: r for k, r in rows.items() if k.startswith("in a model call")}
    lines = [f"# The pack's own work per model call (CPU, ComfyUI {m['comfyui']})", "",
             f"Command: `{m['command']}`", "",
             f"Tiny WAN 2.1, {result['blocks']} blocks, the settings node's defaults (mode speed), "
             f"through the bridge. Target: <= {TARGET_MS} ms.", "",
             f"## In real model calls ({result['full_rounds'] or 300} calls per path, the paths taking "
             "turns; medians)", "",
             "| path | the pack's time per model call, ms | of it around the model call | p90 |",
             "|---|---|---|---|"]
    for name, r in in_call.items():
        lines.append(f"| {name.split(', ')[1]} | **{r['overhead_ms']:.3f}** | {r['around_the_call_ms']:.3f} "
                     f"| {r['p90_ms']:.3f} |")
    lines += ["", f"## Replayed block calls, warm ({result['rounds']} shuffled rounds), and the "
              "full-model cross-check", "",
              "| row | core / eager ms | with the pack ms | overhead ms |", "|---|---|---|---|"]
    for name, r in rows.items():
        if name not in in_call:
            lines.append(f"| {name} | {r.get('core_ms', float('nan')):.3f} | "
                         f"{r.get('pack_ms', float('nan')):.3f} | {r['overhead_ms']:.3f} |")
    lines += ["", f"Machine: {m['nproc']} cores, {m['cpu_model']}, torch {m['torch']}, "
              f"load average at start {m['loadavg_start']}, {m['date']}.", ""]
    return lines


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2000)
    ap.add_argument("--full-rounds", type=int, default=300, help="real model calls measured (0: 300, without the full-model cross-check)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    info = machine_info(sys.argv)
    # PyTorch attention (what ComfyUI uses on NVIDIA): the CPU default, sub-quadratic attention,
    # reads free memory from /proc on every call, a syscall whose jitter swamped the figure
    _comfy_import_setup("--use-pytorch-cross-attention")
    rows = measure(args.blocks, args.rounds, args.full_rounds)
    result = {"blocks": args.blocks, "rounds": args.rounds, "full_rounds": args.full_rounds, "rows": rows,
              "machine": info, "target_ms": TARGET_MS}
    for name, r in rows.items():
        print(f"{name:24s} overhead {r['overhead_ms']:.3f} ms", {k: round(v, 3) for k, v in r.items()})
    if not args.no_write:
        write_out(str(REPO / "benchmarks" / "results" / "overhead_cpu"), result, "\n".join(markdown(result)))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
