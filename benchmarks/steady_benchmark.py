"""Steady compiled prompts, the pack against ComfyUI core's TorchCompileModel, side by side.

One ComfyUI server per variant, all up at once, on the same tiny WAN:

- ``eager``: no compile node;
- ``core``: ComfyUI's ``TorchCompileModel`` (backend inductor);
- ``ours``: Apply Torch Compile with the settings node's defaults (mode ``speed``, regional);
- extra rows, to tell where a difference comes from: ``ours-default`` (mode ``default``),
  ``ours-static`` (shape policy ``static``: no dims marked dynamic), ``ours-whole`` (the whole
  diffusion model as one region, as core compiles it).

Each compiled server first runs the prompt until it compiles nothing new (warm-up). Then the
variants take turns, one prompt each per round, for ``--rounds`` rounds, so that machine noise
hits them alike. A test-only node logs every model call with the server's clock, which gives
the step times; the prompt time is the server's own execution time. The figures are the
medians over rounds of the per-round ratios to ``core``.

    .venv/bin/python benchmarks/steady_benchmark.py [--blocks 8] [--steps 8] [--rounds 25]

Writes ``benchmarks/results/steady_cpu.json`` and ``.md``. Target: a steady prompt with the
pack <= 1.05x core's.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from background_benchmark import in_scratch, prompt as timed_prompt, steps_of, write_out  # noqa: E402
from run_benchmarks import Run, machine_info  # noqa: E402
from harness import NODE_DEFAULTS, ComfyHost, make_tiny_wan, rel_l2  # noqa: E402

TARGET = 1.05
VARIANTS = ("eager", "core", "ours", "ours-default", "ours-static", "ours-whole")
SETTINGS = {"ours": NODE_DEFAULTS, "ours-default": {"mode": "default"},
            "ours-static": {"mode": "speed", "shape_policy": "static"},
            "ours-whole": {"mode": "speed", "compile_transformer_blocks_only": False}}
WARMUP_MAX = 6


def variant_prompt(variant: str, model: str, steps: int, prefix: str) -> dict:
    p = timed_prompt(model, SETTINGS.get(variant), steps, prefix)
    p["timer"]["inputs"]["in_graphs"] = False  # (never inside a compiled graph: it would split it)
    if variant == "core":
        p["compile"] = {"class_type": "TorchCompileModel", "inputs": {"model": ["loader", 0],
                                                                      "backend": "inductor"}}
        p["timer"]["inputs"]["model"] = ["compile", 0]
    return p


def run_once(host: ComfyHost, variant: str, model: str, steps: int, tag: str) -> dict:
    off = host.log_offset()
    r = Run(host, variant_prompt(variant, model, steps, f"{variant}{tag}"))
    step_s = [s["s"] for s in steps_of(host.log_text(since=off)) if s["s"]]
    return {"exec_s": r.exec, "wall_s": r.wall, "step_ms": 1000 * statistics.median(step_s) if step_s else None,
            "graphs": r.counters.get("stats", {}).get("unique_graphs", 0), "latent": r.latent()}


def warm(host, variant, model, steps) -> int:
    """Prompts until one compiles nothing new; returns how many ran."""
    prev = None
    for i in range(WARMUP_MAX):
        got = run_once(host, variant, model, steps, f"w{i}")
        if prev is not None and got["graphs"] == prev:
            return i + 1
        prev = got["graphs"]
    return WARMUP_MAX


def measure(model_path: Path, steps: int, rounds: int, work: Path) -> dict:
    with contextlib.ExitStack() as stack:
        hosts = {}
        for v in VARIANTS:
            d = work / v
            env = {"TORCHINDUCTOR_CACHE_DIR": str(d / "inductor"), "TORCH_COMPILE_SPEED_CACHE_DIR": str(d / "tcs")}
            hosts[v] = stack.enter_context(ComfyHost(d / "server", models=[model_path], env=env,
                                                     new_container=True))
        name = model_path.name
        warmups = {v: warm(hosts[v], v, name, steps) for v in VARIANTS}
        raw: dict = {v: [] for v in VARIANTS}
        for i in range(rounds):
            order = VARIANTS[i % len(VARIANTS):] + VARIANTS[:i % len(VARIANTS)]  # rotate who goes first
            for v in order:
                raw[v].append(run_once(hosts[v], v, name, steps, f"r{i}"))
    ref = raw["eager"][0]["latent"]
    out = {"warmup_prompts": warmups, "rows": {}}
    for v in VARIANTS:
        rows = raw[v]
        out["rows"][v] = {
            "exec_s_median": round(statistics.median(r["exec_s"] for r in rows), 4),
            "step_ms_median": _median([r["step_ms"] for r in rows], 2),
            "prompt_vs_core": round(statistics.median(r["exec_s"] / c["exec_s"] for r, c in zip(rows, raw["core"])), 3),
            "step_vs_core": _median([r["step_ms"] / c["step_ms"] if r["step_ms"] and c["step_ms"] else None
                                     for r, c in zip(rows, raw["core"])], 3),
            "new_graphs_in_rounds": rows[-1]["graphs"] - rows[0]["graphs"],
            "max_rel_l2_vs_eager": max(rel_l2(r["latent"], ref) for r in rows),
        }
        for r in rows:
            r.pop("latent")
    out["raw"] = raw
    return out


def _median(values: list, digits: int) -> float | None:
    """The median of the values a call log gave (None: a variant whose model calls all ran in
    a graph of the whole diffusion model, which the step timer stays out of)."""
    got = [v for v in values if v is not None]
    return round(statistics.median(got), digits) if got else None


def markdown(res: dict, info: dict, args) -> str:
    ours = res["rows"]["ours"]["prompt_vs_core"]
    lines = ["# Steady compiled prompts: the pack vs ComfyUI core's TorchCompileModel (CPU)", "",
             f"Command: `{info['command']}`", "",
             f"Machine: {info['nproc']} cores, {info['cpu_model']}, torch {info['torch']}, ComfyUI "
             f"{info['comfyui']}, load average at start {info['loadavg_start']}, {info['date']}. "
             f"Tiny WAN {args.blocks} blocks, dim 256, {args.steps} steps, 128x128x5. One server per "
             f"variant, all up at once; {args.rounds} rounds, one prompt per variant per round (the "
             "first variant rotates); medians of the per-round ratios to core.", "",
             "| variant | prompt s (median) | step ms (median) | prompt / core | step / core | "
             "new graphs in the rounds | max rel L2 vs eager |", "|---|---|---|---|---|---|---|"]
    for v, r in res["rows"].items():
        lines.append(f"| {v} | {r['exec_s_median']} | {r['step_ms_median'] or 'n/a'} | {r['prompt_vs_core']} | "
                     f"{r['step_vs_core'] or 'n/a'} | {r['new_graphs_in_rounds']} | {r['max_rel_l2_vs_eager']:.1e} |")
    lines += ["", "`ours` is the settings node's defaults (mode speed, shape policy auto, regional); "
              "`ours-default` mode default, `ours-static` shape policy static, `ours-whole` the whole "
              "model as one region. Step times come from a forward pre-hook on the diffusion model, "
              "left out of graphs of the whole diffusion model (core's, `ours-whole`'s: it would "
              "break them in two), so those rows have none. "
              f"Warm-up prompts per variant: {res['warmup_prompts']}.", "",
              f"Target: a steady prompt with the pack <= {TARGET}x core's: "
              f"{'met' if ours <= TARGET else 'NOT met'} ({ours}x).", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "steady_cpu"))
    args = ap.parse_args(argv)
    info = machine_info(sys.argv)
    model = make_tiny_wan(num_layers=args.blocks, dim=256, seed=0)
    res = in_scratch("tcs_steady_bench_", lambda work: measure(model, args.steps, args.rounds, work))
    write_out(args.out, {"machine": info, **res}, markdown(res, info, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
