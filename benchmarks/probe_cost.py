"""What the torch feature probes cost at a server's first Apply Torch Compile, and what keeping
their answers on disk (``compile_core/torch_support/probe_memo.py``) saves after a restart.

Each measurement is a fresh Python process, as a ComfyUI start is: it imports torch and the
pack's ``compile_core``, then times every probe the pack runs (``torch_compat.features()``:
the tiny compiles of each feature, the saved-region round trip, the compile-thread check),
with the answers kept in a folder of its own. ``first start``: an empty folder (a server that
never compiled). ``restart``: the folder the first start filled. The two take turns, ``--pairs``
times, so a noisy spell hits both alike; medians are reported.

    .venv/bin/python benchmarks/probe_cost.py [--pairs 3]

Writes ``benchmarks/results/probe_cost_cpu.json`` and ``.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
CHILD = """
import sys, time
sys.path.insert(0, {repo!r})
import torch
from compile_core.torch_support import probe_memo, torch_compat
probe_memo.use({folder!r})
start = time.perf_counter()
answers = torch_compat.features()
print(time.perf_counter() - start, sum(v is True for v in answers.values()), len(answers))
"""


def one_start(folder: str) -> tuple[float, int, int]:
    """(seconds of every probe, probes answering yes, probes) in a fresh process."""
    out = subprocess.run([sys.executable, "-c", CHILD.format(repo=str(REPO), folder=folder)],
                         check=True, capture_output=True, text=True, cwd=REPO,
                         env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(folder, "inductor")})
    seconds, yes, total = out.stdout.split()[-3:]
    return float(seconds), int(yes), int(total)


def measure(pairs: int) -> dict:
    first, again = [], []
    for _ in range(pairs):
        with tempfile.TemporaryDirectory(prefix="tcs-probes-") as folder:
            s, yes, total = one_start(folder)
            first.append(s)
            again.append(one_start(folder)[0])
    import torch
    return {"torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d"), "command": "python benchmarks/probe_cost.py "
            f"--pairs {pairs}", "probes": total, "probes_yes": yes,
            "first_start_s": first, "restart_s": again,
            "first_start_median_s": round(statistics.median(first), 3),
            "restart_median_s": round(statistics.median(again), 3)}


def markdown(r: dict) -> str:
    saved = r["first_start_median_s"] - r["restart_median_s"]
    return "\n".join([
        "# Torch feature probes at the first Apply Torch Compile (CPU)", "",
        f"`{r['command']}` (torch {r['torch']}, Python {r['python']}, {r['cpus']} CPUs, {r['date']}).",
        "Each start is a fresh process; medians of the pairs.", "",
        "| | every probe (s) |", "|---|---|",
        f"| first start (nothing kept) | {r['first_start_median_s']:.3f} |",
        f"| restart (answers kept on disk) | {r['restart_median_s']:.3f} |", "",
        f"{r['probes']} probes, {r['probes_yes']} answering yes (only a yes is kept). "
        f"Keeping them saves {saved:.2f} s at a restarted server's first Apply.", ""])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS / "probe_cost_cpu")
    args = ap.parse_args()
    r = measure(args.pairs)
    args.out.with_suffix(".json").write_text(json.dumps(r, indent=2) + "\n", encoding="utf-8")
    args.out.with_suffix(".md").write_text(markdown(r), encoding="utf-8")
    print(markdown(r))


if __name__ == "__main__":
    main()
