"""Background compile: the first run with Apply Torch Compile against the first eager run.

Three fresh servers (empty TMPDIR and HOME, fresh inductor and pack cache dirs), one after
another, on the 8-block tiny WAN (dim 256), 20 steps, 128x128x5:

- ``eager``: no Apply node;
- ``foreground``: Apply Torch Compile (mode speed), compiling at the first step on the main thread;
- ``background``: the same with ``background_compile`` on.

Each server first answers ``/object_info``, as it does when the browser opens the page (the
settings node's backend list imports torch's compiler backends then), and the first prompt
comes once the pack's start-up warm-up is done (``compile_core.prewarm.warm_base``: about 2 s
after the server is up here), as when a user opens the page and then queues a prompt. Then it
runs the 20-step prompt 3 times (run 1 is the first run: it includes loading the
model); the background server goes on until a run has swapped the compiled regions in. A test-only node logs every model call with the server's clock and whether the compiled
regions were attached, which gives the step times before and after the swap.

    .venv/bin/python benchmarks/background_benchmark.py [--steps 20] [--blocks 8]

Writes ``benchmarks/results/background_cpu.json`` and ``.md``. Targets: first run
<= 1.15x the first eager run; steps after the swap at the steady compiled step time; output
within 1e-3 of eager.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from run_benchmarks import Run, machine_info, pack_log  # noqa: E402
from harness import ComfyHost, make_tiny_wan, rel_l2, wan_t2v_prompt  # noqa: E402

VARIANTS = {"eager": None, "foreground": {"mode": "speed"},
            "background": {"mode": "speed", "background_compile": True}}
CALL = re.compile(r"TCSTest: call (\d+) regions compiled (\d+) at ([\d.]+)")
TARGET_FIRST_RUN = 1.15
MAX_RUNS = 40  # background: prompts are queued until one runs compiled steps (the swap)


def prompt(model: str, settings: dict | None, steps: int, prefix: str) -> dict:
    p = wan_t2v_prompt(model, compile_settings=settings, apply=settings is not None, steps=steps,
                       prefix=prefix)
    src = ["apply", 0] if settings is not None else ["loader", 0]
    p["timer"] = {"class_type": "TCSTestWaitForBackground", "inputs": {"model": src, "call": 1000}}
    p["sampler"]["inputs"]["model"] = ["timer", 0]
    p["probe"]["inputs"].pop("model", None)
    return p


def steps_of(log: str) -> list[dict]:
    """Per model call: its duration (to the next call's start; the last one has none) and
    whether the compiled regions ran it."""
    calls = [(int(n), int(k), float(t)) for n, k, t in CALL.findall(log)]
    return [{"call": n, "compiled": k > 0,
             "s": round(calls[i + 1][2] - t, 4) if i + 1 < len(calls) else None}
            for i, (n, k, t) in enumerate(calls)]


def one_server(variant: str, model_path: Path, steps: int, runs: int, work: Path) -> dict:
    d = work / variant
    env = {"TORCHINDUCTOR_CACHE_DIR": str(d / "inductor"), "TORCH_COMPILE_SPEED_CACHE_DIR": str(d / "tcs")}
    out: dict = {"runs": []}
    with ComfyHost(d / "server", models=[model_path], env=env, new_container=True) as host:
        host.object_info()  # what the browser asks first: every node's inputs (ours list torch's backends)
        settled(host)
        i = 0
        while i < runs or (variant == "background" and not _swapped(out) and i < MAX_RUNS):
            off = host.log_offset()
            r = Run(host, prompt(model_path.name, VARIANTS[variant], steps, f"{variant}{i}"))
            text = host.log_text(since=off)
            out["runs"].append({"wall_s": round(r.wall, 3), "exec_s": r.exec, "steps": steps_of(text),
                                "pack_log": pack_log(host, off)})
            out.setdefault("latents", []).append(r.latent())
            i += 1
    return out


def settled(host, timeout: float = 60.0) -> None:
    """Until the pack's start-up warm-up is done (a user opens the page, then queues a prompt)."""
    deadline = time.monotonic() + timeout
    while "warmed torch's compile" not in host.log_text() and time.monotonic() < deadline:
        time.sleep(0.2)


def _swapped(out: dict) -> bool:
    return any(s["compiled"] for run in out["runs"] for s in run["steps"])


def summarise(res: dict) -> dict:
    eager_first = res["eager"]["runs"][0]["wall_s"]
    ref = res["eager"]["latents"][0]
    steady = [s["s"] for s in res["foreground"]["runs"][-1]["steps"] if s["compiled"] and s["s"]]
    eager_steps = [s["s"] for s in res["eager"]["runs"][-1]["steps"] if s["s"]]
    out = {"eager_first_run_s": eager_first,
           "eager_step_ms": round(1000 * statistics.median(eager_steps), 2),
           "steady_compiled_step_ms": round(1000 * statistics.median(steady), 2) if steady else None}
    for v in ("foreground", "background"):
        rows = []
        for i, run in enumerate(res[v]["runs"]):
            compiled = [s for s in run["steps"] if s["compiled"]]
            after = [s["s"] for s in compiled[:-1] if s["s"]]  # the last call has no end mark
            rows.append({
                "run": i + 1, "wall_s": run["wall_s"],
                "vs_eager_first_run": round(run["wall_s"] / eager_first, 3),
                "first_compiled_call": compiled[0]["call"] if compiled else None,
                "eager_calls": sum(1 for s in run["steps"] if not s["compiled"]),
                "step_ms_after_swap": round(1000 * statistics.median(after), 2) if after else None,
                "rel_l2_vs_eager": round(rel_l2(res[v]["latents"][i], ref), 8),
            })
        out[v] = rows
    bg = out["background"]
    swap = next((r for r in bg if r["first_compiled_call"]), None)
    out["background_runs_until_swap"] = swap["run"] if swap else None
    out["background_wall_until_swap_run_s"] = round(sum(r["wall_s"] for r in bg[:swap["run"]]), 2) if swap else None
    out["foreground_wall_first_two_runs_s"] = round(sum(r["wall_s"] for r in out["foreground"][:2]), 2)
    first = out["background"][0]
    out["target_first_run_met"] = first["vs_eager_first_run"] <= TARGET_FIRST_RUN
    return out


def markdown(summary: dict, info: dict, args) -> str:
    lines = ["# Background compile, CPU", "",
             f"Command: `{info['command']}`", "",
             f"Machine: {info['nproc']} cores, {info['cpu_model']}, torch {info['torch']}, "
             f"ComfyUI {info['comfyui']}, {info['date']}. Tiny WAN {args.blocks} blocks, dim 256, "
             f"{args.steps} steps, 128x128x5, fresh servers and caches (new container); each server "
             "answered `/object_info` and finished the pack's start-up warm-up before its first "
             "prompt.", "",
             f"First eager run: {summary['eager_first_run_s']} s (eager step "
             f"{summary['eager_step_ms']} ms; steady compiled step {summary['steady_compiled_step_ms']} ms).", "",
             "| variant | run | wall s | x first eager run | first compiled call | eager calls | "
             "step ms after swap | rel L2 vs eager |", "|---|---|---|---|---|---|---|---|"]
    for v in ("foreground", "background"):
        for r in summary[v]:
            lines.append(f"| {v} | {r['run']} | {r['wall_s']} | {r['vs_eager_first_run']} | "
                         f"{r['first_compiled_call']} | {r['eager_calls']} | {r['step_ms_after_swap']} | "
                         f"{r['rel_l2_vs_eager']} |")
    lines += ["", f"Background: the swap came in run {summary['background_runs_until_swap']}; "
              f"wall time of runs 1..that run: {summary['background_wall_until_swap_run_s']} s "
              f"(foreground runs 1-2: {summary['foreground_wall_first_two_runs_s']} s).",
              "", f"Target first run <= {TARGET_FIRST_RUN}x eager: "
              f"{'met' if summary['target_first_run_met'] else 'NOT met'}.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "background_cpu"))
    args = ap.parse_args(argv)
    info = machine_info(sys.argv)
    model = make_tiny_wan(num_layers=args.blocks, dim=256, seed=0)
    res = in_scratch("tcs_bg_bench_", lambda work: {v: one_server(v, model, args.steps, args.runs, work)
                                                      for v in VARIANTS})
    summary = summarise(res)
    for v in res.values():
        v.pop("latents")
    write_out(args.out, {"machine": info, "summary": summary, "raw": res}, markdown(summary, info, args))
    return 0


def in_scratch(prefix: str, fn):
    """``fn(work)`` with a fresh scratch folder, removed after."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        return fn(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def write_out(out: str, data: dict, md: str) -> None:
    """``out``.json and ``out``.md, and the Markdown printed."""
    Path(out + ".json").write_text(json.dumps(data, indent=1))
    Path(out + ".md").write_text(md)
    print(md)


def heading(title: str, m: dict) -> list[str]:
    """A result page's first lines: the title, the command, and the machine (``machine_info``)."""
    return [f"# {title}", "", f"Command: `{m['command']}`", "",
            f"Machine: {m['nproc']} cores, {m['cpu_model']}, torch {m['torch']}, ComfyUI {m['comfyui']}, "
            f"load average at start {m['loadavg_start']}, {m['date']}."]


def report(name: str, data: dict, md: str, no_write: bool) -> None:
    """``benchmarks/results/<name>``.json and .md (``write_out``), or with ``no_write`` the
    Markdown printed only."""
    if no_write:
        print(md)
    else:
        write_out(str(REPO / "benchmarks" / "results" / name), data, md)


if __name__ == "__main__":
    sys.exit(main())
