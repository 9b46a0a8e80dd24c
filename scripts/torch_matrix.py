"""The torch matrix: the demo, the unit tests and the host foundation tests on each torch version.

For each version it builds ``.venv-torch/<version>/`` if needed (``scripts/torch_env.sh``), then
runs with that venv's python (so the ComfyUI 0.33.0 host runs on the same torch):

- ``scripts/demo.py --json`` (settings node defaults, mode speed): compiled or not, graphs,
  relative L2 to eager, cold and restart seconds, saved regions used or why not;
- ``pytest tests/unit``;
- ``pytest tests/host/test_foundation.py``.

Results go to ``benchmarks/results/torch_matrix.json`` and ``.md``, with the command that made
them. A run over a subset (``--versions 2.9.1``) replaces those versions' rows and keeps the
others (each row records its own command and date). Exit status 1 when anything failed.

    .venv/bin/python scripts/torch_matrix.py                      # 2.8.0 ... 2.14.1 2.15.0
    .venv/bin/python scripts/torch_matrix.py --versions 2.9.1 --skip-demo

Several minutes per version on 2 cores (plus a few GB and minutes per venv built once).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import shlex
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VERSIONS = ["2.8.0", "2.9.1", "2.11.0", "2.13.0", "2.14.1", "2.15.0"]
RESULTS = ROOT / "benchmarks" / "results" / "torch_matrix"
SUITES = {"unit": ["tests/unit"], "foundation": ["tests/host/test_foundation.py"]}


def log(msg: str) -> None:
    print(f"[torch_matrix] {msg}", flush=True)


def tail(text: str, n: int = 40) -> str:
    return "\n".join(text.splitlines()[-n:])


def child_cpu() -> float:
    """CPU seconds (user + system) of the finished child processes so far: on a shared machine
    this says more about a step's cost than its wall time."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def build_env(ver: str) -> tuple[str, float]:
    t = time.monotonic()  # the build's own time is in its log line "[torch_env] ... ready in"
    proc = subprocess.run(["bash", "scripts/torch_env.sh", ver], cwd=ROOT, stdout=subprocess.PIPE,
                          text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"scripts/torch_env.sh {ver} failed ({proc.returncode})")
    return proc.stdout.strip().splitlines()[-1], time.monotonic() - t


def child_env(ver: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TCS_PYTHON", "VIRTUAL_ENV", "PYTHONPATH")}
    env["TCS_COMFY_HOST"] = "0.33.0"
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def versions_of(py: str) -> dict:
    code = ("import json, torch, torchvision, torchaudio; print(json.dumps({'torch': torch.__version__, "
            "'torchvision': torchvision.__version__, 'torchaudio': torchaudio.__version__}))")
    proc = subprocess.run([py, "-c", code], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"import_error": tail(proc.stderr, 5)}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def features_of(py: str, ver: str) -> dict:
    """The pack's own probe of this torch (compile_core.plan.preflight.torch_features), when it has one."""
    code = ("import json; from compile_core.plan.preflight import torch_features; "
            "print(json.dumps(torch_features()))")
    try:
        proc = subprocess.run([py, "-c", code], cwd=ROOT, env=child_env(ver), capture_output=True,
                              text=True, timeout=900)
    except subprocess.TimeoutExpired:
        return {"error": "timeout"}
    if proc.returncode != 0:
        return {"error": tail(proc.stderr, 3)}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_demo(py: str, ver: str, demo_args: list[str], timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="tcs_matrix_") as tmp:
        out = Path(tmp) / "demo.json"
        cmd = [py, "scripts/demo.py", "--json", str(out), *demo_args]
        t, cpu = time.monotonic(), child_cpu()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=child_env(ver), capture_output=True, text=True,
                                  timeout=timeout)
            rc, text = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as exc:
            out_ = exc.stdout or ""
            rc, text = "timeout", out_.decode(errors="replace") if isinstance(out_, bytes) else out_
        result = json.loads(out.read_text()) if out.exists() else {"ok": False}
    result.pop("json", None)  # the temporary file's own path
    result.get("args", {}).pop("json", None)
    result["exit_code"] = rc
    result["seconds"] = round(time.monotonic() - t, 1)
    result["cpu_seconds"] = round(child_cpu() - cpu, 1)
    if rc != 0:
        result["output_tail"] = tail(text, 30)
    return result


