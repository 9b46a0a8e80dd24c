"""What the pack costs a ComfyUI server whose workflows do not use it.

A new user's first prompt: a fresh server (a new user folder, empty TMPDIR and HOME) gets an
eager tiny-WAN workflow with no node of this pack as soon as it answers. Three variants, their
servers taking turns, one server at a time:

- ``without``: no TorchCompileSpeed in ``custom_nodes``;
- ``with``: the pack linked into ``custom_nodes``;
- ``used before``: the pack linked, on a user folder (and TMPDIR, HOME) where an earlier server
  ran one compiled prompt through Apply Torch Compile (so the pack's persistent cache exists).

Per server: the seconds from posting the prompt to its end; the CPU seconds (user + sys) of the
server process and its children, and the server's resident memory, 20 s after the prompt ended;
the pack's log lines printed before the prompt was posted. The workflow's zero text conditioning
comes from a one-node file of this script (not the test-only node pack, whose import registers
torch backends), so the ``without`` server loads nothing of this project.

    .venv/bin/python benchmarks/guest_benchmark.py [--servers 3] [--blocks 8] [--steps 8] [--threads 0]

Writes ``benchmarks/results/guest_cpu.json`` and ``.md`` (``--out`` for another name). Targets,
medians over the servers against ``without``: first prompt <= 1.10x, CPU <= +1 s, RSS <= +30 MB,
and no pack line at start-up.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from run_benchmarks import Run  # noqa: E402
from background_benchmark import heading, in_scratch, parse_with_threads, torch_threads, write_out  # noqa: E402
from harness import FOREGROUND, ComfyHost, make_tiny_wan, pack_lines, wan_t2v_prompt  # noqa: E402

VARIANTS = ("without", "with", "used before")
SETTLE_S = 20.0  # after the prompt, before CPU and memory are read
TARGET_FIRST = 1.10
TARGET_CPU_S = 1.0
TARGET_RSS_MB = 30.0

ZERO_COND_NODE = '''import torch


class GuestZeroConditioning:
    CATEGORY = "_for_testing"
    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "make"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"length": ("INT", {"default": 8, "min": 1, "max": 512}),
                             "nonce": ("INT", {"default": 0, "min": 0, "max": 2**63 - 1})}}

    def make(self, length, nonce):
        return ([[torch.zeros(1, length, 4096), {}]],)


NODE_CLASS_MAPPINGS = {"GuestZeroConditioning": GuestZeroConditioning}
'''


def workflow(model: str, steps: int, compiled: bool = False) -> dict:
    """UNETLoader -> [Settings -> Apply] -> KSampler -> SaveLatent, zero text conditioning."""
    p = wan_t2v_prompt(model, compile_settings=FOREGROUND if compiled else None, apply=compiled,
                       steps=steps, prefix="guest")
    p["cond"]["class_type"] = "GuestZeroConditioning"
    p.pop("probe")
    return p


def new_host(folder: Path, model: Path, pack: bool, threads: int | None) -> ComfyHost:
    """A server on ``folder`` (its user folder, TMPDIR and HOME are kept there, so a second
    server on the same folder finds what the first left)."""
    env = {}
    for name in ("TMPDIR", "HOME"):
        (folder / name.lower()).mkdir(parents=True, exist_ok=True)
        env[name] = str(folder / name.lower())
    host = ComfyHost(folder / "server", models=[model], env=env, omp_threads=threads,
                     with_pack=pack, with_test_nodes=False)
    (host.base_dir / "custom_nodes" / "guest_zero_cond.py").write_text(ZERO_COND_NODE)
    return host


def use_before(folder: Path, model: Path, steps: int, threads: int | None) -> dict:
    """One compiled prompt through Apply Torch Compile on ``folder``; the pack's cache it left."""
    host = new_host(folder, model, True, threads)
    with host:
        run = Run(host, workflow(model.name, steps, compiled=True))
    cache = host.base_dir / "user" / "torch_compile_speed" / "cache"
    files = [f for f in cache.rglob("*") if f.is_file()]
    return {"compiled_prompt_s": round(run.wall, 3), "cache_files": len(files),
            "cache_mb": round(sum(f.stat().st_size for f in files) / 2**20, 2)}


def cpu_and_rss(pid: int) -> dict:
    """User + sys CPU seconds of the process and its children (live and reaped), and RSS (MB)."""
    root = psutil.Process(pid)
    procs = [root, *root.children(recursive=True)]
    cpu, rss = 0.0, 0
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            t = p.cpu_times()
            cpu += t.user + t.system + t.children_user + t.children_system
            rss += p.memory_info().rss
    return {"cpu_s": round(cpu, 3), "rss_mb": round(root.memory_info().rss / 2**20, 1),
            "rss_with_children_mb": round(rss / 2**20, 1), "children": len(procs) - 1}


def guest_server(folder: Path, model: Path, steps: int, pack: bool, threads: int | None) -> dict:
    """A fresh server's first prompt, posted as soon as it answers, and its cost 20 s later."""
    host = new_host(folder, model, pack, threads)
    since = host.log_offset()  # (a server on a used folder appends to the earlier one's log)
    t0 = time.perf_counter()
    with host:
        up = time.perf_counter() - t0
        startup = pack_lines(host.log_text(since))
        run = Run(host, workflow(model.name, steps))
        time.sleep(SETTLE_S)
        out = {"up_s": round(up, 3), "first_prompt_s": round(run.wall, 3),
               "first_prompt_exec_s": run.exec, **cpu_and_rss(host.proc.pid),
               "startup_pack_lines": startup, "pack_lines": pack_lines(host.log_text(since))}
    return out


