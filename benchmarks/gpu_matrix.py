"""The GPU matrix: per model format and size, eager against the settings node's defaults (the
pack) against core's whole-model compile, beside the kernel floor.

One process per row, each under its own time limit (a stuck row still leaves the others). In
a row: eager, then the pack with the node's defaults (background compile included: its
compile time is until the compiled blocks took over), then core's ``torch.compile(model)``
(mode default, as TorchCompileModel; ``torch._dynamo.reset()`` first and inductor's FX-graph
cache off, so it reuses none of the pack's kernels); 2 warm-up and 5 timed steps each; steady
ms (median), compile s, peak VRAM, rel L2 against eager. The model is ComfyUI's own
``comfy.ldm.wan.model.WanModel`` (the default test host), random weights.

Rows built so far (tier A of the plan; the others are named in the results as not built):

- ``B``: bf16, WAN 2.1 1.3B dims, 4 blocks, latent 21x60x104 (32,760 tokens), with the pack's
  and core's first call in a fresh process on the same caches (restart s);
- ``F``: bf16, WAN 14B dims (5120 / 13824, 40 heads), 1 block, the same latent;
- ``C1``, ``C2``: fp8_e4m3fn Linear weights and biases (as an fp8 checkpoint loads), 14B dims,
  1 block: ``C1`` at video size, cast to bf16 in each layer's forward (``comfy.ops.manual_cast``,
  what ComfyUI runs without fp8 compute); ``C2`` at image size, through ``comfy.ops.fp8_ops``
  (``--fast fp8_matrix_mult``: fp8 matmuls where the GPU has them, sm 8.9+; else its manual cast);
- ``G8``: GGUF Q8_0 through ComfyUI-GGUF's ops (``gpu_matrix_gguf``), 14B dims, 1 block, image
  size (latent 1x60x104, 1,560 tokens); no floor yet (an image row's is bytes moved over the
  copy bandwidth, not measured);
- ``L``: bf16 with a rank-64 LoRA on every block Linear, 14B dims, 1 block, video size, loaded
  partially by ComfyUI's ModelPatcher (half the weight bytes on the card; the other layers cast
  from RAM at each call with their LoRA unmerged, ``gpu_matrix_lora``); the pack's calls go
  through its weight routing, as the Apply node runs them;
- ``A1``: the floor: SDPA on the self-attention shape for the flash, cuDNN and efficient
  kernels (``torch.nn.attention.sdpa_kernel``), cuBLAS on the block's GEMM shapes; a video
  row's ``floor_ms`` = its attention FLOPs / the fastest SDPA rate + its GEMM FLOPs / the
  cuBLAS rate;
- ``P``: row B's three variants profiled (``torch.profiler``), one step each, by kernel class:
  attention, GEMM, Triton, other, and the gaps between kernels.

    python benchmarks/gpu_matrix.py                       # rows A1,B,F,L,C1,C2,G8,P on CUDA
    python benchmarks/gpu_matrix.py --rows L,C1,C2,G8 --append   # a second call: the rows added
    python benchmarks/gpu_matrix.py --tiny --device cpu   # every row at toy dims (CI runs this)

Writes ``gpu_matrix.json`` and ``.md`` into ``--out-dir`` (default ``benchmarks/results``)
after every row. On a machine without CUDA (and without ``--device cpu``) it says so and exits
0 having measured nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_wan_bf16 import environment, randomise, until_swapped  # noqa: E402

DIMS = {"1.3B": {"dim": 1536, "ffn_dim": 8960, "num_heads": 12},
        "14B": {"dim": 5120, "ffn_dim": 13824, "num_heads": 40},
        "tiny": {"dim": 128, "ffn_dim": 256, "num_heads": 2}}
TEXT = {"text_dim": 4096, "text_len": 512}
TINY_TEXT = {"text_dim": 64, "text_len": 16}
VIDEO, TINY_LATENT = (21, 60, 104), (2, 8, 8)
IMAGE, TINY_IMAGE = (1, 60, 104), (1, 8, 8)
ROWS = {"B": {"dims": "1.3B", "blocks": 4, "format": "bf16", "restart": True},
        "F": {"dims": "14B", "blocks": 1, "format": "bf16", "restart": False},
        "C1": {"dims": "14B", "blocks": 1, "format": "fp8_manual", "restart": False},
        "C2": {"dims": "14B", "blocks": 1, "format": "fp8_fast", "restart": False, "image": True},
        "G8": {"dims": "14B", "blocks": 1, "format": "gguf_q8_0", "restart": False, "image": True},
        "L": {"dims": "14B", "blocks": 1, "format": "bf16_lora", "restart": False}}
BUILT = ("B", "F", "C1", "C2", "G8", "L", "A1", "P")
NOT_BUILT = {"K": "comfy-kitchen's CUDA backend off",
             "C1s": "fp8_scaled", "G4": "GGUF Q4_K (gguf-py cannot write it)",
             "S": "SageAttention", "D": "dynamic VRAM on"}
ROW_KEYS = ("row", "format", "tokens", "eager_ms", "pack_ms", "core_ms", "floor_ms", "pack_rel_l2",
            "eager_peak_gb", "pack_peak_gb", "pack_compile_s", "core_compile_s", "pack_restart_s",
            "core_restart_s")
LIMITS = {"B": 300, "F": 200, "C1": 200, "C2": 200, "G8": 240, "L": 240, "A1": 60, "P": 120}


# --------------------------------------------------------------------------- the model

def build(dims: str, blocks: int, device, dtype, tiny: bool, fmt: str = "bf16"):
    """ComfyUI's WanModel (T2V) at ``dims``, random weights (``gpu_wan_bf16.randomise``); a GGUF
    ``fmt`` quantizes them (``gpu_matrix_gguf``), ``bf16_lora`` adds a LoRA and loads the model
    partially (``gpu_matrix_lora``)."""
    sys.path.insert(0, str(_host()))
    sys.argv = [sys.argv[0], "--use-pytorch-cross-attention"] + (["--cpu"] if str(device) == "cpu" else [])
    import comfy.options
    comfy.options.enable_args_parsing()
    import comfy.ops
    from comfy.ldm.wan.model import WanModel
    text = TINY_TEXT if tiny else TEXT

    def wan(operations, on=device):
        return WanModel(model_type="t2v", num_layers=blocks, in_dim=16, out_dim=16, text_dim=text["text_dim"],
                        device=on, dtype=dtype, operations=operations, **DIMS[dims])
    ops = {"fp8_manual": comfy.ops.manual_cast, "fp8_fast": comfy.ops.fp8_ops}.get(fmt, comfy.ops.disable_weight_init)
    m = wan(ops, "cpu" if fmt.startswith("gguf") or fmt == "bf16_lora" else device)
    sys.path.append(str(REPO_ROOT))  # after ComfyUI: the pack's ``nodes`` must not shadow ComfyUI's
    randomise(m, seed=0)
    if fmt.startswith("fp8"):
        return to_fp8(m).eval()
    if fmt.startswith("gguf"):
        from gpu_matrix_gguf import gguf_model
        return gguf_model(lambda ops: wan(ops, "cpu"), m, fmt, device)
    if fmt == "bf16_lora":
        from gpu_matrix_lora import lora_model
        return lora_model(m.eval(), device)
    return m.eval()


def to_fp8(model):
    """Every Linear's weight and bias in float8_e4m3fn, as an fp8_e4m3fn checkpoint loads them
    (its layers cast them to the input's dtype in their forward)."""
    import torch
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            for name in ("weight", "bias"):
                p = getattr(m, name)
                if p is not None:
                    setattr(m, name, torch.nn.Parameter(p.data.to(torch.float8_e4m3fn), requires_grad=False))
    return model


def _host() -> Path:
    sys.path.insert(0, str(REPO_ROOT / "tests" / "host"))
    from harness import COMFY_DIR
    return COMFY_DIR


def inputs(latent, tiny: bool, device, dtype):
    import torch
    g = torch.Generator(device="cpu").manual_seed(1)
    text = TINY_TEXT if tiny else TEXT
    x = torch.randn(1, 16, *latent, generator=g).to(device, dtype)
    context = (torch.randn(1, text["text_len"], text["text_dim"], generator=g) * 0.1).to(device, dtype)
    return x, torch.tensor([500.0], device=device), context


def tokens(latent) -> int:
    t, h, w = latent
    return t * (h // 2) * (w // 2)


# --------------------------------------------------------------------------- timing

class Clock:
    def __init__(self, device):
        import torch
        self.torch, self.device, self.cuda = torch, device, device.type == "cuda"

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize(self.device)

    def steps(self, call, warmup=2, iters=5) -> float:
        """Median ms of ``iters`` calls after ``warmup``; CUDA events on a GPU."""
        for _ in range(warmup):
            call()
        self.sync()
        times = []
        for _ in range(iters):
            t = time.perf_counter()
            call()
            self.sync()
            times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)

    def peak_reset(self):
        if self.cuda:
            self.torch.cuda.reset_peak_memory_stats(self.device)

    def peak_gb(self):
        return self.torch.cuda.max_memory_allocated(self.device) / 1024 ** 3 if self.cuda else None


def pack_call(model, forward, device, backend, bridge=False):
    """The pack with the settings node's defaults; ``backend`` (a dry run on the CPU only) also
    compiles in the foreground: a CPU model's background compile waits for an idle server.
    ``bridge``: each call as the Apply node makes it, weight fetches routed (``gpu_matrix_lora``)."""
    from compile_core.cache.persist import PersistentCache
    from compile_core.plan.settings import CompileSettings, build_compile_args
    from compile_core.run import engine
    settings = CompileSettings.from_args(build_compile_args(
        **({"backend": backend, "mode": "default", "background_compile": False} if backend else {})))
    cm = engine.prepare(model, settings, persistent=PersistentCache.default(""))
    if bridge:
        from gpu_matrix_lora import bridge_run
        return cm, lambda: bridge_run(cm, model, forward, device)
    return cm, lambda: cm.run(model, forward, device)


def core_call(model, x, t, ctx, backend):
    import torch
    from torch._inductor import config as inductor_config
    torch._dynamo.reset()
    inductor_config.fx_graph_cache = False  # (this process only: core reuses none of the pack's kernels)
    compiled = torch.compile(model, backend=backend or "inductor")
    return lambda: compiled(x, timestep=t, context=ctx)


def pack_first(cm, pack, clock, swap_limit: float) -> float | None:
    """Seconds from the pack's first call until its compiled blocks ran: the compile on the
    worker (the node's defaults) or in that call (a dry run); None when it never took over."""
    start = time.perf_counter()
    pack()
    clock.sync()
    if not cm.settings.background_compile:
        return round(time.perf_counter() - start, 2)
    swap = until_swapped(cm, pack, clock.sync, start, limit_s=swap_limit)
    return round(swap["compiled_from_s"], 2) if cm.swapped_at else None


def verdict_fields(cm) -> dict:
    """What the pack's own compiled-against-eager pairs decided (``compile_core.run.verdict``;
    made on CUDA only): ``pack_verdict`` eager, compiled or null, with the median ratio."""
    trial = cm.entry.trial
    if trial is None or not trial.decided:
        return {"pack_verdict": None, "pack_verdict_ratio": None}
    ratio = round(statistics.median(trial.ratios), 4) if trial.ratios else None
    return {"pack_verdict": "eager" if cm.entry.slower else "compiled", "pack_verdict_ratio": ratio}


def first_call(clock, call) -> float:
    t = time.perf_counter()
    call()
    clock.sync()
    return time.perf_counter() - t


# --------------------------------------------------------------------------- rows (one process each)

def row_setup(args, name: str):
    """(torch, device, model, (x, t, context), clock, latent) of a video row."""
    import torch
    spec = ROWS[name]
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    latent = (TINY_IMAGE if args.tiny else IMAGE) if spec.get("image") else (TINY_LATENT if args.tiny else VIDEO)
    model = build("tiny" if args.tiny else spec["dims"], spec["blocks"], device, dtype, args.tiny, spec["format"])
    return torch, device, model, inputs(latent, args.tiny, device, dtype), Clock(device), latent


def video_row(args, name: str) -> dict:
    spec = ROWS[name]
    torch, device, model, (x, t, ctx), clock, latent = row_setup(args, name)
    from compile_core.run import verdict  # (on the path once the row is set up)

    def forward():
        return model(x, t, ctx)

    row = {"row": name, "format": spec["format"], "tokens": tokens(latent), "dims": spec["dims"],
           "blocks": spec["blocks"]}
    if spec["format"].startswith("gguf"):
        from gpu_matrix_gguf import quantized_weights
        row["quantized_weights"] = quantized_weights(model)
    if spec["format"] == "bf16_lora":
        from gpu_matrix_lora import lowvram_patches
        row["lowvram_patches"] = lowvram_patches(model)  # layers whose LoRA is applied at each call
    if spec["format"].startswith("fp8"):
        row["fp8_weights"] = sum(p.dtype == torch.float8_e4m3fn for p in model.parameters() if p.ndim == 2)
    with torch.no_grad():
        ref = forward().float()
        clock.peak_reset()
        row["eager_ms"] = clock.steps(forward)
        row["eager_peak_gb"] = clock.peak_gb()
        cm, pack = pack_call(model, forward, device, args.backend, bridge=spec["format"] == "bf16_lora")
        clock.peak_reset()
        row["pack_compile_s"] = pack_first(cm, pack, clock, args.swap_limit)
        row["pack_failed"] = cm.entry.failed or None
        row["pack_graphs"] = cm.entry.graphs  # (0: the pack's steps ran eagerly)
        row["pack_ms"] = clock.steps(pack, warmup=2 + 2 * verdict.PAIRS)  # after the verdict's pairs
        row.update(verdict_fields(cm))
        row["pack_peak_gb"] = clock.peak_gb()
        row["pack_rel_l2"] = rel_l2(pack().float(), ref)
        row.update(core_fields(model, (x, t, ctx), ref, clock, args.backend))
    row["floor_ms"] = None if spec.get("image") else floor_ms(args, row, spec)
    return row


def core_fields(model, xtc, ref, clock, backend) -> dict:
    """Core's ``torch.compile(model)``: compile s, steady ms, rel L2; where it fails, why."""
    try:
        core = core_call(model, *xtc, backend)
        out = {"core_compile_s": round(first_call(clock, core), 2)}
        out["core_ms"] = clock.steps(core)
        out["core_rel_l2"] = rel_l2(core().float(), ref)
        return out
    except Exception as exc:  # noqa: BLE001 - the row keeps its eager and pack figures
        return {"core_error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"}


def restart_row(args, name: str, which: str) -> float:
    """The first call of the pack (until its blocks run compiled) or of core in a fresh process
    on the caches of ``video_row``'s."""
    torch, device, model, (x, t, ctx), clock, _ = row_setup(args, name)
    with torch.no_grad():
        if which == "core":
            return round(first_call(clock, core_call(model, x, t, ctx, args.backend)), 2)
        cm, pack = pack_call(model, lambda: model(x, t, ctx), device, args.backend)
        return pack_first(cm, pack, clock, args.swap_limit)


def rel_l2(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


def attention_shape(tiny: bool, name="B") -> tuple:
    d = DIMS["tiny" if tiny else ROWS[name]["dims"]]
    return 1, d["num_heads"], tokens(TINY_LATENT if tiny else VIDEO), d["dim"] // d["num_heads"]


def gemm_shapes(dims: dict, n_tokens: int, text_len: int) -> list[tuple[int, int, int]]:
    """(m, k, n) of one WAN block's matmuls: self-attention q, k, v, o; cross-attention q, o on
    the tokens and k, v on the text; the FFN's two."""
    d, f = dims["dim"], dims["ffn_dim"]
    return [(n_tokens, d, d)] * 6 + [(text_len, d, d)] * 2 + [(n_tokens, d, f), (n_tokens, f, d)]


def block_flops(dims: dict, n_tokens: int, text_len: int) -> tuple[float, float]:
    """(attention, GEMM) FLOPs of one block's forward."""
    attn = 4.0 * n_tokens * n_tokens * dims["dim"] + 4.0 * n_tokens * text_len * dims["dim"]
    return attn, sum(2.0 * m * k * n for m, k, n in gemm_shapes(dims, n_tokens, text_len))


def floor_row(args) -> dict:
    """Row A1: the measured SDPA rate per kernel and the cuBLAS rate (FLOP/s)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    clock = Clock(device)
    b, h, n, hd = attention_shape(args.tiny)
    q, k, v = (torch.randn(b, h, n, hd, device=device, dtype=dtype) for _ in range(3))
    flops = 4.0 * b * h * n * n * hd
    rates = {}
    for kernel in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION", "MATH"):
        try:
            with sdpa_kernel([getattr(SDPBackend, kernel)]):
                ms = clock.steps(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))
            rates[kernel.lower()] = flops / (ms / 1e3)
        except Exception as exc:  # noqa: BLE001 - this kernel is not available here
            rates[kernel.lower()] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    dims = DIMS["tiny" if args.tiny else ROWS["B"]["dims"]]
    text_len = (TINY_TEXT if args.tiny else TEXT)["text_len"]
    total, ms = 0.0, 0.0
    for m_, k_, n_ in set(gemm_shapes(dims, n, text_len)):
        a, w = torch.randn(m_, k_, device=device, dtype=dtype), torch.randn(k_, n_, device=device, dtype=dtype)
        ms += clock.steps(lambda: a @ w)
        total += 2.0 * m_ * k_ * n_
    numeric = {k: r for k, r in rates.items() if isinstance(r, float)}
    return {"row": "A1", "format": args.dtype.replace("bfloat16", "bf16"), "tokens": n,
            "sdpa_tflops": {k: (round(r / 1e12, 4) if isinstance(r, float) else r) for k, r in rates.items()},
            "sdpa_best": max(numeric, key=numeric.get) if numeric else None,
            "sdpa_rate": max(numeric.values()) if numeric else None,
            "gemm_rate": total / (ms / 1e3), "gemm_tflops": round(total / (ms / 1e3) / 1e12, 4)}


def floor_ms(args, row: dict, spec: dict):
    floor = _read_rows(args).get("A1")
    if not floor or not floor.get("sdpa_rate"):
        return None
    dims = DIMS["tiny" if args.tiny else spec["dims"]]
    attn, gemm = block_flops(dims, row["tokens"], (TINY_TEXT if args.tiny else TEXT)["text_len"])
    return round(spec["blocks"] * (attn / floor["sdpa_rate"] + gemm / floor["gemm_rate"]) * 1e3, 3)


def profile_row(args) -> dict:
    """Row P: one step of eager, the pack and core on row B's model, by kernel class."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    spec, tiny = ROWS["B"], args.tiny
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    model = build("tiny" if tiny else spec["dims"], spec["blocks"], device, dtype, tiny)
    x, t, ctx = inputs(TINY_LATENT if tiny else VIDEO, tiny, device, dtype)
    clock = Clock(device)
    activities = [ProfilerActivity.CUDA] if clock.cuda else [ProfilerActivity.CPU]
    out = {"row": "P", "format": "bf16", "tokens": tokens(TINY_LATENT if tiny else VIDEO), "classes": {}}
    with torch.no_grad():
        cm, pack = pack_call(model, lambda: model(x, t, ctx), device, args.backend)
        pack_first(cm, pack, clock, args.swap_limit)
        for name, call in (("eager", lambda: model(x, t, ctx)), ("pack", pack),
                           ("core", core_call(model, x, t, ctx, args.backend))):
            call(), call()
            clock.sync()
            with profile(activities=activities) as prof:
                call()
                clock.sync()
            out["classes"][name] = kernel_classes(prof.events(), clock.cuda)
    return out


def kernel_classes(events, cuda: bool) -> dict:
    """ms per class of the step's kernels (device time on CUDA, top-level ops on the CPU) and
    the gaps: the step's span less its kernels' time."""
    classes = {"attention": 0.0, "gemm": 0.0, "triton": 0.0, "other": 0.0}
    spans = []
    for e in events:
        if cuda and e.device_type.name != "CUDA":
            continue
        parent = e.cpu_parent.name if e.cpu_parent is not None else ""
        if not cuda and (not e.name.startswith("aten::") or parent.startswith("aten::")):
            continue  # (on the CPU: the first aten op under each compiled or eager call)
        us = e.device_time if cuda else e.cpu_time_total
        name = e.name.lower()
        kind = ("attention" if any(s in name for s in ("flash", "attention", "fmha", "sdpa", "cudnn"))
                else "gemm" if any(s in name for s in ("gemm", "cutlass", "sm90", "cublas", "aten::mm", "addmm", "linear", "bmm"))
                else "triton" if "triton" in name or name.startswith(("graph_", "cpp_")) else "other")
        classes[kind] += us / 1e3
        spans.append((e.time_range.start, e.time_range.end))
    if spans:
        span = (max(end for _, end in spans) - min(start for start, _ in spans)) / 1e3
        classes["gaps"] = max(0.0, span - sum(classes.values()))
    return {k: round(v, 3) for k, v in classes.items()}


# --------------------------------------------------------------------------- driver

def _results(args) -> Path:
    return Path(args.out_dir) / "gpu_matrix"


def _read_rows(args) -> dict:
    try:
        data = json.loads(_results(args).with_suffix(".json").read_text())
    except (OSError, ValueError):
        return {}
    return {r["row"]: r for r in data.get("rows", []) if isinstance(r, dict) and "row" in r}


def run_row(args, name: str, cache: Path, worker: str = "row") -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", worker, "--rows", name,
           "--device", args.device, "--dtype", args.dtype, "--out-dir", args.out_dir,
           "--swap-limit", str(args.swap_limit), *(["--tiny"] if args.tiny else []),
           *(["--backend", args.backend] if args.backend else [])]
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
           "TRITON_CACHE_DIR": str(cache / "triton"), "TORCH_COMPILE_SPEED_CACHE_DIR": str(cache / "tcs")}
    limit = LIMITS.get(name, 300) * (3 if args.device == "cpu" and not args.tiny else 1)
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired:
        return {"row": name, "error": f"timed out after {limit} s"}
    lines = p.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (ValueError, IndexError):
        return {"row": name, "error": (p.stderr.strip().splitlines() or [f"exit code {p.returncode}"])[-1][:400]}


