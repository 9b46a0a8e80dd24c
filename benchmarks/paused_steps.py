"""Eager CPU steps while a background compile of another model yields to them.

A background compile of a CPU model pauses while a prompt runs (``compile_core/run/pacing.py``),
and must then cost the prompt nothing. But its thread may hold an OpenMP thread team from the
parallel ops it ran (an input copy, a compiled graph's first run), and on a machine with as many
OpenMP threads as cores an idle second team slows every parallel op of the sampling thread. At
its pause points the compile's thread gives its team back (``openmp``).

In one process: 20-step prompts of one tiny WAN (8 blocks, dim 256) on the main thread with no
compile anywhere (``alone``), then while a background compile of a second tiny WAN with the
settings node's defaults is under way: it gets 1 s of an idle server before each prompt and
yields during it. Variants, each in a fresh process and inductor cache, taking turns:
- ``team given back``: the pack as it runs;
- ``team kept``: the compile's thread keeps its OpenMP team (the release is switched off in
  that process only).

    .venv/bin/python benchmarks/paused_steps.py [--rounds 2] [--prompts 8] [--out PATH]

Writes ``benchmarks/results/paused_steps_cpu.json`` and ``.md``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from run_benchmarks import REPO_ROOT, _comfy_import_setup, machine_info  # noqa: E402
from background_benchmark import heading, write_out  # noqa: E402
from pause_points import child, table  # noqa: E402

VARIANTS = ("team given back", "team kept")
STEPS = 20


def measure(variant: str, prompts: int) -> dict:
    """One process: step times alone, then while the other model compiles in the background."""
    import gc
    _comfy_import_setup("--use-pytorch-cross-attention")  # as the servers
    import torch
    from overhead_benchmark import load_pack
    from regional_cost import build
    pack = load_pack()
    prewarm, pacing = pack("compile_core.cache.prewarm"), pack("compile_core.run.pacing")
    engine, s, background = (pack("compile_core.run.engine"), pack("compile_core.plan.settings"),
                             pack("compile_core.run.background"))
    if variant == VARIANTS[1]:
        pack("compile_core.torch_support.openmp").release_thread_team = lambda: False
    prewarm.warm_probes(torch.device("cpu"))  # as the server's start-up warm-up
    prewarm.warm_base()
    gc.collect()
    gc.freeze()
    idle = [True]
    pacing.set_idle_check(lambda: idle[0])
    sampled, compiled = build(256, 8), build(256, 8)
    x, t, ctx = torch.randn(2, 16, 2, 16, 16), torch.tensor([500.0, 500.0]), torch.randn(2, 512, 4096)

    def prompt() -> list[float]:
        steps = []
        with torch.no_grad():
            for _ in range(STEPS):
                start = time.perf_counter()
                sampled(x, t, ctx, transformer_options={})
                steps.append(time.perf_counter() - start)
        return steps

    prompt()  # first-call costs
    alone = [ms for _ in range(2) for ms in prompt()]
    cm = engine.prepare(compiled, s.CompileSettings.from_args(s.build_compile_args()),
                        pack("compile_core.cache.registry").ReuseRegistry())
    with torch.no_grad():  # eager, and queues the compile
        cm.run(compiled, lambda: compiled(x, t, ctx, transformer_options={}), x.device)
    beside, paused_prompts, counted = [], 0, 0
    for _ in range(prompts):
        idle[0] = True
        time.sleep(1.0)
        idle[0] = False
        if not background.busy():
            break
        beside.extend(prompt())
        job, counted = background.WORKER.current, counted + 1
        paused_prompts += bool(job is not None and job.paused)  # paused still, at the prompt's end
    idle[0] = True
    background.wait_idle(600)
    return {"variant": variant, "alone_ms": _ms(alone), "beside_ms": _ms(beside), "prompts": counted,
            "paused_prompts": paused_prompts,
            "ratio": round(statistics.median(beside) / statistics.median(alone), 3) if beside else None}


def _ms(steps: list[float]) -> dict:
    if not steps:
        return {}
    return {"median": round(1000 * statistics.median(steps), 1), "max": round(1000 * max(steps), 1)}


def markdown(info: dict, rows: list[dict]) -> str:
    lines = heading("Eager CPU steps while a background compile yields to them", info)
    lines += ["", f"Tiny WAN, 8 blocks, dim 256, {STEPS}-step prompts on the main thread; a background "
              "compile of a second copy with the settings node's defaults, which yields while each "
              "prompt runs. Each row is a fresh process and inductor cache, variants taking turns. ratio: "
              "the median step of the prompts that ran before the compile was done over the median "
              "step with no compile, in the same process; paused: the prompts at whose end the "
              "compile was paused (else it was waiting for its C++ compiler or between two pause "
              "points).", ""]
    lines += table(["variant", "step ms alone (median, max)", "step ms while compiling (median, max)",
                    "prompts (paused)", "ratio"], rows,
                   lambda r: (r["variant"], f"{r['alone_ms']['median']}, {r['alone_ms']['max']}",
                              f"{r['beside_ms'].get('median')}, {r['beside_ms'].get('max')}",
                              f"{r['prompts']} ({r['paused_prompts']})", r["ratio"]))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--child", choices=VARIANTS)
    ap.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "paused_steps_cpu"))
    args = ap.parse_args(argv)
    if args.child:
        print("ROW " + json.dumps(measure(args.child, args.prompts)))
        return 0
    info = machine_info(sys.argv)
    rows = [child(v, __file__, "--prompts", str(args.prompts)) for _ in range(args.rounds) for v in VARIANTS]
    write_out(args.out, {"machine": info, "rows": rows}, markdown(info, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
