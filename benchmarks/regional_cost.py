"""Steady compiled model calls side by side in one process: what the pack costs, and what
compiling block by block (regional) costs, against ComfyUI core's whole-model compile.

The server-level benchmark (``steady_benchmark.py``) has the settings node's defaults at about
1.1x core per prompt. This one takes the server out and splits that gap. One tiny WAN 2.1 (8
blocks, text_dim 4096, ComfyUI's own ``WanModel``, random weights) per variant, the same
weights in each, a CFG batch of 2; every variant is compiled (cold, a scratch inductor cache)
and warmed, then all run once per round in a shuffled order; medians, ratios to core.

Variants:
- ``eager``: no compile.
- ``core``: ``torch.compile`` of the whole diffusion model with core's guard filter, as
  ComfyUI's TorchCompileModel does it.
- ``torch regional``: torch's own regional compile, ``block.compile()`` on every block, no pack.
- ``ours``: the pack's engine with the settings node's defaults (regional, mode speed).
- ``ours whole``: the pack's engine, the whole model as one region.
- ``core, nested blocks`` (``--nested``): core's whole-model compile with every block's forward
  as one ``torch.compiler.nested_compile_region`` (torch's hierarchical compile: the block is
  traced once and its code stamped out for each block inside the one graph). Not a pack
  feature: it tells what a whole-model graph with regional compile's reuse would give.

``ours`` / ``torch regional`` is what the pack costs in steady state; ``torch regional`` / ``core``
is what regional compilation costs on this model (the glue between blocks runs eagerly, each
block is its own compiled call).

    .venv/bin/python benchmarks/regional_cost.py [--rounds 25] [--dim 256]

Writes ``benchmarks/results/regional_cpu.json`` and ``.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

from run_benchmarks import _comfy_import_setup, machine_info  # noqa: E402
from background_benchmark import heading, report  # noqa: E402
from overhead_benchmark import interleaved, load_pack  # noqa: E402

VARIANTS = ("eager", "core", "torch regional", "ours", "ours whole")
NESTED = "core, nested blocks"  # --nested
# --whole-split: where the whole model through the pack differs from core (mode, batch marks)
WHOLE_SPLIT = {"ours whole, mode default": {"mode": "default"},
               "ours whole, static shapes": {"shape_policy": "static"}}


def build(dim: int, blocks: int):
    import torch
    import comfy.ops
    from comfy.ldm.wan.model import WanModel
    torch.manual_seed(0)
    model = WanModel(model_type="t2v", dim=dim, ffn_dim=2 * dim, num_layers=blocks, num_heads=dim // 128,
                     in_dim=16, out_dim=16, text_dim=4096, operations=comfy.ops.disable_weight_init).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.3 if name.endswith("modulation") else p.shape[-1] ** -0.5 if p.ndim >= 2 else 0.02)
    return model


def compiled_call(variant: str, model, inputs: tuple):
    """The steady model call of ``variant`` (compiled on its first call)."""
    import torch
    x, t, ctx = inputs
    call = lambda m=model: m(x, t, ctx, transformer_options={})  # noqa: E731
    if variant in ("core", NESTED):  # core's whole-model compile, with its guard filter
        from comfy_extras.nodes_torch_compile import skip_torch_compile_dict
        if variant == NESTED:
            _nest_blocks(model)
        whole = torch.compile(model, options={"guard_filter_fn": skip_torch_compile_dict})
        return lambda: whole(x, t, ctx, transformer_options={})
    if variant == "torch regional":
        for block in model.blocks:
            block.compile()
    if variant.startswith("ours"):
        pack = load_pack()
        engine, s = pack("compile_core.run.engine"), pack("compile_core.plan.settings")
        extra = {"compile_transformer_blocks_only": False} if variant.startswith("ours whole") else {}
        settings = s.CompileSettings.from_args(s.build_compile_args(**{"mode": "speed", **extra,
                                                                       **WHOLE_SPLIT.get(variant, {})}))
        cm = engine.prepare(model, settings, pack("compile_core.cache.registry").ReuseRegistry())
        return lambda: cm.run(model, call, x.device)
    return call


def _variants(nested: bool, whole_split: bool) -> tuple:
    """``--nested`` goes first of the compiled variants, so its cold first call (not core's)
    pays the process's one-time compile costs."""
    head = ("eager", NESTED) if nested else ("eager",)
    return head + VARIANTS[1:] + (tuple(WHOLE_SPLIT) if whole_split else ())


def _nest_blocks(model) -> None:
    """Every block's forward through one ``nested_compile_region`` (an attribute of each block
    instance: the class is untouched). Its input is made contiguous first: block 0 gets the
    patch embedding's transposed view and the others a contiguous tensor, and torch reuses a
    region's trace only for inputs with the same strides. ``max_reuse_entries`` above the
    block count: with the default 8, torch 2.13 gave up on a 16-block model."""
    import types
    import torch
    blocks = list(model.blocks)
    region = torch.compiler.nested_compile_region(type(blocks[0]).forward, max_reuse_entries=len(blocks) + 8)

    def forward(self, x, *args, **kwargs):
        return region(self, x.contiguous(), *args, **kwargs)
    for block in blocks:
        block.forward = types.MethodType(forward, block)


def cold_first_call(variant: str, dim: int, blocks: int) -> dict:
    """``--cold-of``: one variant's first two calls in this (fresh) process."""
    import torch
    from torch._dynamo.utils import counters
    inputs = (torch.randn(2, 16, 2, 16, 16), torch.tensor([500.0, 500.0]), torch.randn(2, 512, 4096))
    with torch.no_grad():
        start = time.perf_counter()
        call = compiled_call(variant, build(dim, blocks), inputs)
        call()
        call()
    return {"variant": variant, "blocks": blocks, "first_call_s": round(time.perf_counter() - start, 2),
            "graphs": counters["stats"]["unique_graphs"]}


def cold_rows(dim: int, depths: tuple) -> list[dict]:
    """Core and ``NESTED`` cold, each in a fresh process of its own (scratch cache), taking
    turns, at each depth: in one process the first compile also pays one-time costs."""
    import subprocess
    rows = []
    for blocks in depths:
        for variant in (NESTED, "core"):
            cmd = [sys.executable, __file__, "--cold-of", variant, "--dim", str(dim), "--blocks", str(blocks)]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
            line = [ln for ln in proc.stdout.splitlines() if ln.startswith("COLD ")]
            rows.append(json.loads(line[-1][5:]) if line else {"variant": variant, "blocks": blocks,
                                                              "error": proc.stderr[-500:]})
    return rows


def measure(dim: int, blocks: int, rounds: int, variants: tuple = VARIANTS) -> dict:
    import torch
    from torch._dynamo.utils import counters
    inputs = (torch.randn(2, 16, 2, 16, 16), torch.tensor([500.0, 500.0]), torch.randn(2, 512, 4096))
    calls, rows = {}, {}
    with torch.no_grad():
        for v in variants:
            graphs, start = counters["stats"]["unique_graphs"], time.perf_counter()
            calls[v] = compiled_call(v, build(dim, blocks), inputs)
            out = calls[v]()
            calls[v]()
            rows[v] = {"first_call_s": time.perf_counter() - start,
                       "graphs": counters["stats"]["unique_graphs"] - graphs, "out": out}
        ref = rows["eager"]["out"]
        med = interleaved(calls, rounds, warm=0, clock=time.perf_counter_ns)  # (2 threads: wall time)
    for v, r in rows.items():
        out = r.pop("out")
        r.update(call_ms=med[v] * 1e3, per_core=med[v] / med["core"], rel_l2=float((out - ref).norm() / ref.norm()))
    rows["ours"]["per_torch_regional"] = rows["ours"]["call_ms"] / rows["torch regional"]["call_ms"]
    return rows


def markdown(result: dict) -> str:
    m, rows = result["machine"], result["rows"]
    lines = heading("Steady model calls in one process: the pack and regional compilation vs core (CPU)", m) + [
             f"Tiny WAN 2.1, {result['blocks']} blocks, dim {result['dim']}, text_dim 4096, batch 2 (CFG), "
             f"128x128x5; {result['rounds']} shuffled rounds, medians.", "",
             "| variant | call ms | / core | graphs | first call s (cold) | rel L2 vs eager |",
             "|---|---|---|---|---|---|"]
    for v, r in rows.items():
        lines.append(f"| {v} | {r['call_ms']:.1f} | {r['per_core']:.3f} | {r['graphs']} | "
                     f"{r['first_call_s']:.1f} | {r['rel_l2']:.1e} |")
    lines += ["", f"The pack in steady state, `ours` / `torch regional`: "
              f"**{rows['ours']['per_torch_regional']:.3f}**. Regional compilation itself, "
              f"`torch regional` / `core`: {rows['torch regional']['per_core']:.3f}; the whole model "
              f"through the pack, `ours whole` / `core`: {rows['ours whole']['per_core']:.3f}.", ""]
    if NESTED in rows:
        n, c = rows[NESTED], rows["core"]
        lines += [f"`{NESTED}` / `core`: {n['per_core']:.3f} per call; its cold first call "
                  f"{n['first_call_s']:.1f} s against core's {c['first_call_s']:.1f} s (it compiled first "
                  "in this process, so it also paid the one-time compile costs).", ""]
    if result.get("cold"):
        lines += ["Cold first call (two calls), each in a fresh process with an empty cache:", "",
                  "| variant | blocks | first call s | graphs |", "|---|---|---|---|"]
        lines += [f"| {r['variant']} | {r['blocks']} | {r.get('first_call_s', 'failed')} | {r.get('graphs', '')} |"
                  for r in result["cold"]]
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--nested", action="store_true",
                    help="also core's whole-model compile with the blocks as nested compile regions")
    ap.add_argument("--cold-of", default="", help=argparse.SUPPRESS)  # (a cold_rows child)
    ap.add_argument("--whole-split", action="store_true",
                    help="also the whole model through the pack in mode default, and with static shapes")
    args = ap.parse_args()
    info = machine_info(sys.argv)
    scratch = tempfile.mkdtemp(prefix="tcs-regional-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = scratch  # cold compiles, nothing left behind
    try:
        _comfy_import_setup("--use-pytorch-cross-attention")
        if args.cold_of:
            print("COLD " + json.dumps(cold_first_call(args.cold_of, args.dim, args.blocks)))
            return 0
        rows = measure(args.dim, args.blocks, args.rounds, _variants(args.nested, args.whole_split))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    result = {"dim": args.dim, "blocks": args.blocks, "rounds": args.rounds, "rows": rows, "machine": info}
    if args.nested:
        result["cold"] = cold_rows(args.dim, (args.blocks, 2 * args.blocks))
    report("regional_cpu", result, markdown(result), args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