def complete(row: dict) -> dict:
    """``row`` with every key of the results' schema (None where a row has no such figure)."""
    return {**{k: None for k in ROW_KEYS}, **row}


def write(args, rows: list[dict], env: dict) -> None:
    path = _results(args)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"card": (env.get("gpu") or {}).get("name", args.device), "torch": env["torch"],
            "triton": env.get("triton"), "cuda": env.get("cuda"), "date": env["date"],
            "command": env["command"], "tiny": args.tiny, "rows": [complete(r) for r in rows],
            "not_built": NOT_BUILT}
    path.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    path.with_suffix(".md").write_text(markdown(data))


def verdict_cell(r: dict) -> str:
    """The pack's own verdict on the row (compiled or eager, compiled/eager ratio), where made."""
    if not r.get("pack_verdict"):
        return "-"
    return f"{r['pack_verdict']} ({r['pack_verdict_ratio']:.3f})" if r.get("pack_verdict_ratio") else r["pack_verdict"]


def markdown(data: dict) -> str:
    def num(v, spec=".2f"):
        return "-" if v is None else (format(v, spec) if isinstance(v, (int, float)) else str(v))

    L = ["# GPU matrix", "", f"{data['card']}, torch {data['torch']} (CUDA {data['cuda']}), triton "
         f"{data['triton']}, {data['date']}{' (toy dims: says nothing about speed)' if data['tiny'] else ''}.",
         "", f"Command: `{data['command']}`", "",
         "| row | format | tokens | eager ms | pack ms | core ms | floor ms | pack/eager | pack rel L2 "
         "| eager / pack peak GB | pack / core compile s | pack / core restart s | pack verdict |",
         "|---" * 13 + "|"]
    for r in data["rows"]:
        if r.get("error"):
            L.append(f"| {r['row']} | error: {r['error']} |" + " |" * 11)
            continue
        ratio = r["pack_ms"] / r["eager_ms"] if r.get("pack_ms") and r.get("eager_ms") else None
        L.append("| " + " | ".join([r["row"], num(r["format"]), num(r["tokens"], "d"), num(r["eager_ms"]),
                                    num(r["pack_ms"]), num(r["core_ms"]), num(r["floor_ms"]), num(ratio, ".3f"),
                                    num(r["pack_rel_l2"], ".1e"),
                                    f"{num(r['eager_peak_gb'])} / {num(r['pack_peak_gb'])}",
                                    f"{num(r['pack_compile_s'])} / {num(r['core_compile_s'])}",
                                    f"{num(r['pack_restart_s'])} / {num(r['core_restart_s'])}",
                                    verdict_cell(r)]) + " |")
    for r in data["rows"]:
        if r["row"] == "A1" and not r.get("error"):
            L += ["", f"A1: SDPA TFLOP/s {r['sdpa_tflops']} (fastest: {r['sdpa_best']}); cuBLAS on the "
                  f"block's GEMM shapes {r['gemm_tflops']} TFLOP/s."]
        if r["row"] == "P" and not r.get("error"):
            L += ["", "P (ms per step by kernel class): " + "; ".join(
                f"{k}: {v}" for k, v in r["classes"].items())]
    L += ["", "Not built yet: " + "; ".join(f"{k} ({v})" for k, v in data["not_built"].items()) + "."]
    return "\n".join(L) + "\n"


