"""Where the eager CPU time of the benchmark's dim-512 WAN goes, and what compile can change.

Builds ComfyUI's own ``WanModel`` (8 blocks, dim 512, random weights, SDPA attention) in
process, profiles eager model calls with ``torch.profiler`` and times eager, ours (regional,
shape policy auto and static) and ``torch.compile`` of the whole model side by side, plus
``torch.compile`` with inductor ``freezing`` (weights prepacked as constants). The pack never
uses freezing, because the baked-in weights would ignore LoRA patches; the row shows what
it would buy. ``bound`` is the ratio left if compile made every op other than the GEMMs
and attention free.

    .venv/bin/python benchmarks/cpu_op_profile.py

Writes benchmarks/results/cpu_op_profile.json and .md.
"""
from __future__ import annotations

import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.argv = [sys.argv[0], "--cpu", "--use-pytorch-cross-attention"]
sys.path.insert(0, str(ROOT / ".host" / "comfyui"))
sys.path.insert(0, str(ROOT))

import comfy.options  # noqa: E402

comfy.options.enable_args_parsing()
import comfy.ops  # noqa: E402
import torch  # noqa: E402
from comfy.ldm.wan.model import WanModel  # noqa: E402
from torch import nn  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from compile_core.run import engine  # noqa: E402
from compile_core.plan.settings import CompileSettings, build_compile_args  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "cpu_op_profile"


def median_ms(fn, reps=15, warm=3) -> float:
    for _ in range(warm):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return round(statistics.median(times) * 1e3, 2)


def main() -> int:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = WanModel(model_type="t2v", patch_size=(1, 2, 2), text_len=512, in_dim=16, dim=512,
                     ffn_dim=2048, freq_dim=256, text_dim=4096, out_dim=16, num_heads=4,
                     num_layers=8, operations=comfy.ops.disable_weight_init, device="cpu",
                     dtype=torch.float32).eval()
    for p in model.parameters():
        nn.init.normal_(p, std=0.02)
    # the benchmark's latent 128x128x5 -> WAN latent 16x2x16x16
    x, t, ctx = torch.randn(1, 16, 2, 16, 16), torch.tensor([500.0]), torch.randn(1, 512, 4096)
    call = lambda: model(x, t, ctx)  # noqa: E731
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "torch": torch.__version__, "threads": torch.get_num_threads(),
              "load_average_start": os.getloadavg(),
              "model": "ComfyUI WanModel t2v, 8 blocks, dim 512, ffn 2048, 4 heads; latent 1x16x2x16x16",
              "command": "benchmarks/cpu_op_profile.py"}
    with torch.no_grad():
        for _ in range(2):
            call()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                call()
        ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
        total = sum(e.self_cpu_time_total for e in ops)
        result["eager_ops"] = [{"op": e.key, "share": round(e.self_cpu_time_total / total, 4),
                                "calls_per_model_call": e.count // 3} for e in ops[:10]]
        times = {"eager": median_ms(call)}
        for policy in ("auto", "static"):
            s = CompileSettings.from_args(build_compile_args(
                backend="inductor", mode="default", shape_policy=policy,
                compile_transformer_blocks_only=True))
            cm = engine.prepare(model, s)
            times[f"ours-regional ({policy})"] = median_ms(lambda: cm.run(model, call, x.device))
        whole = torch.compile(model)
        times["torch.compile(model)"] = median_ms(lambda: whole(x, t, ctx))
        torch._dynamo.reset()
        with torch._inductor.config.patch(freezing=True):
            frozen = torch.compile(model)
            times["torch.compile(model), freezing (not used)"] = median_ms(lambda: frozen(x, t, ctx))
        torch._dynamo.reset()
    result["median_ms_per_model_call"] = times
    result["ratio_vs_eager"] = {k: round(v / times["eager"], 3) for k, v in times.items()}
    result["bound"] = round(sum(o["share"] for o in result["eager_ops"]
                                if o["op"] in ("aten::addmm", "aten::mm", "aten::bmm")
                                or "scaled_dot_product" in o["op"]), 3)
    OUT.with_suffix(".json").write_text(json.dumps(result, indent=1))
    lines = ["# Eager CPU profile of the dim-512 benchmark WAN, and what compile changes", "",
             f"- {result['model']}; torch {result['torch']}, {result['threads']} thread; "
             f"{result['date']}; load average at start {[round(v, 2) for v in result['load_average_start']]}",
             f"- command: `.venv/bin/python {result['command']}`", "",
             "| eager op (self CPU time) | share | calls per model call |", "|---|---|---|"]
    lines += [f"| `{o['op']}` | {o['share'] * 100:.1f}% | {o['calls_per_model_call']} |"
              for o in result["eager_ops"]]
    lines += ["", "| variant | median ms per model call | vs eager |", "|---|---|---|"]
    lines += [f"| {k} | {v} | {result['ratio_vs_eager'][k]} |" for k, v in times.items()]
    lines += ["", f"Bound: GEMMs and attention take {result['bound'] * 100:.1f}% of eager time, so even a "
              f"compile that made every other op free would reach {result['bound']:.3f} of eager "
              "unless the GEMMs or the attention themselves get faster."]
    OUT.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
