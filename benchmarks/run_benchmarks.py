"""CPU benchmark in the real ComfyUI host: eager vs ComfyUI core ``TorchCompileModel`` vs this pack
(whole-model and regional), side by side on tiny random-weight WAN 2.1 models.

Every figure except the Apply-node overhead is measured over ComfyUI's HTTP API: ComfyUI servers
(``tests/host/harness.py``: ``main.py --cpu --use-pytorch-cross-attention``, OMP_NUM_THREADS=1)
run workflows posted to ``/prompt``, one server at a time. See ``benchmarks/README.md`` for what
each figure means.

    .venv/bin/python benchmarks/run_benchmarks.py            # full run (~20-25 min on 2 cores)
    .venv/bin/python benchmarks/run_benchmarks.py --quick    # smoke run (2-block model only)
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
BENCH_DIR = REPO_ROOT / "benchmarks"
sys.path.insert(0, str(REPO_ROOT / "tests" / "host"))
sys.path.insert(0, str(REPO_ROOT))  # compile_core (pure torch)
from harness import (COMFY_DIR, HOST_VERSION, PYTHON, ComfyHost, counters_delta,  # noqa: E402
                     make_tiny_wan, rel_l2, wan_t2v_prompt)

VARIANTS = ("eager", "core", "ours-whole", "ours-regional")
COMPILED_VARIANTS = ("core", "ours-whole", "ours-regional")
DEFAULT_MODELS = ("l2d256", "l8d256", "l16d256", "l8d512")
FIRST_SIZE = (128, 128, 5)  # width x height x frames: latent [1, 16, 2, 16, 16]
SWEEP_SIZES = ((160, 128, 5), (128, 192, 9), (96, 96, 1), (192, 160, 13), (128, 128, 17))
OURS_SETTINGS = {
    # the settings node's defaults (mode speed); whole-model is the other setting of its toggle
    "ours-whole": {"mode": "speed", "compile_transformer_blocks_only": False},
    "ours-regional": {"mode": "speed", "compile_transformer_blocks_only": True},
}
# The pack's targets (benchmarks/README.md): name -> threshold
TARGETS = {
    "cold_regional_vs_core": 0.5,
    "depth_16_vs_2": 1.25,
    "restart_vs_cold": 0.15,
    "sweep_recompiles": 0,
    "steady_compiled_vs_eager": 0.85,
    "apply_overhead_ms": 5.0,
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def parse_model(spec: str) -> tuple[int, int]:
    """``l8d512`` -> (8 blocks, dim 512)."""
    s = spec.lower().strip()
    if not (s.startswith("l") and "d" in s):
        raise argparse.ArgumentTypeError(f"model spec {spec!r}: use lNdM, e.g. l8d256")
    layers, dim = s[1:].split("d", 1)
    return int(layers), int(dim)


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def dir_bytes(path: Path) -> int:
    from compile_core.cache.persist import dir_size
    return dir_size(path)


# --------------------------------------------------------------------------- prompts

def build_prompt(variant: str, model_name: str, *, size=FIRST_SIZE, steps=4, prefix="out",
                 probe_model=False) -> dict:
    """The WAN T2V workflow of the harness for one variant. The probe node reports the process
    dynamo counters; its MODEL input (a state_dict walk) is only connected when asked for."""
    w, h, f = size
    kw = dict(steps=steps, width=w, height=h, length=f, prefix=prefix)
    if variant in OURS_SETTINGS:
        p = wan_t2v_prompt(model_name, compile_settings=OURS_SETTINGS[variant], **kw)
    else:
        p = wan_t2v_prompt(model_name, apply=False, **kw)
        if variant == "core":
            p["compile"] = {"class_type": "TorchCompileModel",
                            "inputs": {"model": ["loader", 0], "backend": "inductor"}}
            p["sampler"]["inputs"]["model"] = ["compile", 0]
            p["probe"]["inputs"]["model"] = ["compile", 0]
        elif variant != "eager":
            raise ValueError(variant)
    if not probe_model:
        p["probe"]["inputs"].pop("model", None)
    return p


class Run:
    """One prompt: HTTP wall time (POST /prompt .. /history says done, polled every 20 ms) and the
    server's own execution time (execution_start .. execution_success timestamps, 1 ms)."""

    def __init__(self, host: ComfyHost, prompt: dict, timeout: float = 900.0):
        t0 = time.perf_counter()
        self.hist = host.run(prompt, timeout=timeout)
        self.wall = time.perf_counter() - t0
        stamps = {ev: d.get("timestamp") for ev, d in self.hist["status"].get("messages", [])}
        start, end = stamps.get("execution_start"), stamps.get("execution_success")
        self.exec = (end - start) / 1000.0 if start is not None and end is not None else None
        self.host = host

    @property
    def counters(self) -> dict:
        return self.host.probe(self.hist)["counters"]

    def latent(self):
        return self.host.latent(self.hist)


def graphs_between(before: Run, after: Run) -> int:
    return counters_delta(before.counters, after.counters).get("stats", {}).get("unique_graphs", 0)