def run_pytest(py: str, ver: str, name: str, paths: list[str], extra: list[str], timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="tcs_matrix_") as tmp:
        xml = Path(tmp) / "junit.xml"
        cmd = [py, "-m", "pytest", *paths, "-q", "-p", "no:cacheprovider",
               "--continue-on-collection-errors",  # one module that fails to import hides no others
               f"--basetemp={ROOT}/.host/pytest-tmp-torch-{ver}", f"--junitxml={xml}", *extra]
        t, cpu = time.monotonic(), child_cpu()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=child_env(ver), capture_output=True, text=True,
                                  timeout=timeout)
            rc, text = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired:
            rc, text = "timeout", ""
        res = {"exit_code": rc, "seconds": round(time.monotonic() - t, 1),
               "cpu_seconds": round(child_cpu() - cpu, 1),
               "passed": 0, "failed": 0, "skipped": 0, "failing": []}
        if xml.exists():
            for case in ET.parse(xml).iter("testcase"):
                tid = f"{case.get('classname', '')}::{case.get('name', '')}"
                if case.find("failure") is not None or case.find("error") is not None:
                    res["failed"] += 1
                    node = case.find("failure") if case.find("failure") is not None else case.find("error")
                    res["failing"].append({"test": tid,
                                           "message": (node.get("message") or "").splitlines()[0][:300]
                                           if node.get("message") else ""})
                elif case.find("skipped") is not None:
                    res["skipped"] += 1
                else:
                    res["passed"] += 1
    if rc not in (0, 1) or (rc == 1 and not res["failed"]):
        res["output_tail"] = tail(text, 30)  # collection error, crash or timeout
    log(f"{ver} {name}: {res['passed']} passed, {res['failed']} failed, {res['skipped']} skipped "
        f"in {res['seconds']:.0f}s, {res['cpu_seconds']:.0f} CPU-s (exit {rc})")
    return res


def ok(row: dict) -> bool:
    if row.get("error"):
        return False
    if "demo" in row and not row["demo"].get("ok"):
        return False
    return all(row[s]["exit_code"] == 0 for s in SUITES if s in row)


def load_rows() -> dict:
    try:
        return json.loads(RESULTS.with_suffix(".json").read_text()).get("versions", {})
    except (OSError, ValueError):
        return {}


def write(own: dict, command: str, fresh: bool = False) -> None:
    """Rows of the versions run now (``own``) over the file's other rows, re-read at each write so
    that two runs over different versions can go at the same time."""
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    rows = {} if fresh else load_rows()
    rows.update(own)
    order = sorted(rows, key=lambda v: tuple(int(x) for x in v.split(".")))
    data = {"command": command, "updated": now(), "versions": {v: rows[v] for v in order}}
    RESULTS.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    RESULTS.with_suffix(".md").write_text(markdown(data, order))


def fmt(v, spec=""):
    if v is None or v == "":
        return "-"
    return format(v, spec) if spec else str(v)


