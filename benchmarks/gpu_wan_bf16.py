"""GPU benchmark: a WAN 2.1 1.3B-shaped bf16 model (random weights, a few blocks) on CUDA,
eager vs this pack's regional compile with the settings node's defaults (``ours-regional``:
``compile_core.run.engine.prepare`` + ``run``, mode ``speed``) vs whole-model ``torch.compile`` as
ComfyUI core's TorchCompileModel runs it (mode default); ``ours-whole`` is the pack's whole-model
compile (``compile_transformer_blocks_only`` off).

No ComfyUI server is needed. The model is ComfyUI's own ``comfy.ldm.wan.model.WanModel`` when
the default test host (``.host/comfyui-0.33.0``, or ``TCS_COMFY_HOST``) exists (``--model comfy``,
the default then), otherwise a plain-torch WAN 2.1
T2V model written here (``--model plain``: same block layout, parameter names and forward
arguments ``x, e, freqs, context`` as ComfyUI's, so the engine plans it the same way).

Every variant runs in its own fresh process with empty inductor/Triton cache dirs (cold compile),
then again in a new process on the same dirs (first call after a restart). The pack does no
work at start-up, so the first call includes the compiler import and the feature probes.
Figures:

- first call s: the first forward, compile included (cold), CUDA-synchronised;
- restart first call s: the same in a new process with the caches kept;
- steady ms: median of ``--iters`` forwards timed with CUDA events, after ``--warmup`` forwards;
- peak GB: ``torch.cuda.max_memory_allocated`` during the first call and during the steady loop;
- rel L2: relative L2 distance of the output to the eager output (same weights and inputs).

    python benchmarks/gpu_wan_bf16.py                 # 4 blocks, latent 480x832x81 (32760 tokens)
    python benchmarks/gpu_wan_bf16.py --small         # latent 240x416x33 (a quick check)

Writes ``benchmarks/results/gpu_results.json`` and ``.md``. Without CUDA it prints why and
exits 0 having measured nothing.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "tests" / "host"))
from harness import COMFY_DIR  # noqa: E402  (the default host, 0.33.0, or TCS_COMFY_HOST)
sys.path.pop(0)
RESULTS = REPO_ROOT / "benchmarks" / "results" / "gpu_results"
VARIANTS = ("eager", "ours-regional", "torch-compile-whole", "ours-whole", "ours-background")
DEFAULT_VARIANTS = ("eager", "ours-regional", "torch-compile-whole")
WAN_1_3B = {"dim": 1536, "ffn_dim": 8960, "num_heads": 12, "text_dim": 4096, "freq_dim": 256,
            "in_dim": 16, "out_dim": 16}


# --------------------------------------------------------------------------- plain-torch WAN 2.1 T2V

def build_plain_wan(num_layers: int, device, dtype):
    """WAN 2.1 T2V in plain torch (the layout of the original Wan2.1 code and of ComfyUI's port)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    def rope_apply(x, freqs):  # x [B, L, H, d]; freqs [1, L, 1, d/2, 2, 2] rotation matrices
        x_ = x.float().reshape(*x.shape[:-1], -1, 1, 2)
        out = freqs[..., 0] * x_[..., 0] + freqs[..., 1] * x_[..., 1]
        return out.reshape(*x.shape).type_as(x)

    class SelfAttention(nn.Module):
        def __init__(self, dim, heads, eps=1e-6):
            super().__init__()
            self.heads = heads
            self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
            self.norm_q, self.norm_k = nn.RMSNorm(dim, eps=eps), nn.RMSNorm(dim, eps=eps)

        def forward(self, x, freqs):
            b, s, n = x.shape[0], x.shape[1], self.heads
            q = rope_apply(self.norm_q(self.q(x)).view(b, s, n, -1), freqs)
            k = rope_apply(self.norm_k(self.k(x)).view(b, s, n, -1), freqs)
            v = self.v(x).view(b, s, n, -1)
            y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
            return self.o(y.transpose(1, 2).reshape(b, s, -1))

    class CrossAttention(SelfAttention):
        def forward(self, x, context):
            b, n = x.shape[0], self.heads
            q = self.norm_q(self.q(x)).view(b, -1, n, x.shape[-1] // n)
            k = self.norm_k(self.k(context)).view(b, -1, n, x.shape[-1] // n)
            v = self.v(context).view(b, -1, n, x.shape[-1] // n)
            y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
            return self.o(y.transpose(1, 2).reshape(b, x.shape[1], -1))

    class WanAttentionBlock(nn.Module):
        def __init__(self, dim, ffn_dim, heads, eps=1e-6):
            super().__init__()
            self.norm1 = nn.LayerNorm(dim, eps, elementwise_affine=False)
            self.self_attn = SelfAttention(dim, heads, eps)
            self.norm3 = nn.LayerNorm(dim, eps, elementwise_affine=True)
            self.cross_attn = CrossAttention(dim, heads, eps)
            self.norm2 = nn.LayerNorm(dim, eps, elementwise_affine=False)
            self.ffn = nn.Sequential(nn.Linear(dim, ffn_dim), nn.GELU(approximate="tanh"),
                                     nn.Linear(ffn_dim, dim))
            self.modulation = nn.Parameter(torch.randn(1, 6, dim) / dim ** 0.5)

        def forward(self, x, e, freqs, context):  # e [B, 1, 6, dim] as in ComfyUI
            e = (self.modulation.to(e.dtype) + e).unbind(2)  # 6 x [B, 1, dim]
            y = self.self_attn(self.norm1(x) * (1 + e[1]) + e[0], freqs)
            x = x + y * e[2]
            x = x + self.cross_attn(self.norm3(x), context)
            y = self.ffn(self.norm2(x) * (1 + e[4]) + e[3])
            return x + y * e[5]

    class Head(nn.Module):
        def __init__(self, dim, out_dim, patch, eps=1e-6):
            super().__init__()
            self.norm = nn.LayerNorm(dim, eps, elementwise_affine=False)
            self.head = nn.Linear(dim, out_dim * math.prod(patch))
            self.modulation = nn.Parameter(torch.randn(1, 2, dim) / dim ** 0.5)

        def forward(self, x, e):  # e [B, 1, dim]
            shift, scale = (self.modulation.to(e.dtype) + e).unbind(1)
            return self.head(self.norm(x) * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1))

    class WanModel(nn.Module):  # the class name is what the engine's region plan matches
        def __init__(self, dim, ffn_dim, num_heads, num_layers, text_dim, freq_dim, in_dim, out_dim,
                     patch_size=(1, 2, 2)):
            super().__init__()
            self.dim, self.freq_dim, self.patch_size, self.out_dim = dim, freq_dim, patch_size, out_dim
            self.num_heads = num_heads
            self.patch_embedding = nn.Conv3d(in_dim, dim, kernel_size=patch_size, stride=patch_size)
            self.text_embedding = nn.Sequential(nn.Linear(text_dim, dim), nn.GELU(approximate="tanh"),
                                                nn.Linear(dim, dim))
            self.time_embedding = nn.Sequential(nn.Linear(freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))
            self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(dim, dim * 6))
            self.blocks = nn.ModuleList(WanAttentionBlock(dim, ffn_dim, num_heads) for _ in range(num_layers))
            self.head = Head(dim, out_dim, patch_size)

        def rope(self, t, h, w, device):
            d = self.dim // self.num_heads
            parts = (d - 4 * (d // 6), 2 * (d // 6), 2 * (d // 6))
            angles = []
            for n, ad, shape in zip((t, h, w), parts, ((t, 1, 1), (1, h, 1), (1, 1, w))):
                inv = 1.0 / (10000 ** (torch.arange(0, ad, 2, device=device, dtype=torch.float64) / ad))
                a = torch.outer(torch.arange(n, device=device, dtype=torch.float64), inv)
                angles.append(a.view(*shape, -1).expand(t, h, w, -1))
            ang = torch.cat(angles, -1).reshape(t * h * w, -1).float()
            cos, sin = ang.cos(), ang.sin()
            rot = torch.stack([cos, -sin, sin, cos], -1).view(1, t * h * w, 1, -1, 2, 2)
            return rot

        def forward(self, x, timestep, context):
            b = x.shape[0]
            x = self.patch_embedding(x)
            t, h, w = x.shape[2:]
            x = x.flatten(2).transpose(1, 2)
            half = self.freq_dim // 2
            f = torch.exp(-math.log(10000) * torch.arange(half, device=x.device, dtype=torch.float64) / half)
            arg = timestep.double().flatten()[:, None] * f[None]
            sin_emb = torch.cat([arg.cos(), arg.sin()], 1).to(x.dtype)
            e = self.time_embedding(sin_emb)
            e0 = self.time_projection(e).unflatten(1, (6, self.dim)).unsqueeze(1)  # [B, 1, 6, dim]
            context = self.text_embedding(context)
            freqs = self.rope(t, h, w, x.device)
            for block in self.blocks:
                x = block(x, e=e0, freqs=freqs, context=context)
            x = self.head(x, e.unsqueeze(1))
            pt, ph, pw = self.patch_size
            x = x.view(b, t, h, w, pt, ph, pw, self.out_dim)
            return x.permute(0, 7, 1, 4, 2, 5, 3, 6).reshape(b, self.out_dim, t * pt, h * ph, w * pw)

    m = WanModel(WAN_1_3B["dim"], WAN_1_3B["ffn_dim"], WAN_1_3B["num_heads"], num_layers,
                 WAN_1_3B["text_dim"], WAN_1_3B["freq_dim"], WAN_1_3B["in_dim"], WAN_1_3B["out_dim"])
    return m.to(device=device, dtype=dtype)


def build_comfy_wan(num_layers: int, device, dtype):
    """ComfyUI's own WanModel (T2V) with WAN 2.1 1.3B dims; needs the host folder (``COMFY_DIR``)."""
    sys.path.insert(0, str(COMFY_DIR))
    sys.argv = [sys.argv[0], "--use-pytorch-cross-attention"] + (["--cpu"] if str(device) == "cpu" else [])
    import comfy.options
    comfy.options.enable_args_parsing()
    import comfy.ops
    from comfy.ldm.wan.model import WanModel
    return WanModel(model_type="t2v", dim=WAN_1_3B["dim"], ffn_dim=WAN_1_3B["ffn_dim"],
                    num_layers=num_layers, num_heads=WAN_1_3B["num_heads"], in_dim=WAN_1_3B["in_dim"],
                    out_dim=WAN_1_3B["out_dim"], text_dim=WAN_1_3B["text_dim"], device=device,
                    dtype=dtype, operations=comfy.ops.disable_weight_init)


def randomise(model, seed: int):
    """Weights ~ 1/sqrt(fan_in), modulation O(0.3), like the tiny WAN of tests/host/harness.py."""
    import torch
    g = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("modulation"):
                v = torch.randn(p.shape, generator=g) * 0.3
            elif p.ndim >= 2:
                v = torch.randn(p.shape, generator=g) / (p[0].numel() ** 0.5)
            elif name.endswith("bias"):
                v = torch.randn(p.shape, generator=g) * 0.02
            else:
                v = 1.0 + torch.randn(p.shape, generator=g) * 0.1
            p.copy_(v.to(p.dtype))


# --------------------------------------------------------------------------- one variant, one process

def worker(args) -> dict:
    import torch

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    build = build_comfy_wan if args.model == "comfy" else build_plain_wan
    model = build(args.blocks, device, dtype).eval()
    randomise(model, seed=0)
    g = torch.Generator(device="cpu").manual_seed(1)
    frames, height, width = args.latent
    x = torch.randn(1, 16, frames, height, width, generator=g).to(device, dtype)
    context = (torch.randn(1, 512, WAN_1_3B["text_dim"], generator=g) * 0.1).to(device, dtype)
    timestep = torch.tensor([500.0], device=device)

    def forward():
        return model(x, timestep, context)

    info = {"variant": args.worker, "model_class": f"{type(model).__module__}.{type(model).__name__}"}
    if args.worker != "eager":
        sys.path.append(str(REPO_ROOT))  # after ComfyUI: the pack's ``nodes`` must not shadow ComfyUI's
    if args.worker == "eager":
        call = forward
    elif args.worker in ("ours-regional", "ours-whole", "ours-background"):
        from compile_core.run import engine
        from compile_core.cache.persist import PersistentCache
        from compile_core.plan.settings import CompileSettings, build_compile_args
        # ours-regional: the compile in the first call (background compile off), so that call
        # times the compile; ours-background: the node's defaults as they are (compile on the worker)
        settings = CompileSettings.from_args(build_compile_args(
            backend=args.backend, mode=args.mode, compile_transformer_blocks_only=args.worker != "ours-whole",
            background_compile=args.worker == "ours-background"))
        t0 = time.perf_counter()
        # the pack's persistent cache, as ComfyUI runs it (the root comes from the env below),
        # so the restart pass loads the saved regions (compile_core/cache/precompiled.py)
        cm = engine.prepare(model, settings, persistent=PersistentCache.default(""))
        info["prepare_s"] = time.perf_counter() - t0
        info["regions"] = cm.description

        def call():
            return cm.run(model, forward, device)
    elif args.worker == "torch-compile-whole":
        compiled = torch.compile(model, backend=args.backend)  # as core's TorchCompileModel: mode default

        def call():
            return compiled(x, timestep, context)
    else:
        raise ValueError(args.worker)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    on_cuda = device.type == "cuda"
    pack_lines = _record_pack_lines()
    with torch.no_grad():
        sync()
        if on_cuda:
            torch.cuda.reset_peak_memory_stats(device)
        profile = _first_call_profiler(args)
        t0 = time.perf_counter()
        out = call()
        sync()
        info["first_call_s"] = time.perf_counter() - t0
        if profile is not None:
            info["first_call_profile"] = _profile_top(profile)
        # where the first call's time went: torch's compile phases and the pack's lines (seconds
        # from the call's start)
        info["compile_times"] = _compile_times()
        info["pack_lines"] = [f"{when - t0:7.2f} s {msg}" for when, msg in pack_lines][-40:]
        if on_cuda:
            info["peak_gb_first_call"] = torch.cuda.max_memory_allocated(device) / 1024 ** 3
        if args.worker == "ours-background":
            info.update(until_swapped(cm, call, sync, t0))
        for _ in range(args.warmup):
            call()
        sync()
        if on_cuda:
            torch.cuda.reset_peak_memory_stats(device)
        times = []
        for _ in range(args.iters):
            if on_cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = call()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t = time.perf_counter()
                out = call()
                times.append((time.perf_counter() - t) * 1e3)
        if on_cuda:
            info["peak_gb_steady"] = torch.cuda.max_memory_allocated(device) / 1024 ** 3
    info["steady_ms"] = {"median": statistics.median(times), "mean": statistics.fmean(times),
                         "min": min(times), "max": max(times), "n": len(times)}
    info["output_finite"] = bool(torch.isfinite(out).all())
    torch.save(out.float().cpu(), args.save_output)
    return info


def _first_call_profiler(args):
    """With ``--profile-first-call``: a running cProfile for the first call (it slows that call)."""
    if not args.profile_first_call:
        return None
    import cProfile
    profile = cProfile.Profile()
    profile.enable()
    return profile


def _profile_top(profile, n: int = 30) -> list[str]:
    """The ``n`` functions with the most cumulative time in ``profile`` (stopped here)."""
    import io
    import pstats
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(n)
    return [line for line in text.getvalue().splitlines() if line.strip()][-n:]


def _record_pack_lines() -> list:
    """(time, message) of every line the pack logs from now on, in a list."""
    import logging
    import re
    import tempfile
    lines: list = []
    scratch = re.compile(re.escape(tempfile.gettempdir()) + r"/[^/\s]+")

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append((time.perf_counter(), scratch.sub("<scratch>", record.getMessage())[:300]))
    logger = logging.getLogger("TorchCompileSpeed")
    logger.addHandler(Keep())
    logger.setLevel(logging.INFO)
    return lines


def _compile_times() -> str:
    """torch's seconds per compile phase so far (dynamo's own table), or why not."""
    try:
        from torch._dynamo.utils import compile_times
        return str(compile_times(repr="str", aggregate=True))[-4000:]
    except Exception as exc:  # noqa: BLE001 - a report
        return f"{type(exc).__name__}: {exc}"


def until_swapped(cm, call, sync, t0: float, limit_s: float = 60.0) -> dict:
    """Model calls, as a sampler makes them, until the background compile is swapped in: when
    (seconds from the first call's start), at which call, and how long the calls beside the
    compile took (each synchronised: median and slowest, in ms)."""
    calls, beside = 1, []
    while cm.swapped_at is None and cm.entry.failed == "" and time.perf_counter() - t0 < limit_s:
        start = time.perf_counter()
        call()
        sync()
        beside.append(1000 * (time.perf_counter() - start))
        calls += 1
    if cm.swapped_at is not None and beside:
        beside.pop()  # (the call that swapped in ran compiled)
    return {"compiled_from_s": time.perf_counter() - t0, "swapped_at_call": cm.swapped_at,
            "calls_until_swapped": calls, "failed": cm.entry.failed,
            "beside_ms": {"median": statistics.median(beside), "max": max(beside), "n": len(beside)}
            if beside else None}


# --------------------------------------------------------------------------- driver

def _rel(path: str) -> str:
    """``path`` relative to the repository, or its bare name outside it (results name no
    machine's folders)."""
    absolute = Path(os.path.abspath(path))  # (not resolved: .venv/bin/python is a link out)
    return str(absolute.relative_to(REPO_ROOT)) if absolute.is_relative_to(REPO_ROOT) else absolute.name


def environment(args) -> dict:
    import torch
    env = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
           "torch": torch.__version__, "cuda": torch.version.cuda,
           "command": " ".join([_rel(sys.executable), _rel(sys.argv[0]), *sys.argv[1:]])}
    try:
        import triton
        env["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        env["triton"] = None
    if args.device.startswith("cuda"):
        p = torch.cuda.get_device_properties(torch.device(args.device))
        env["gpu"] = {"name": p.name, "capability": f"{p.major}.{p.minor}",
                      "memory_gb": round(p.total_memory / 1024 ** 3, 1)}
    try:
        env["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT,
                                           capture_output=True, text=True).stdout.strip()
    except OSError:  # no git on the GPU machine
        env["git_commit"] = ""
    return env


def run_variant(args, variant: str, cache: Path, out_file: Path, phase: str) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", variant, "--save-output", str(out_file),
           "--model", args.model, "--blocks", str(args.blocks), "--latent", *map(str, args.latent),
           "--warmup", str(args.warmup), "--iters", str(args.iters), "--backend", args.backend,
           "--mode", args.mode, "--device", args.device, "--dtype", args.dtype,
           *(["--profile-first-call"] if args.profile_first_call else [])]
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
           "TRITON_CACHE_DIR": str(cache / "triton"), "TORCH_COMPILE_SPEED_CACHE_DIR": str(cache / "tcs")}
    t = time.perf_counter()
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"variant": variant, "phase": phase, "error": f"timed out after {args.timeout} s"}
    # the worker prints its result as the last line; a crash at CUDA/Triton teardown after that
    # (non-zero exit) does not void the measurement
    lines = p.stdout.strip().splitlines()
    try:
        r = json.loads(lines[-1]) if lines else None
    except ValueError:
        r = None
    if not isinstance(r, dict):
        return {"variant": variant, "phase": phase, "returncode": p.returncode,
                "error": (p.stdout[-2000:] + p.stderr[-6000:]) or f"exit code {p.returncode}, no output"}
    r["process_s"] = time.perf_counter() - t
    r["returncode"] = p.returncode
    return r


def error_line(result: dict) -> str:
    return (result["error"].strip().splitlines() or ["(no output)"])[-1]


def write_md(res: dict, path: Path) -> None:
    e = res["environment"]
    L = ["# TorchCompileSpeed GPU benchmark: WAN 2.1 1.3B-shaped bf16 model", "",
         f"- {e['date']}; GPU {e.get('gpu')}; torch {e['torch']} (CUDA {e['cuda']}), triton {e['triton']}; "
         f"commit `{e['git_commit'][:12]}`",
         f"- model: {res['config']['model_desc']}; {res['config']['blocks']} blocks, dim 1536, ffn 8960, "
         f"12 heads, text_dim 4096, {res['config']['dtype']}, random weights",
         f"- latent [1, 16, {', '.join(map(str, res['config']['latent']))}] -> {res['config']['tokens']} tokens; "
         f"context [1, 512, 4096]; one forward per call; backend {res['config']['backend']}, "
         f"mode {res['config']['mode']}",
         f"- command: `{e['command']}`", "",
         "| variant | first call s (cold) | first call s after restart | steady ms (median) "
         "| steady vs eager | peak GB first call | peak GB steady | rel L2 vs eager |",
         "|---|---|---|---|---|---|---|---|"]
    eager = res["variants"].get("eager", {}).get("cold", {})
    base = (eager.get("steady_ms") or {}).get("median")
    for v, r in res["variants"].items():
        c, w = r.get("cold", {}), r.get("restart", {})
        if "error" in c:
            L.append(f"| {v} | error: {error_line(c)[:150]} |" + " |" * 6)
            continue
        med = c["steady_ms"]["median"]

        def num(v, fmt):
            return "n/a" if v is None else format(v, fmt)
        L.append("| " + " | ".join([
            v, num(c.get("first_call_s"), ".2f"), num(w.get("first_call_s"), ".2f"), num(med, ".2f"),
            num(med / base if base else None, ".3f"), num(c.get("peak_gb_first_call"), ".2f"),
            num(c.get("peak_gb_steady"), ".2f"), num(r.get("rel_l2_vs_eager"), ".1e")]) + " |")
    L += ["", "First call = compile (dynamo + inductor + Triton autotune/compile) plus one forward, with "
          "the compiler import and the pack's feature probes (the pack does nothing at start-up); "
          "'after restart' is a new process with the same TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR "
          "(and, for ours, the same persistent cache with its saved regions). "
          "Steady = CUDA-event time of one forward after warm-up. ours-regional is "
          "`compile_core.run.engine.prepare` + `CompiledModel.run` with the settings node's defaults (blocks "
          "only, shape policy auto); "
          "torch-compile-whole is plain `torch.compile(model)` (core's TorchCompileModel: mode default); "
          "ours-whole is the pack's whole-model compile; ours-background is the node's defaults "
          "unchanged (the compile on the background worker while the calls run eagerly)."]
    bg = res["variants"].get("ours-background", {}).get("cold", {})
    if "compiled_from_s" in bg:
        beside = bg.get("beside_ms") or {}
        L += ["", f"ours-background: {swap_text(bg)}; the {beside.get('n')} calls "
              f"beside the compile took {beside.get('median', float('nan')):.2f} ms (median), "
              f"{beside.get('max', float('nan')):.2f} ms at most."]
    path.write_text("\n".join(L) + "\n")


def swap_text(bg: dict) -> str:
    """When the background compile took over, or that it had not when ``until_swapped`` stopped
    calling (its time limit, or a failed compile)."""
    if bg.get("swapped_at_call") is None:
        return (f"not swapped in when the calls stopped, {bg['compiled_from_s']:.2f} s after the first "
                f"call started ({bg.get('calls_until_swapped')} calls)")
    return (f"swapped in at model call {bg['swapped_at_call']}, {bg['compiled_from_s']:.2f} s after the "
            "first call started")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"subset of {', '.join(VARIANTS)}")
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--latent", type=int, nargs=3, default=None, metavar=("T", "H", "W"),
                    help="latent frames, height, width (default 21 60 104 = 81 frames 480x832)")
    ap.add_argument("--small", action="store_true", help="latent 9 30 52 (33 frames 240x416)")
    ap.add_argument("--model", choices=("comfy", "plain"), default=None,
                    help="comfy: ComfyUI's WanModel (default when the host folder exists); plain: built here")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--mode", default="speed", help="the pack's mode (default: the settings node's, speed)")
    ap.add_argument("--no-restart", action="store_true", help="skip the warm-cache restart pass")
    ap.add_argument("--profile-first-call", action="store_true",
                    help="cProfile each process's first call (slows it; the top functions go into the JSON)")
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # 'cpu' only to debug the script
    ap.add_argument("--dtype", default="bfloat16", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(RESULTS), help="results path without suffix")
    ap.add_argument("--timeout", type=int, default=1800)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--save-output", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.latent is None:
        args.latent = [9, 30, 52] if args.small else [21, 60, 104]
    if args.model is None:
        args.model = "comfy" if (COMFY_DIR / "comfy" / "ldm" / "wan" / "model.py").is_file() else "plain"

    if args.worker:
        print(json.dumps(worker(args)))
        return 0

    import torch
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"gpu_wan_bf16: CUDA is not available here (torch {torch.__version__}, CUDA build "
              f"{torch.version.cuda}); this benchmark needs an NVIDIA GPU. Nothing was measured or written.")
        return 0
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = set(variants) - set(VARIANTS)
    if bad:
        ap.error(f"unknown variants {sorted(bad)}")
    if "eager" not in variants:
        variants.insert(0, "eager")
    t, h, w = args.latent
    res = {"environment": environment(args),
           "config": {"model": args.model, "model_desc": ("ComfyUI comfy.ldm.wan.model.WanModel" if args.model == "comfy"
                                                          else "plain-torch WAN 2.1 T2V (benchmarks/gpu_wan_bf16.py)"),
                      "blocks": args.blocks, "latent": args.latent, "tokens": t * (h // 2) * (w // 2),
                      "dtype": args.dtype, "backend": args.backend, "mode": args.mode,
                      "warmup": args.warmup, "iters": args.iters},
           "variants": {}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="tcs_gpu_bench_"))
    try:
        import torch as _t
        for v in variants:
            cache, out_file = scratch / v, scratch / f"{v}.pt"
            print(f"[{time.strftime('%H:%M:%S')}] {v}: cold ...", flush=True)
            r = {"cold": run_variant(args, v, cache, out_file, "cold")}
            if v not in ("eager", "ours-background") and not args.no_restart and "error" not in r["cold"]:
                print(f"[{time.strftime('%H:%M:%S')}] {v}: restart on the same caches ...", flush=True)
                r["restart"] = run_variant(args, v, cache, scratch / f"{v}_restart.pt", "restart")
            if out_file.exists() and (scratch / "eager.pt").exists():
                a, b = _t.load(out_file), _t.load(scratch / "eager.pt")
                r["rel_l2_vs_eager"] = ((a.double() - b.double()).norm() / b.double().norm()).item()
            res["variants"][v] = r
            c = r["cold"]
            print("   " + (error_line(c) if "error" in c else
                          f"first call {c['first_call_s']:.2f} s, steady {c['steady_ms']['median']:.2f} ms"
                          + (f", restart first call {r['restart']['first_call_s']:.2f} s"
                             if "first_call_s" in r.get("restart", {}) else "")), flush=True)
            out.with_suffix(".json").write_text(json.dumps(res, indent=1))
            write_md(res, out.with_suffix(".md"))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