def pack_log(host: ComfyHost, since: int) -> list[str]:
    return [ln.strip() for ln in host.log_text(since).splitlines() if "[TorchCompileSpeed]" in ln]


# --------------------------------------------------------------------------- measurements

def cold_or_restart(host: ComfyHost, variant: str, name: str, label: str) -> dict:
    """One eager prompt (loads the model), then the first compiled prompt, timed."""
    eager = Run(host, build_prompt("eager", name, prefix=f"{label}_load"))
    off = host.log_offset()
    first = Run(host, build_prompt(variant, name, prefix=f"{label}_first"))
    delta = counters_delta(eager.counters, first.counters)
    out = {
        "eager_first_prompt_s": round(eager.wall, 3),  # includes loading the model
        "first_compiled_prompt_s": round(first.wall, 3),
        "first_compiled_exec_s": first.exec,
        "new_graphs": delta.get("stats", {}).get("unique_graphs", 0),
        "fxgraph_cache": {k: v for k, v in delta.get("inductor", {}).items() if k.startswith("fxgraph")},
        "counters_delta": {g: v for g, v in delta.items() if g in ("stats", "inductor", "aot_autograd",
                                                                    "recompiles", "graph_break")},
        "rel_l2_vs_eager": round(rel_l2(first.latent(), eager.latent()), 8),
        "pack_log": pack_log(host, off),
        "loadavg": loadavg(),
    }
    log(f"    {label}: first compiled prompt {first.wall:.2f} s ({out['new_graphs']} graphs, "
        f"fxgraph {out['fxgraph_cache']}), eager load prompt {eager.wall:.2f} s")
    return out


def steady(host: ComfyHost, variant: str, name: str, reps: int) -> dict:
    """Interleaved 4-step and 1-step prompts, eager and compiled, after warm-up, same server."""
    for i in range(2):  # warm-up (also covers any lazily compiled path of a 1-step run)
        Run(host, build_prompt(variant, name, prefix="warm_c"))
        Run(host, build_prompt(variant, name, steps=1, prefix="warm_c1"))
        Run(host, build_prompt("eager", name, prefix="warm_e"))
    first = last = None
    t = {("e", 4): [], ("c", 4): [], ("e", 1): [], ("c", 1): []}
    walls = {("e", 4): [], ("c", 4): []}
    lat = {}
    for i in range(reps):
        order = [("e", 4), ("c", 4), ("e", 1), ("c", 1)]
        if i % 2:
            order = [("c", 4), ("e", 4), ("c", 1), ("e", 1)]
        for kind, steps in order:
            r = Run(host, build_prompt("eager" if kind == "e" else variant, name, steps=steps,
                                       prefix=f"steady_{kind}{steps}"))
            first = first or r
            last = r
            t[(kind, steps)].append(r.exec)
            if steps == 4:
                walls[(kind, steps)].append(r.wall)
                lat[kind] = r
    me4, mc4, me1, mc1 = (median(t[k]) for k in (("e", 4), ("c", 4), ("e", 1), ("c", 1)))
    step_e = (me4 - me1) / 3 if None not in (me4, me1) else None
    step_c = (mc4 - mc1) / 3 if None not in (mc4, mc1) else None
    paired = [c / e for c, e in zip(t[("c", 4)], t[("e", 4)]) if c and e]
    out = {
        "reps": reps,
        "exec_s": {f"{k}{s}": v for (k, s), v in t.items()},
        "wall_s": {f"{k}{s}": [round(x, 4) for x in v] for (k, s), v in walls.items()},
        "median_exec_s": {"eager_4step": me4, "compiled_4step": mc4, "eager_1step": me1,
                          "compiled_1step": mc1},
        "median_wall_s": {"eager_4step": median(walls[("e", 4)]), "compiled_4step": median(walls[("c", 4)])},
        "ratio_per_prompt": ratio(mc4, me4),
        "ratio_per_prompt_paired_median": median(paired),
        "step_s": {"eager": step_e, "compiled": step_c},
        "ratio_per_step": ratio(step_c, step_e),
        "fixed_overhead_s": {"eager": None if step_e is None else me1 - step_e,
                             "compiled": None if step_c is None else mc1 - step_c},
        "new_graphs_during_steady": graphs_between(first, last),
        "rel_l2_compiled_vs_eager": round(rel_l2(lat["c"].latent(), lat["e"].latent()), 8),
        "loadavg": loadavg(),
    }
    log(f"    steady: eager {me4 * 1e3:.1f} ms/prompt, compiled {mc4 * 1e3:.1f} ms/prompt "
        f"(x{out['ratio_per_prompt']:.3f}); per step eager {step_e * 1e3:.1f} ms, compiled "
        f"{step_c * 1e3:.1f} ms (x{(out['ratio_per_step'] or float('nan')):.3f}); "
        f"{out['new_graphs_during_steady']} new graphs")
    return out