def worker(args) -> dict:
    name = args.rows
    if args.worker in ("restart-pack", "restart-core"):
        return {"seconds": restart_row(args, name, args.worker.split("-")[1])}
    return {"A1": floor_row, "P": profile_row}.get(name, lambda a: video_row(a, name))(args)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default=",".join(("A1", "B", "F", "L", "C1", "C2", "G8", "P")), help=f"of {', '.join(BUILT)}")
    ap.add_argument("--tiny", action="store_true", help="toy dims and latent (a dry run of the code)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--backend", default="", help="only for a dry run: another backend than the node's")
    ap.add_argument("--swap-limit", type=float, default=240.0, help="seconds to wait for the background compile")
    ap.add_argument("--out-dir", default=str(REPO_ROOT / "benchmarks" / "results"))
    ap.add_argument("--append", action="store_true",
                    help="keep the other rows of the results in --out-dir (a second call for the rest of the rows)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    import torch
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_matrix: CUDA is not available here; nothing was measured or written (--device cpu "
              "--tiny runs the code at toy dims).")
        return 0
    env = environment(argparse.Namespace(device=args.device))
    names = [n for n in args.rows.split(",") if n]
    rows = [r for n, r in _read_rows(args).items() if n not in names] if args.append else []
    bad = set(names) - set(BUILT)
    if bad:
        ap.error(f"rows {sorted(bad)} are not built (built: {', '.join(BUILT)})")
    names = sorted(names, key=lambda n: n != "A1")  # the floor first: the video rows read it
    with tempfile.TemporaryDirectory(prefix="tcs_gpu_matrix_") as scratch:
        for name in names:
            print(f"[gpu_matrix] {name} ...", flush=True)
            cache = Path(scratch) / name
            row = run_row(args, name, cache)
            if ROWS.get(name, {}).get("restart") and not row.get("error"):
                for which in ("pack", "core"):
                    got = run_row(args, name, cache, f"restart-{which}")
                    row[f"{which}_restart_s"] = got.get("seconds", got.get("error"))
            rows.append(row)
            print(f"[gpu_matrix] {name}: {json.dumps(row)[:400]}", flush=True)
            write(args, rows, env)
    print(_results(args).with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