def measure(work: Path, model: Path, args) -> dict:
    """The ``used before`` folders are prepared first; then rounds of one server per variant,
    the order turning by one each round."""
    threads = args.threads or None
    res = {v: [] for v in VARIANTS}
    res["use_before"] = [use_before(work / f"used{i}", model, args.steps, threads) for i in range(args.servers)]
    for i in range(args.servers):
        for v in VARIANTS[i % 3:] + VARIANTS[:i % 3]:
            folder = work / f"used{i}" if v == "used before" else work / f"{v}{i}"
            r = guest_server(folder, model, args.steps, v != "without", threads)
            print(f"[{time.strftime('%H:%M:%S')}] {v} {i + 1}: first prompt {r['first_prompt_s']} s, "
                  f"CPU {r['cpu_s']} s, RSS {r['rss_mb']} MB", flush=True)
            res[v].append(r)
    return res


def summarise(res: dict) -> dict:
    med = {v: {k: round(statistics.median(r[k] for r in res[v]), 3)
               for k in ("up_s", "first_prompt_s", "cpu_s", "rss_mb", "rss_with_children_mb")}
           | {"startup_pack_lines": max(len(r["startup_pack_lines"]) for r in res[v])}
           for v in VARIANTS}
    base = med["without"]
    for v in VARIANTS[1:]:
        m = med[v]
        m["first_prompt_ratio"] = round(m["first_prompt_s"] / base["first_prompt_s"], 3)
        m["cpu_delta_s"] = round(m["cpu_s"] - base["cpu_s"], 2)
        m["rss_delta_mb"] = round(m["rss_mb"] - base["rss_mb"], 1)
        m["targets"] = {"first_prompt": m["first_prompt_ratio"] <= TARGET_FIRST,
                        "cpu": m["cpu_delta_s"] <= TARGET_CPU_S,
                        "rss": m["rss_delta_mb"] <= TARGET_RSS_MB,
                        "startup_lines": m["startup_pack_lines"] == 0}
    return med


def _mark(ok: bool) -> str:
    return "met" if ok else "missed"


def markdown(s: dict, res: dict, info: dict, args) -> str:
    lines = heading("What the pack costs a server that does not use it, CPU", info) + [
        "", f"Tiny WAN {args.blocks} blocks, dim 256, an eager {args.steps}-step prompt (128x128x5) with "
        f"no node of this pack, posted as soon as the server answered; fresh user folder, TMPDIR and "
        f"HOME per server; {args.servers} server(s) per variant, taking turns; "
        f"{_threads(args)}. CPU (user + sys, the server and its children) and RSS (the server "
        f"process) {SETTLE_S:.0f} s after the prompt ended. Medians over the servers.", "",
        "| variant | up s | first prompt s | x without | CPU s | CPU delta s | RSS MB | RSS delta MB "
        "| RSS with children MB | pack lines at start-up |",
        "|---|---|---|---|---|---|---|---|---|---|"]
    for v in VARIANTS:
        m = s[v]
        lines.append(f"| {v} | {m['up_s']} | {m['first_prompt_s']} | {m.get('first_prompt_ratio', '')} | "
                     f"{m['cpu_s']} | {m.get('cpu_delta_s', '')} | {m['rss_mb']} | {m.get('rss_delta_mb', '')} | "
                     f"{m['rss_with_children_mb']} | {m['startup_pack_lines']} |")
    lines.append("")
    for v in VARIANTS[1:]:
        m, t = s[v], s[v]["targets"]
        lines.append(f"- {v}: first prompt {m['first_prompt_ratio']}x (target <= {TARGET_FIRST}: "
                     f"{_mark(t['first_prompt'])}), CPU {m['cpu_delta_s']:+} s (target <= +{TARGET_CPU_S}: "
                     f"{_mark(t['cpu'])}), RSS {m['rss_delta_mb']:+} MB (target <= +{TARGET_RSS_MB:.0f}: "
                     f"{_mark(t['rss'])}), {m['startup_pack_lines']} pack line(s) at start-up "
                     f"(target none: {_mark(t['startup_lines'])}).")
    prep = res["use_before"]
    lines += [f"- Before `used before`: one compiled prompt (Apply Torch Compile, compiling in the prompt) "
              f"per folder, {statistics.median(p['compiled_prompt_s'] for p in prep):.1f} s median; the pack's "
              f"cache then held {statistics.median(p['cache_files'] for p in prep):.0f} files, "
              f"{statistics.median(p['cache_mb'] for p in prep):.1f} MB (medians).", ""]
    startup = next((r["startup_pack_lines"] for v in VARIANTS[1:] for r in res[v] if r["startup_pack_lines"]), [])
    if startup:
        lines += ["Pack lines at start-up (first server that printed any):", "", "```", *startup, "```", ""]
    return "\n".join(lines)


def _threads(args) -> str:
    if args.threads:
        return f"{args.threads} intra-op thread(s) per server"
    return f"{torch_threads()} intra-op threads per server (torch's own choice, as a user's server)"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--servers", type=int, default=3, help="servers per variant")
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "guest_cpu"))
    args, info = parse_with_threads(ap, argv)
    model = make_tiny_wan(num_layers=args.blocks, dim=256, seed=0)
    res = in_scratch("tcs_guest_", lambda work: measure(work, model, args))
    summary = summarise(res)
    write_out(args.out, {"machine": info, "summary": summary, "raw": res}, markdown(summary, res, info, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