def sweep(host: ComfyHost, variant: str, name: str, sizes) -> dict:
    """After the first compile at 128x128x5: each new size eagerly, then compiled (timed, graphs)."""
    rows = []
    off = host.log_offset()
    for w, h, f in sizes:
        e = Run(host, build_prompt("eager", name, size=(w, h, f), prefix=f"sweep_e{w}x{h}x{f}"))
        c = Run(host, build_prompt(variant, name, size=(w, h, f), prefix=f"sweep_c{w}x{h}x{f}"))
        delta = counters_delta(e.counters, c.counters)
        rows.append({"size": f"{w}x{h}x{f}", "new_graphs": delta.get("stats", {}).get("unique_graphs", 0),
                     "recompile_counters": delta.get("recompiles", {}),
                     "compiled_prompt_s": round(c.wall, 3), "eager_prompt_s": round(e.wall, 3),
                     "rel_l2_vs_eager": round(rel_l2(c.latent(), e.latent()), 8)})
        log(f"    sweep {w}x{h}x{f}: {rows[-1]['new_graphs']} new graphs, compiled {c.wall:.2f} s, "
            f"eager {e.wall:.2f} s")
    total_c = sum(r["compiled_prompt_s"] for r in rows)
    total_e = sum(r["eager_prompt_s"] for r in rows)
    return {"sizes": rows, "total_new_graphs": sum(r["new_graphs"] for r in rows),
            "total_compiled_s": round(total_c, 3), "total_extra_over_eager_s": round(total_c - total_e, 3),
            "pack_log": pack_log(host, off), "loadavg": loadavg()}


def bench_pair(spec: str, model_path: Path, variant: str, work: Path, args, info: dict) -> dict:
    """Cold server (cold first run + steady), then a restarted server on the same cache dirs
    (first run after restart + shape sweep)."""
    d = work / model_path.stem / variant
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    env = {"TORCHINDUCTOR_CACHE_DIR": str(d / "inductor_cache"),
           "TORCH_COMPILE_SPEED_CACHE_DIR": str(d / "tcs_cache")}
    res: dict = {"dirs": env}
    name = model_path.name
    for phase in ("cold", "restart"):
        host = ComfyHost(d / "server", models=[model_path], env=env, new_container=True)  # empty TMPDIR, HOME
        t0 = time.perf_counter()
        with host:
            res[f"{phase}_server_start_s"] = round(time.perf_counter() - t0, 2)
            if variant == "core" and "core_node_inputs" not in info:
                node = host.object_info("TorchCompileModel")
                info["core_node_inputs"] = node["input"]
            res[phase] = cold_or_restart(host, variant, name, phase)
            if phase == "cold":
                res["steady"] = steady(host, variant, name, args.steady_reps)
            elif args.sweep_sizes and spec in args.sweep_models:
                res["sweep"] = sweep(host, variant, name, SWEEP_SIZES[:args.sweep_sizes])
        res[f"{phase}_cache_bytes"] = {k: dir_bytes(Path(v)) for k, v in env.items()}
    res["restart_vs_cold"] = ratio(res["restart"]["first_compiled_prompt_s"],
                                   res["cold"]["first_compiled_prompt_s"])
    if not args.keep_work:
        shutil.rmtree(d, ignore_errors=True)
    return res


def eager_only(model_path: Path, work: Path, args) -> dict:
    """Only used when no compiled variant was asked for: eager first prompt and steady time."""
    d = work / model_path.stem / "eager"
    shutil.rmtree(d, ignore_errors=True)
    with ComfyHost(d / "server", models=[model_path]) as host:
        first = Run(host, build_prompt("eager", model_path.name, prefix="load"))
        runs = {4: [], 1: []}
        for _ in range(args.steady_reps):
            for s in (4, 1):
                runs[s].append(Run(host, build_prompt("eager", model_path.name, steps=s, prefix="e")).exec)
    if not args.keep_work:
        shutil.rmtree(d, ignore_errors=True)
    m4, m1 = median(runs[4]), median(runs[1])
    return {"first_prompt_s_per_server": [first.wall], "median_exec_4step_s_per_server": [m4],
            "step_s_per_server": [(m4 - m1) / 3]}


# --------------------------------------------------------------------------- in-process workers

def _comfy_import_setup(*comfy_args: str):
    sys.path.insert(0, str(COMFY_DIR))
    sys.path.append(str(REPO_ROOT))  # after ComfyUI: the pack's ``nodes`` must not shadow ComfyUI's
    sys.argv = [sys.argv[0], "--cpu", *comfy_args]
    import comfy.options
    comfy.options.enable_args_parsing()