def markdown(data: dict, order: list[str]) -> str:
    out = ["# Torch matrix", "",
           "Demo (`scripts/demo.py`, settings node defaults, mode speed, ComfyUI 0.33.0, CPU), "
           "`tests/unit` and `tests/host/test_foundation.py`, each with the torch of "
           "`.venv-torch/<version>/` (`scripts/torch_env.sh`).", "",
           f"Command: `{data['command']}` (updated {data['updated']}; each version's own command is "
           "in the JSON).", "",
           "| torch | demo | compiled | graphs (restart) | rel L2 | cold s | background compile s "
           "| restart s | compiled after restart s | saved regions used | unit | foundation |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for v in order:
        r = data["versions"][v]
        d = r.get("demo", {})
        t = r.get("installed", {}).get("torch", v)
        cells = [t]
        if "error" in r:
            out.append(f"| {t} | error: {r['error']} |||||||||||")
            continue
        if d:
            cells += ["OK" if d.get("ok") else f"FAILED (exit {d.get('exit_code')})",
                      fmt(d.get("compiled")),
                      f"{fmt(d.get('graphs'))} ({fmt(d.get('restart_graphs'))})", fmt(d.get("rel_l2"), ".1e"),
                      fmt(d.get("cold_s"), ".1f"), fmt(d.get("background_compile_s"), ".1f"),
                      fmt(d.get("restart_s"), ".1f"),
                      fmt(d.get("restarted_s"), ".2f"), fmt(d.get("saved_regions_used"))]
        else:
            cells += ["not run"] + ["-"] * 8
        for s in SUITES:
            p = r.get(s)
            cells.append(f"{p['passed']} passed, {p['failed']} failed, {p['seconds']:.0f}s"
                         + (" (exit %s)" % p["exit_code"] if p["exit_code"] not in (0, 1) else "")
                         if p else "not run")
        out.append("| " + " | ".join(cells) + " |")
    out.append("")
    for v in order:
        r = data["versions"][v]
        d = r.get("demo", {})
        notes = []
        feats = r.get("features") or {}
        if feats:
            notes.append("- torch features (compile_core.plan.preflight.torch_features): " + (
                f"probe failed: {feats['error']}" if "error" in feats else
                ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in feats.items())))
        if d.get("problems"):
            notes.append("- demo problems: " + "; ".join(d["problems"]))
        for line in d.get("fallback", []):
            notes.append(f"- demo fallback: `{line}`")
        for line in d.get("saved_regions_why_not", [])[:3]:
            notes.append(f"- saved regions: `{line}`")
        if d.get("output_tail") and not d.get("problems"):
            notes.append("- demo output tail:\n\n```\n" + tail(d["output_tail"], 12) + "\n```")
        for s in SUITES:
            for f in (r.get(s) or {}).get("failing", []):
                notes.append(f"- {s} failed: `{f['test']}`" + (f": {f['message']}" if f["message"] else ""))
            if (r.get(s) or {}).get("output_tail"):
                notes.append(f"- {s} output tail:\n\n```\n" + tail(r[s]["output_tail"], 12) + "\n```")
        if notes:
            out += [f"## torch {r.get('installed', {}).get('torch', v)}", "",
                    f"`{r.get('command', '')}` ({r.get('date', '')}; env "
                    f"{r.get('env_seconds', 0):.0f}s, ~0 when already built)", "", *notes, ""]
    return "\n".join(out) + "\n"


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--versions", nargs="+", default=VERSIONS, metavar="VER",
                    help=f"torch versions (default: {' '.join(VERSIONS)})")
    ap.add_argument("--skip-demo", action="store_true")
    ap.add_argument("--skip-tests", action="store_true", help="only the demo")
    ap.add_argument("--demo-args", default="", help="extra demo.py arguments, e.g. '--blocks 4'")
    ap.add_argument("--pytest-args", default="", help="extra pytest arguments, e.g. '-x'")
    ap.add_argument("--fresh", action="store_true", help="drop the rows of versions not run now")
    args = ap.parse_args()
    command = "python scripts/torch_matrix.py" + ("" if sys.argv[1:] == [] else " " + shlex.join(sys.argv[1:]))

    rows = {}  # this run's versions; write() keeps the file's other rows unless --fresh
    failed = False
    for ver in args.versions:
        row = {"command": command, "date": now()}
        rows[ver] = row
        try:
            log(f"{ver}: environment")
            py, row["env_seconds"] = build_env(ver)
            row["env_seconds"] = round(row["env_seconds"], 1)
            row["python"] = os.path.relpath(py, ROOT)
            row["installed"] = versions_of(py)
            row["features"] = features_of(py, ver)
            # the tests run before the demo writes its row: the docs-tables unit test compares
            # the docs with the results file as committed, not with this run's half-written one
            if not args.skip_tests:
                for name, paths in SUITES.items():
                    log(f"{ver}: {name} tests")
                    row[name] = run_pytest(py, ver, name, paths, shlex.split(args.pytest_args),
                                           timeout=3600)
                    write(rows, command, args.fresh)
            if not args.skip_demo:
                log(f"{ver}: demo")
                row["demo"] = run_demo(py, ver, shlex.split(args.demo_args), timeout=3600)
                d = row["demo"]
                log(f"{ver} demo: {'OK' if d.get('ok') else 'FAILED'} compiled={d.get('compiled')} "
                    f"graphs={d.get('graphs')} cold={d.get('cold_s')}s restart={d.get('restart_s')}s "
                    f"in {d['seconds']:.0f}s")
                write(rows, command, args.fresh)
        except Exception as exc:  # keep going with the other versions
            row["error"] = f"{type(exc).__name__}: {exc}"
            log(f"{ver}: {row['error']}")
        failed |= not ok(row)
        write(rows, command, args.fresh)
    log(f"wrote {RESULTS.with_suffix('.json').relative_to(ROOT)} and .md")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