def worker_apply_overhead(calls: int) -> dict:
    """Time ``compile_core.run.engine.prepare`` on a reuse-registry hit for a ComfyUI WanModel with
    WAN 2.1 1.3B block dimensions on the meta device."""
    import gc
    import logging
    import tempfile
    _comfy_import_setup()
    import torch
    import comfy.ops
    from comfy.ldm.wan.model import WanModel
    from compile_core.run import engine
    from compile_core.cache.persist import PersistentCache
    from compile_core.cache.registry import ReuseRegistry
    from compile_core.plan.settings import CompileSettings, build_compile_args

    # Like the server: the pack's INFO line is formatted and written for every prepare().
    logging.basicConfig(level=logging.INFO, stream=open(os.devnull, "w"))

    def build():
        return WanModel(model_type="t2v", dim=1536, ffn_dim=8960, num_layers=30, num_heads=12,
                        in_dim=16, out_dim=16, text_dim=4096, device="meta",
                        operations=comfy.ops.disable_weight_init)

    t = time.perf_counter()
    m1 = build()
    build_s = time.perf_counter() - t
    out = {"model": {"class": "comfy.ldm.wan.model.WanModel", "dim": 1536, "ffn_dim": 8960,
                     "num_layers": 30, "num_heads": 12, "text_dim": 4096, "device": "meta",
                     "parameters": sum(p.numel() for p in m1.parameters()),
                     "tensors": len(list(m1.named_parameters())) + len(list(m1.named_buffers())),
                     "build_s": round(build_s, 3)},
           "calls": calls, "torch": torch.__version__}
    tmp = tempfile.mkdtemp(prefix="tcs_bench_apply_")
    try:
        for label, blocks_only in (("regional", True), ("whole", False)):
            settings = CompileSettings.from_args(build_compile_args(
                backend="inductor", mode="default", compile_transformer_blocks_only=blocks_only))
            registry = ReuseRegistry()
            persistent = PersistentCache(tmp)  # what the node passes (PersistentCache.default)

            def prep(m):
                gc.collect()  # garbage from building models must not be charged to prepare()
                t0 = time.perf_counter_ns()
                cm = engine.prepare(m, settings, registry=registry, persistent=persistent)
                return (time.perf_counter_ns() - t0) / 1e6, cm

            miss_ms, cm = prep(m1)
            assert not cm.reused
            same = []
            for _ in range(calls):
                ms, cm = prep(m1)
                assert cm.reused
                same.append(ms)
            fresh = []
            for _ in range(calls):  # a new object each time: its structure digest is not cached yet
                m2 = build()
                ms, cm = prep(m2)
                assert cm.reused and m2 is not m1
                fresh.append(ms)
            again = [prep(m2)[0] for _ in range(calls)]
            out[label] = {
                "regions": cm.description,
                "first_prepare_miss_ms": round(miss_ms, 3),
                "same_object_hit_ms": {"median": median(same), "min": min(same), "max": max(same)},
                "new_object_same_structure_hit_ms": {"median": median(fresh), "min": min(fresh),
                                                     "max": max(fresh)},
                "second_object_repeat_hit_ms": {"median": median(again), "min": min(again),
                                                "max": max(again)},
            }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


_STARTUP_SNIPPET = r"""
import json, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
f = torch.compile(lambda x: torch.sin(x) * 2 + 1)
f(torch.randn(64))
t2 = time.perf_counter()
g = torch.compile(lambda x: torch.cos(x) * 3 - 1)
g(torch.randn(64))
t3 = time.perf_counter()
print(json.dumps({"import_torch_s": t1 - t0, "first_tiny_compile_s": t2 - t1,
                  "second_tiny_compile_s": t3 - t2}))
"""


def startup_probe(work: Path) -> dict:
    """The fixed cost of the first compile in a process: a trivial function compiled in a fresh
    process with an empty inductor cache dir, then again in a new process on the same dir."""
    d = work / "startup_probe"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_CACHE_DIR": str(d / "inductor")}
    out = {}
    for label in ("cold", "warm_cache_dir"):
        p = subprocess.run([PYTHON, "-c", _STARTUP_SNIPPET], env=env, capture_output=True, text=True,
                           timeout=600)
        if p.returncode:
            raise RuntimeError(p.stderr[-3000:])
        out[label] = {k: round(v, 3) for k, v in json.loads(p.stdout.strip().splitlines()[-1]).items()}
    shutil.rmtree(d, ignore_errors=True)
    return out


def run_worker(kind: str, *wargs) -> dict:
    cmd = [PYTHON, str(Path(__file__).resolve()), "--worker", kind, *wargs]
    p = subprocess.run(cmd, cwd=COMFY_DIR, capture_output=True, text=True, timeout=900,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    if p.returncode:
        raise RuntimeError(f"worker {kind} failed:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- environment

def _rel(path: str) -> str:
    """``path`` relative to the repository, or its bare name outside it (results name no
    machine's folders)."""
    absolute = Path(os.path.abspath(path))  # (not resolved: .venv/bin/python is a link out)
    return str(absolute.relative_to(REPO_ROOT)) if absolute.is_relative_to(REPO_ROOT) else absolute.name


def machine_info(argv) -> dict:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    torch_v = subprocess.run([PYTHON, "-c", "import torch; print(torch.__version__)"],
                             capture_output=True, text=True).stdout.strip()

    def git(*a):
        return subprocess.run(["git", *a], cwd=REPO_ROOT, capture_output=True, text=True).stdout.strip()

    dirty = git("status", "--porcelain", "--", "compile_core", "nodes", "__init__.py")
    host_env = [f"TCS_COMFY_HOST={os.environ['TCS_COMFY_HOST']}"] if os.environ.get("TCS_COMFY_HOST") else []
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "nproc": os.cpu_count(),
        "cpu_model": cpu,
        "mem_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024 ** 3, 1),
        "python": platform.python_version(),
        "torch": torch_v,
        "comfyui": HOST_VERSION,
        "git_commit": git("rev-parse", "HEAD"),
        "git_dirty_pack_files": dirty.splitlines(),
        "OMP_NUM_THREADS": "1 (set by ComfyHost for every server and by this script's workers)",
        "attention": "--use-pytorch-cross-attention (SDPA)",
        "command": " ".join([*host_env, _rel(sys.executable), _rel(argv[0]), *argv[1:]]),
        "loadavg_start": loadavg(),
    }


# --------------------------------------------------------------------------- report

def _fmt(x, unit="", digits=2):
    if x is None:
        return "n/a"
    if isinstance(x, float):
        return f"{x:.{digits}f}{unit}"
    return f"{x}{unit}"


def evaluate(results: dict) -> list[dict]:
    """The targets: one row each, with the measured value(s) and met / missed."""
    pairs = results["pairs"]

    def get(model, variant, *keys):
        v = pairs.get(model, {}).get(variant)
        for k in keys:
            if not isinstance(v, dict) or k not in v:
                return None
            v = v[k]
        return v

    models = list(pairs)
    dims = {m: parse_model(m) for m in models}
    rows = []

    # 1. cold ours-regional / core on >= 8-block models
    vals = {}
    for m in models:
        if dims[m][0] >= 8:
            vals[m] = ratio(get(m, "ours-regional", "cold", "first_compiled_prompt_s"),
                            get(m, "core", "cold", "first_compiled_prompt_s"))
    row = _row("Cold first run, ours-regional / core (>= 8 blocks)", "<= 0.5", vals,
               lambda v: v <= TARGETS["cold_regional_vs_core"])
    row["measured"] = ", ".join(
        f"{m}: {_fmt(v)} ({_fmt(get(m, 'ours-regional', 'cold', 'first_compiled_prompt_s'), digits=1)} s / "
        f"{_fmt(get(m, 'core', 'cold', 'first_compiled_prompt_s'), digits=1)} s)" for m, v in vals.items()) or "n/a"
    rows.append(row)

    # 2. depth scaling 16 / 2 blocks (dim 256), ours-regional is the target; others reported
    fixed = ((results.get("startup_probe") or {}).get("cold") or {}).get("first_tiny_compile_s")
    for variant in ("ours-regional", "ours-whole", "core"):
        c16 = get("l16d256", variant, "cold", "first_compiled_prompt_s")
        c2 = get("l2d256", variant, "cold", "first_compiled_prompt_s")
        row = _row(f"Cold first run, 16 / 2 blocks (dim 256), {variant}",
                   "<= 1.25" if variant.startswith("ours") else "(reported)", {"16/2": ratio(c16, c2)},
                   (lambda x: x <= TARGETS["depth_16_vs_2"]) if variant.startswith("ours") else None)
        if c16 and c2:
            row["measured"] += f" ({c16:.1f} s / {c2:.1f} s"
            if fixed and c2 > fixed:
                row["measured"] += f"; {(c16 - fixed) / (c2 - fixed):.2f} with the {fixed:.1f} s fixed start-up removed"
            row["measured"] += ")"
        rows.append(row)

    # 3. restart / cold for ours
    for variant in ("ours-regional", "ours-whole", "core"):
        vals = {m: get(m, variant, "restart_vs_cold") for m in models}
        rows.append(_row(f"First run after restart / cold first run, {variant}",
                         "<= 0.15" if variant.startswith("ours") else "(reported)", vals,
                         (lambda x: x <= TARGETS["restart_vs_cold"]) if variant.startswith("ours") else None))

    # 4. recompiles over the sweep
    for variant in ("ours-regional", "ours-whole", "core"):
        vals = {m: get(m, variant, "sweep", "total_new_graphs") for m in models}
        n = len(results["config"]["sweep_sizes"])
        rows.append(_row(f"New graphs over {n} new latent size(s) after the first compile, {variant}",
                         "= 0" if variant.startswith("ours") else "(reported)", vals,
                         (lambda x: x == 0) if variant.startswith("ours") else None, digits=0))

    # 5. steady compiled / eager on dim 512 (per step, fixed per-prompt overhead subtracted)
    for variant in ("ours-regional", "ours-whole", "core"):
        big = [m for m in models if dims[m][1] >= 512]
        vals = {m: get(m, variant, "steady", "ratio_per_step") for m in big}
        row = _row(f"Steady step compiled / eager (dim 512, per model call; per prompt in brackets), {variant}",
                   "<= 0.85" if variant.startswith("ours") else "(reported)", vals,
                   (lambda x: x <= TARGETS["steady_compiled_vs_eager"]) if variant.startswith("ours") else None,
                   digits=3)
        row["measured"] = ", ".join(
            f"{m}: {_fmt(vals[m], digits=3)} ({_fmt(get(m, variant, 'steady', 'ratio_per_prompt'), digits=3)})"
            for m in big) or "n/a"
        rows.append(row)

    # outputs: every compiled prompt against the eager prompt with the same seed and size
    for variant in ("ours-regional", "ours-whole", "core"):
        vals = {m: max_rel_l2(pairs[m][variant]) for m in models
                if variant in pairs[m] and "error" not in pairs[m][variant]}
        rows.append(_row(f"Output vs eager, max relative L2 over all compiled prompts, {variant}",
                         "<= 1e-3", vals, lambda x: x <= 1e-3, digits=1, fmt="e"))

    # 6. apply overhead on a reuse hit
    ao = results.get("apply_overhead") or {}
    for label in ("regional", "whole"):
        r = ao.get(label) or {}
        vals = {"same object": (r.get("same_object_hit_ms") or {}).get("median"),
                "new object, same structure": (r.get("new_object_same_structure_hit_ms") or {}).get("median")}
        rows.append(_row(f"Apply overhead on a reuse hit, ms ({label}, WAN 1.3B dims, meta)", "<= 5 ms",
                         vals, lambda x: x <= TARGETS["apply_overhead_ms"], digits=3))
    return rows


def max_rel_l2(r: dict) -> float:
    errs = [r["cold"]["rel_l2_vs_eager"], r["restart"]["rel_l2_vs_eager"],
            r.get("steady", {}).get("rel_l2_compiled_vs_eager", 0)]
    errs += [s["rel_l2_vs_eager"] for s in (r.get("sweep") or {}).get("sizes", [])]
    return max(errs)


def _row(name, target, vals: dict, check, digits=2, fmt="f") -> dict:
    present = {k: v for k, v in vals.items() if v is not None}
    if check is None:
        verdict = "reported" if present else "not run"
    elif not present:
        verdict = "not run"
    else:
        ok = all(check(v) for v in present.values())
        verdict = "MET" if ok else "MISSED"
        if ok and len(present) < len(vals):
            verdict = "met (partial data)"
    shown = ", ".join(f"{k}: {_fmt(v, digits=digits) if fmt == 'f' or v is None else format(v, f'.{digits}e')}"
                      for k, v in vals.items()) or "n/a"
    return {"figure": name, "target": target, "measured": shown, "verdict": verdict,
            "values": vals}


def write_markdown(results: dict, path: Path) -> None:
    info = results["machine"]
    L = ["# TorchCompileSpeed CPU benchmark (real ComfyUI host)", ""]
    if results["config"].get("quick"):
        L += ["**Quick smoke run** (`--quick`): one model, fewer sweep sizes; not the reference figures.", ""]
    L.append(f"- date: {info['date']}; git commit `{info['git_commit'][:12]}`"
             + (f" (+ uncommitted changes in {len(info['git_dirty_pack_files'])} pack file(s))"
                if info["git_dirty_pack_files"] else ""))
    L.append(f"- ComfyUI {info.get('comfyui', '0.3.75')}; ours: the settings node's defaults "
             f"({results['config']['ours_settings'].get('ours-regional')})")
    L.append(f"- machine: {info['nproc']} CPU(s), {info['cpu_model']}, {info['mem_gb']} GB; "
             f"torch {info['torch']}; OMP_NUM_THREADS=1; SDPA attention")
    L.append(f"- load average (1/5/15 min): start {info['loadavg_start']}, end {results.get('loadavg_end')}"
             " -- other jobs shared this machine; see benchmarks/README.md on noise")
    L.append(f"- command: `{info['command']}`; total {results.get('total_s', 0) / 60:.1f} min")
    L.append("- workflow: UNETLoader -> [compile node] -> KSampler (euler, cfg 1, 4 steps) -> SaveLatent; "
             "latent 128x128x5 unless noted; times are per prompt over HTTP unless noted")
    L += ["", "## Targets", "", "| figure | target | measured | verdict |", "|---|---|---|---|"]
    for r in results["targets"]:
        L.append(f"| {r['figure']} | {r['target']} | {r['measured']} | {r['verdict']} |")
    L += ["", "## Per model and variant", "",
          "| model | variant | cold first run s | after restart s | restart/cold | fxgraph hits on restart "
          "| steady eager ms/prompt | steady compiled ms/prompt | ratio per prompt | ratio per step "
          "| sweep new graphs | sweep compiled s (extra over eager) | max rel L2 vs eager |",
          "|" + "---|" * 13]
    for model, variants in results["pairs"].items():
        for variant, r in variants.items():
            if "error" in r:
                L.append(f"| {model} | {variant} | error: {r['error'].splitlines()[-1][:120]} |" + " |" * 11)
                continue
            st, sw = r.get("steady", {}), r.get("sweep")
            me = st.get("median_exec_s", {})
            L.append("| " + " | ".join([
                model, variant, _fmt(r["cold"]["first_compiled_prompt_s"]),
                _fmt(r["restart"]["first_compiled_prompt_s"]), _fmt(r.get("restart_vs_cold"), digits=3),
                _fmt(r["restart"]["fxgraph_cache"].get("fxgraph_cache_hit", 0)),
                _fmt(me.get("eager_4step") and me["eager_4step"] * 1e3, digits=1),
                _fmt(me.get("compiled_4step") and me["compiled_4step"] * 1e3, digits=1),
                _fmt(st.get("ratio_per_prompt"), digits=3), _fmt(st.get("ratio_per_step"), digits=3),
                _fmt(sw and sw["total_new_graphs"]),
                "n/a" if not sw else f"{sw['total_compiled_s']:.1f} ({sw['total_extra_over_eager_s']:.1f})",
                f"{max_rel_l2(r):.1e}"]) + " |")
    if results.get("eager"):
        L += ["", "## Eager reference (same servers)", "",
              "| model | first eager prompt s (model load + run), median over servers "
              "| eager ms/prompt, median over servers | eager ms per model call |", "|---|---|---|---|"]
        for model, e in results["eager"].items():
            firsts = e.get("first_prompt_s_per_server") or []
            per = e.get("median_exec_4step_s_per_server") or []
            steps = e.get("step_s_per_server") or []
            L.append(f"| {model} | {_fmt(median(firsts))} | {_fmt(median(per) and median(per) * 1e3, digits=1)} "
                     f"| {_fmt(median(steps) and median(steps) * 1e3, digits=1)} |")
    sweeps = [(m, v, r["sweep"]) for m, vs in results["pairs"].items() for v, r in vs.items() if r.get("sweep")]
    if sweeps:
        L += ["", "## Shape sweep detail (new graphs / compiled prompt s / rel L2 vs eager)", "",
              "| model | variant | " + " | ".join(results["config"]["sweep_sizes"]) + " |",
              "|---|---|" + "---|" * len(results["config"]["sweep_sizes"])]
        for m, v, sw in sweeps:
            L.append(f"| {m} | {v} | " + " | ".join(
                f"{s['new_graphs']} / {s['compiled_prompt_s']:.1f} / {s['rel_l2_vs_eager']:.1e}"
                for s in sw["sizes"]) + " |")
    sp = results.get("startup_probe")
    if sp:
        L += ["", "## Fixed start-up cost of the first compile in a process", "",
              f"A trivial function compiled in a fresh process: {sp['cold']['first_tiny_compile_s']:.1f} s "
              f"with an empty inductor cache dir ({sp['warm_cache_dir']['first_tiny_compile_s']:.1f} s with "
              f"that dir kept); a second trivial function in the same process: "
              f"{sp['cold']['second_tiny_compile_s']:.2f} s. Every cold first run above includes this fixed "
              "cost, which dilutes the depth and regional/core ratios toward 1."]
    ao = results.get("apply_overhead")
    if ao:
        L += ["", "## Apply-node overhead (in process, `compile_core.run.engine.prepare`)", "",
              f"ComfyUI `WanModel` with WAN 2.1 1.3B dims (dim 1536, ffn 8960, 30 blocks, 12 heads, text_dim "
              f"4096; {ao['model']['parameters'] / 1e9:.2f} B params, {ao['model']['tensors']} tensors) on "
              f"the meta device; median of {ao['calls']} calls.", "",
              "| plan | registry miss (first prepare) ms | hit, same object ms (min) "
              "| hit, new object same structure ms (min) | hit, that second object again ms (min) |",
              "|---|---|---|---|---|"]
        for label in ("regional", "whole"):
            r = ao[label]
            L.append(f"| {label} ({r['regions']}) | {r['first_prepare_miss_ms']:.3f} | "
                     + " | ".join(f"{r[k]['median']:.3f} ({r[k]['min']:.3f})" for k in (
                         "same_object_hit_ms", "new_object_same_structure_hit_ms",
                         "second_object_repeat_hit_ms")) + " |")
    if results.get("errors"):
        L += ["", "## Errors", ""] + [f"- {e}" for e in results["errors"]]
    path.write_text("\n".join(L) + "\n")


# --------------------------------------------------------------------------- main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS),
                    help="comma-separated lNdM specs (N blocks, dim M), default %(default)s")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="subset of %(default)s")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: l2d256 only, 2 sweep sizes, 5 steady reps, results under benchmarks/_work/")
    ap.add_argument("--steady-reps", type=int, default=7, help="interleaved reps (>= 5), default %(default)s")
    ap.add_argument("--sweep-sizes", type=int, default=5, help="how many of the 5 new sizes (0 = skip)")
    ap.add_argument("--sweep-models", default="l2d256",
                    help="models that get the shape sweep ('all' = every model; default %(default)s, "
                         "the cheapest: the recompile count does not depend on depth)")
    ap.add_argument("--apply-calls", type=int, default=50)
    ap.add_argument("--no-apply-overhead", action="store_true")
    ap.add_argument("--no-startup-probe", action="store_true")
    ap.add_argument("--out", default=None, help="results path without suffix "
                    "(default benchmarks/results/cpu_results, or benchmarks/_work/quick_results with --quick)")
    ap.add_argument("--work", default=str(BENCH_DIR / "_work" / "run"), help="scratch dir (wiped per pair)")
    ap.add_argument("--keep-work", action="store_true", help="keep server dirs and caches")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("worker_args", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.worker == "apply-overhead":
        print(json.dumps(worker_apply_overhead(int(args.worker_args[0]))))
        return 0

    if args.quick:
        args.models = "l2d256"
        args.sweep_sizes = min(args.sweep_sizes, 2)
        args.steady_reps = 5
    args.steady_reps = max(args.steady_reps, 5)
    models = [m.strip().lower() for m in args.models.split(",") if m.strip()]
    for m in models:
        parse_model(m)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = set(variants) - set(VARIANTS)
    if bad:
        ap.error(f"unknown variants {sorted(bad)}; choose from {', '.join(VARIANTS)}")
    args.sweep_models = [m.strip().lower() for m in args.sweep_models.split(",") if m.strip()]
    if args.sweep_models == ["all"] or not set(args.sweep_models) & set(models):
        args.sweep_models = list(models) if args.sweep_models == ["all"] else models[:1]
    out = Path(args.out) if args.out else (BENCH_DIR / "_work" / "quick_results" if args.quick
                                           else BENCH_DIR / "results" / "cpu_results")
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)

    t_all = time.perf_counter()
    results = {"machine": machine_info(sys.argv if argv is None else [sys.argv[0], *argv]),
               "config": {"quick": args.quick, "models": models, "variants": variants, "steady_reps": args.steady_reps,
                          "steps": 4, "first_size": "x".join(map(str, FIRST_SIZE)),
                          "sweep_sizes": ["x".join(map(str, s)) for s in SWEEP_SIZES[:args.sweep_sizes]],
                          "sweep_models": args.sweep_models or models,
                          "ours_settings": OURS_SETTINGS,
                          "core_node": {"class_type": "TorchCompileModel", "backend": "inductor"}},
               "pairs": {}, "eager": {}, "errors": []}
    log(f"machine: {results['machine']['cpu_model']} x{results['machine']['nproc']}, "
        f"load {results['machine']['loadavg_start']}")

    def save():
        results["loadavg_end"] = loadavg()
        results["total_s"] = round(time.perf_counter() - t_all, 1)
        results["targets"] = evaluate(results)
        out.with_suffix(".json").write_text(json.dumps(results, indent=1, default=str))
        write_markdown(results, out.with_suffix(".md"))

    if not args.no_startup_probe:
        log("startup probe: trivial compile in a fresh process ...")
        try:
            results["startup_probe"] = startup_probe(work)
            log(f"  {results['startup_probe']}")
        except Exception as exc:  # noqa: BLE001 - keep going, report it
            results["errors"].append(f"startup probe: {exc}")

    compiled = [v for v in variants if v in COMPILED_VARIANTS]
    for m in models:
        layers, dim = parse_model(m)
        path = make_tiny_wan(num_layers=layers, dim=dim)
        results["pairs"][m] = {}
        for v in compiled:
            log(f"{m} ({layers} blocks, dim {dim}) / {v}  [load {loadavg()}]")
            t = time.perf_counter()
            try:
                results["pairs"][m][v] = bench_pair(m, path, v, work, args, results["config"])
            except Exception as exc:  # noqa: BLE001
                results["pairs"][m][v] = {"error": traceback.format_exc()}
                results["errors"].append(f"{m}/{v}: {exc!r}"[:500])
                log(f"  FAILED: {exc!r}"[:2000])
            log(f"  done in {time.perf_counter() - t:.0f} s")
            save()
        if "eager" in variants:
            steadies = [r["steady"] for r in results["pairs"][m].values() if "steady" in r]
            firsts = [r[p]["eager_first_prompt_s"] for r in results["pairs"][m].values() if "cold" in r
                      for p in ("cold", "restart")]
            if steadies:
                results["eager"][m] = {
                    "first_prompt_s_per_server": firsts,  # model load + run
                    "median_exec_4step_s_per_server": [s["median_exec_s"]["eager_4step"] for s in steadies],
                    "step_s_per_server": [s["step_s"]["eager"] for s in steadies]}
            else:
                results["eager"][m] = eager_only(path, work, args)
            save()

    if not args.no_apply_overhead and any(v.startswith("ours") for v in variants):
        log("apply overhead: engine.prepare on a reuse hit, WAN 1.3B dims on meta ...")
        try:
            results["apply_overhead"] = run_worker("apply-overhead", str(args.apply_calls))
            ao = results["apply_overhead"]
            log(f"  regional: same object {ao['regional']['same_object_hit_ms']['median']:.3f} ms, "
                f"new object {ao['regional']['new_object_same_structure_hit_ms']['median']:.3f} ms")
        except Exception as exc:  # noqa: BLE001
            results["errors"].append(f"apply overhead: {exc}"[:3000])
            log(f"  FAILED: {exc}"[:3000])
    save()
    log(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')} in {results['total_s'] / 60:.1f} min")
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
